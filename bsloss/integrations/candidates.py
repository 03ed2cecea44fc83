r"""Where the BERTScore term's candidates come from: the labels' teacher-forced distributions, or
the model's own answers re-scored under teacher forcing.

By default (:class:`TeacherForced`) the candidate of row :math:`i` is the sequence of the
model's next-token distributions along its reference :math:`y_i`,
:math:`p_\theta(\cdot \mid x_i, y_{i,<t})`. With :class:`SampledAnswers` (or
:class:`GreedyAnswers`) the model first answers each prompt itself, without gradient,
:math:`\hat y_i \sim p_\theta(\cdot \mid x_i)`, and the candidate is the distributions along
that answer, :math:`p_\theta(\cdot \mid x_i, \hat y_{i,<t})`; the term
:math:`1 - F_{\mathrm{BERT}}(\hat y_i, y_i)` is differentiated through those distributions (their
expected embeddings), not through the sampling. The cross-entropy stays on the references.

Scoring the model's own outputs is what sequence-level training does (minimum risk training,
Shen et al. 2016; Wieting et al. 2019), here with a differentiable term instead of a reward.
In this package's efficacy study (``recipes/RESULTS.md``: Gemma 3 270M, es→en, 3 seeds from a
CE-converged start) sampled answers with the :class:`~bsloss.integrations.term_weights.Balanced`
weight were the one differentiable setting that beat continued cross-entropy (independent
F_BERT +0.0107 [+0.0060, +0.0155]); the same term on teacher-forced candidates gained +0.0031.

A source is a small object: ``generates`` says whether it needs the model's answers, and
:meth:`ModelAnswers.answer` builds them for a Hugging Face batch (causal: ``input_ids`` with
the prompt's labels ``-100``; encoder-decoder: the encoder's ``input_ids``). The answers join
the batch as extra rows, so one forward pass (one DDP reduction) gives both the references'
and the answers' outputs.

>>> resolve_candidates("sample")  # doctest: +NORMALIZE_WHITESPACE
SampledAnswers(sample=True, max_new_tokens=None, top_k=0, top_p=1.0, temperature=1.0,
               rows=None, every=1)
>>> resolve_candidates("teacher_forced").generates
False
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bsloss._warnings import warn_user
from bsloss.functional.fused_expectation import IGNORE_INDEX
from bsloss.functional.matching import check_temperature
from bsloss.inputs import check_int

__all__ = [
    "CandidateSource",
    "TeacherForced",
    "ModelAnswers",
    "SampledAnswers",
    "GreedyAnswers",
    "JointBatch",
    "resolve_candidates",
    "generate_ids",
    "NEUTRAL_GENERATION",
    "generated_labels",
    "pad_labels",
]

# the batch entries a generated-candidates step understands (others would need rebuilding for
# the answer rows: packing's position_ids, token_type_ids, images)
ANSWERABLE_KEYS = frozenset({"input_ids", "attention_mask"})


class CandidateSource:
    """Where the candidates come from; ``generates``: the model answers first."""

    generates = False


@dataclass(frozen=True)
class TeacherForced(CandidateSource):
    """The labels' teacher-forced next-token distributions (the default)."""


@dataclass(frozen=True)
class JointBatch:
    """The references' rows and the answers' rows as one batch for one forward pass.

    Attributes:
        inputs: the model's keyword inputs, ``B + R`` rows (the batch's, then the answers').
        candidate_labels: ``[R, L']`` the answers' token ids, ``-100`` outside them.
        width: the batch's own sequence width (its part of the output is cut back to it; the
            answers' part to ``candidate_labels``' width).
        candidate_rows: ``[R]`` the batch rows the answers answer (``None``: all ``B``, in
            order).
    """

    inputs: dict
    candidate_labels: Tensor
    width: int
    candidate_rows: Tensor | None = None

    def split(self, output: Tensor) -> tuple[Tensor, Tensor]:
        """The forward output ``[B + R, L, ...]`` as (the batch's rows, the answers' rows)."""
        answered = self.candidate_labels.shape[0]
        own, answers = output[:-answered], output[-answered:]
        return own[:, : self.width], answers[:, : self.candidate_labels.shape[1]]


@dataclass(frozen=True, kw_only=True)
class ModelAnswers(CandidateSource):
    """The model's own answers, generated without gradient, as the candidates. Every option is
    a keyword (``SampledAnswers(64)`` would say nothing of which one 64 is).

    Args:
        sample: sample the answers (``False``: greedy); fixed by :class:`SampledAnswers` and
            :class:`GreedyAnswers`, which do not take it.
        max_new_tokens: the answers' length limit; ``None``: the batch's longest reference.
        top_k: sample among the ``top_k`` most likely tokens (``0``: the whole vocabulary).
        top_p: nucleus sampling's mass (``1.0``: off).
        temperature: the sampling temperature.
        rows: answer this many of the batch's rows per answering step (``None``: all). The
            rows rotate with the training step (step ``s`` answers rows ``s*rows, ...,
            s*rows + rows - 1`` modulo the batch size), so every batch position is answered
            in turn; the term is the answered rows' token-weighted mean, the CE stays on all
            rows. A batch with at most ``rows`` rows is answered whole.
        every: answer on every ``every``-th training step only (steps ``0, every, 2*every,
            ...``); the steps between are the cross-entropy alone (no generation, no term),
            so the term's weight acts on answering steps only: ``Balanced(every)`` keeps its
            mean over steps (``recipes/RESULTS.md``: ``rows=2, every=4`` with
            ``Balanced(4.0)`` kept a third of the full arm's gain at 1.27x a CE step).
        streamer: ``model.generate``'s ``streamer`` for every answering call (e.g. progress on
            a terminal while a step generates); not one of the options: it takes no part in
            equality or the repr.

    The answers follow these options only: the settings of the model's ``generation_config``
    that would change the distribution, the answers' length or the output's layout (a
    repetition penalty, n-gram blocking, a minimum length, ...: :data:`NEUTRAL_GENERATION`)
    are passed at their neutral values; its special ids stay. Other decoding is a subclass
    overriding :meth:`generate`.

    Raises:
        TypeError: ``sample`` not a bool; ``max_new_tokens``, ``top_k``, ``rows`` or
            ``every`` not an integer (a bool, a float), ``top_p`` or ``temperature`` not a
            number (a bool, a string); each named; an option passed by position. Integers
            and numbers of any type (numpy's included) are stored as Python ``int`` /
            ``float``.
        ValueError: a ``max_new_tokens``, ``rows`` or ``every`` below 1, a negative
            ``top_k``, ``top_p`` outside ``(0, 1]`` or a ``temperature`` that is not a
            finite number ``> 0``; a sampling option (``top_k``, ``top_p``,
            ``temperature``) away from its default on greedy answers.
    """

    sample: bool = True
    max_new_tokens: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    rows: int | None = None
    every: int = 1
    streamer: Any = field(default=None, compare=False, repr=False)
    generates = True

    def __post_init__(self):
        name = type(self).__name__
        if not isinstance(self.sample, bool):  # a truthy 0.0 or "no" must not decide it
            raise TypeError(f"{name}(sample) must be a bool, got {self.sample!r}")
        # numbers of any numeric type (numpy's included) are stored as Python ones, so that
        # generate() and the repr see plain values; a bool is refused (True is not a length)
        checked = {
            "top_k": check_int(self.top_k, f"{name}(top_k)", 0),
            "temperature": check_temperature(self.temperature, f"{name}(temperature)"),
            "every": check_int(self.every, f"{name}(every)", 1),
        }
        for option in ("max_new_tokens", "rows"):
            if getattr(self, option) is not None:
                checked[option] = check_int(getattr(self, option), f"{name}({option})", 1)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real):
            raise TypeError(f"{name}(top_p) must be a number, got {self.top_p!r}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise ValueError(f"{name}(top_p) must be in (0, 1], got {self.top_p!r}")
        checked["top_p"] = float(self.top_p)
        if not self.sample:  # generate() would run greedy without them, silently
            for option, default in (("top_k", 0), ("top_p", 1.0), ("temperature", 1.0)):
                if checked[option] != default:
                    raise ValueError(
                        f"{name}({option}={checked[option]!r}): a sampling option, which greedy "
                        "decoding does not use (SampledAnswers samples)"
                    )
        for option, value in checked.items():  # a frozen dataclass: set past its __setattr__
            object.__setattr__(self, option, value)

    def answers_at(self, step: int) -> bool:
        """Whether training step ``step`` (``0, 1, ...``) answers (``every``)."""
        return step % self.every == 0

    def answered_rows(self, batch_size: int, step: int = 0) -> Tensor | None:
        """The batch rows step ``step`` answers (``rows`` of them, rotating), ``None``: all."""
        if self.rows is None or self.rows >= batch_size:
            return None
        start = (step // self.every) * self.rows
        return (start + torch.arange(self.rows)) % batch_size

    def generate(self, model, input_ids: Tensor, attention_mask: Tensor, **options) -> Tensor:
        """The answering call: :func:`generate_ids` (the explicit options only, the model's
        ``generation_config`` neutralised but for its special ids). A source with other
        decoding is a subclass overriding this method, e.g. adding
        ``repetition_penalty=1.2`` to ``options``."""
        return generate_ids(model, input_ids, attention_mask, **options)

    def answer(
        self,
        model,
        inputs: dict,
        labels: Tensor,
        *,
        causal: bool,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        step: int = 0,
    ) -> JointBatch:
        """The model's answers to the batch's prompts, joined to the batch (see
        :class:`JointBatch`).

        Args:
            model: the (unwrapped) model; it generates in eval mode, its mode restored after.
            inputs: the batch's model inputs, ``input_ids`` and ``attention_mask`` only.
            labels: ``[B, L]``, ``-100`` outside the completion; for a causal model a row's
                prompt is every position before its first label.
            causal: decoder-only (the prompt is in ``input_ids``) or encoder-decoder.
            pad_token_id, eos_token_ids: padding and the tokens that end an answer. An answer
                is every token up to and including its first end token (see
                :func:`generated_labels`), so it always has one token at least and keeps its
                end token also where the padding id is an end id.
            step: the training step, which picks the answered rows (``rows``).

        Raises:
            ValueError: other inputs than ``input_ids`` / ``attention_mask`` (packed or
                multimodal batches), or, causal, a row whose completion has no prompt before it.
        """
        extra = sorted(set(inputs) - ANSWERABLE_KEYS - {"decoder_input_ids"})
        if extra:
            raise ValueError(
                f"{type(self).__name__}: the batch has {extra}; the model's answers are built "
                f"from input_ids and attention_mask only (no packed / padding-free batches, no "
                f"multimodal inputs): use the teacher-forced candidates for such batches"
            )
        batch_ids = inputs["input_ids"]
        if labels.dim() != 2 or labels.shape[0] != batch_ids.shape[0]:
            raise ValueError(
                f"labels must be [B, L] with input_ids' {batch_ids.shape[0]} rows, got "
                f"{list(labels.shape)}"
            )
        eos_token_ids = end_token_ids(eos_token_ids, "eos_token_ids")
        batch_mask = inputs.get("attention_mask")
        if batch_mask is None:
            batch_mask = torch.ones_like(batch_ids)
        subset = self.answered_rows(batch_ids.shape[0], step)
        picked = slice(None) if subset is None else subset.to(batch_ids.device)
        batch_labels = labels
        input_ids, attention_mask, labels = batch_ids[picked], batch_mask[picked], labels[picked]
        targets = labels != IGNORE_INDEX
        longest = int(targets.sum(1).max()) if labels.numel() else 0
        max_new_tokens = self.max_new_tokens or max(longest, 1)
        options = dict(
            max_new_tokens=max_new_tokens,
            sample=self.sample,
            top_k=self.top_k,
            top_p=self.top_p,
            temperature=self.temperature,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_ids,
        )
        if self.streamer is not None:
            options["streamer"] = self.streamer
        if not causal:
            # the decoder's start token, then the answer: both in the decoder's positions
            options["max_new_tokens"] = _fitted_budget(model, 1, max_new_tokens, decoder=True)
            sequences = self.generate(model, input_ids, attention_mask, **options)
            answers = generated_labels(sequences, eos_token_ids)
            answers[~targets.any(1)] = IGNORE_INDEX  # a row without a reference scores nothing
            joined = torch.cat(pad_labels([batch_labels, answers]))
            return JointBatch(
                inputs={
                    "input_ids": torch.cat([batch_ids, input_ids]),
                    "attention_mask": torch.cat([batch_mask, attention_mask]),
                    "decoder_input_ids": model.prepare_decoder_input_ids_from_labels(labels=joined),
                },
                candidate_labels=answers,
                width=batch_labels.shape[1],
                candidate_rows=subset,
            )
        prompts = _causal_prompts(input_ids, attention_mask, targets)
        left = _pad_rows(prompts, pad_token_id, side="left")
        options["max_new_tokens"] = _fitted_budget(model, left.shape[1], max_new_tokens)
        sequences = self.generate(model, left, _mask(prompts, "left"), **options)
        # generated_labels drops its first column (a seq2seq decoder start): here the last
        # prompt column
        answers = generated_labels(sequences[:, left.shape[1] - 1 :], eos_token_ids)
        rows, row_labels = [], []
        for prompt, answer in zip(prompts, answers, strict=True):
            # the answer is a prefix (generated_labels: -100 only after its end token), fed
            # back as generated: a padding id inside it is a token like any other
            tokens = answer[: int((answer != IGNORE_INDEX).sum())]
            rows.append(torch.cat([prompt, tokens]))
            row_labels.append(torch.cat([torch.full_like(prompt, IGNORE_INDEX), tokens]))
        width = max(batch_ids.shape[1], max(len(r) for r in rows))
        answer_ids = _pad_rows(rows, pad_token_id, side="right", width=width)
        answer_mask = _mask(rows, "right", width=width)
        candidate_labels = _pad_rows(row_labels, IGNORE_INDEX, side="right")
        candidate_labels[~targets.any(1)] = IGNORE_INDEX  # a row without a reference: nothing
        grow = width - batch_ids.shape[1]
        return JointBatch(
            inputs={
                "input_ids": torch.cat(
                    [torch.nn.functional.pad(batch_ids, (0, grow), value=pad_token_id), answer_ids]
                ),
                "attention_mask": torch.cat(
                    [torch.nn.functional.pad(batch_mask, (0, grow), value=0), answer_mask]
                ),
            },
            candidate_labels=candidate_labels,
            width=batch_ids.shape[1],
            candidate_rows=subset,
        )


@dataclass(frozen=True, kw_only=True)
class SampledAnswers(ModelAnswers):
    """The model's sampled answers (from the whole distribution by default): the study's
    ``sampled`` arm. The options of :class:`ModelAnswers`, as keywords, less ``sample``.

    >>> SampledAnswers(64)
    Traceback (most recent call last):
    TypeError: SampledAnswers.__init__() takes 1 positional argument but 2 were given
    """

    sample: bool = field(default=True, init=False)


@dataclass(frozen=True, kw_only=True)
class GreedyAnswers(ModelAnswers):
    """The model's greedy answers. The options of :class:`ModelAnswers`, as keywords, less
    ``sample`` (and the sampling ones, ``top_k``, ``top_p``, ``temperature``, which greedy
    decoding does not use)."""

    sample: bool = field(default=False, init=False)


CANDIDATE_SOURCES = {
    "teacher_forced": TeacherForced,
    "sample": SampledAnswers,
    "greedy": GreedyAnswers,
}


def resolve_candidates(
    candidates: str | CandidateSource, name: str = "candidates"
) -> CandidateSource:
    """A :class:`CandidateSource` from itself or its name (``teacher_forced``, ``sample``,
    ``greedy``); anything else refused, named."""
    if isinstance(candidates, CandidateSource):
        return candidates
    if isinstance(candidates, str) and candidates in CANDIDATE_SOURCES:
        return CANDIDATE_SOURCES[candidates]()
    raise ValueError(
        f"{name} must be one of {sorted(CANDIDATE_SOURCES)} or a CandidateSource "
        f"(TeacherForced(), SampledAnswers(...), GreedyAnswers(...)), got {candidates!r}"
    )


def _causal_prompts(input_ids: Tensor, attention_mask: Tensor, targets: Tensor) -> list[Tensor]:
    """Each row's prompt: its attended tokens before its first label; a row whose labels have
    gaps (a multi-turn row with an assistant-only loss) is refused: its answer would follow
    the first turn's prompt alone and be scored against every turn's completion joined."""
    prompts = []
    for i, (ids, mask, row) in enumerate(zip(input_ids, attention_mask, targets, strict=True)):
        start = int(row.int().argmax()) if row.any() else len(row)
        prompt = ids[:start][mask[:start].bool()]
        if row.any() and len(prompt) == 0:
            raise ValueError(
                f"labels row {i}: its completion starts at position {start} with no prompt "
                f"token before it; the model's answers need a prompt (labels -100 on it)"
            )
        if row.any():
            end = len(row) - int(row.flip(0).int().argmax())  # one past the last label
            if not bool(row[start:end].all()):
                raise ValueError(
                    f"labels row {i} has -100 between its labels (positions {start} to "
                    f"{end - 1}: a multi-turn row, or an assistant-only loss); the model's "
                    "answer would follow the first part's prompt alone and be scored against "
                    "every part joined: use the teacher-forced candidates for such batches"
                )
        prompts.append(prompt)
    return prompts


def position_limit(model, decoder: bool = False) -> int | None:
    """The most positions the model takes (its text config's ``max_position_embeddings`` or
    ``n_positions``; ``decoder``: an encoder-decoder's decoder's), or ``None`` where the config
    names none."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=decoder) if hasattr(config, "get_text_config") else config
    encoder = getattr(config, "encoder", None)  # EncoderDecoderModel's: its own config
    if not decoder and getattr(config, "is_encoder_decoder", False) and hasattr(encoder, "to_dict"):
        text = encoder
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _fitted_budget(model, prompt_width: int, max_new_tokens: int, decoder: bool = False) -> int:
    """``max_new_tokens``, cut (with a warning) so that the prompts, ``prompt_width`` wide
    once left-padded, and their answers fit in the model's positions: past them generation
    failed inside torch (an embedding's index out of range). ``decoder``: an encoder-decoder's
    answers, after the decoder's start token, in the decoder's positions."""
    limit = position_limit(model, decoder)
    if limit is None or prompt_width + max_new_tokens <= limit:
        return max_new_tokens
    room = limit - prompt_width
    if decoder:
        warn_user(
            f"the model's answers are cut at {room} new tokens (of max_new_tokens="
            f"{max_new_tokens}): {type(model).__name__}'s decoder takes {limit} positions, its "
            "start token included"
        )
        return room
    if room < 1:
        raise ValueError(
            f"the batch's longest prompt has {prompt_width} tokens, all the positions "
            f"{type(model).__name__} takes ({limit}): no room for the model's answer; shorten "
            "the prompts or use the teacher-forced candidates"
        )
    warn_user(
        f"the model's answers are cut at {room} new tokens (of max_new_tokens={max_new_tokens}"
        f"): the batch's longest prompt has {prompt_width} tokens and {type(model).__name__} "
        f"takes {limit} positions"
    )
    return room


def _pad_rows(rows: list[Tensor], value: int, side: str, width: int | None = None) -> Tensor:
    width = max(len(r) for r in rows) if width is None else width
    pads = [(width - len(r), 0) if side == "left" else (0, width - len(r)) for r in rows]
    return torch.stack(
        [torch.nn.functional.pad(r, pad, value=value) for r, pad in zip(rows, pads, strict=True)]
    )


def _mask(rows: list[Tensor], side: str, width: int | None = None) -> Tensor:
    return _pad_rows([torch.ones_like(r) for r in rows], 0, side, width)


def pad_labels(label_sets: list[Tensor]) -> list[Tensor]:
    """Label tensors ``[B, L_k]`` right-padded with ``-100`` to one width."""
    width = max(labels.shape[1] for labels in label_sets)
    return [
        torch.nn.functional.pad(x, (0, width - x.shape[1]), value=IGNORE_INDEX) for x in label_sets
    ]


def end_token_ids(eos: object, name: str) -> list[int]:
    """The ids that end an answer, as a list: one id or a non-empty sequence of them (with none
    every answer would run to its token limit, unnoticed)."""
    ids = eos.tolist() if isinstance(eos, Tensor) else eos
    ids = [ids] if isinstance(ids, numbers.Integral) else ids
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a token id or a list of them, got {eos!r}")
    ids = [check_int(i, f"{name}[{k}]", 0) for k, i in enumerate(list(ids))]
    if not ids:
        raise ValueError(f"{name} is empty: an answer needs a token that ends it")
    return ids


def generated_labels(sequences: Tensor, eos: int | Sequence[int]) -> Tensor:
    """``generate()`` output (a decoder start or the last prompt token first) -> labels-style
    ids: each answer is its tokens up to and including its first end-of-sequence token, and
    everything after that is ``-100``.

    What is padding is decided by position, never by id: ``generate`` pads only a finished
    answer, after its end token. So an answer keeps its end token (and an answer that ends at
    once is that one token) whether or not the padding id is the end id (GPT-2 / Qwen style),
    and a padding id the model generated inside its answer is a token of the answer.

    >>> generated_labels(torch.tensor([[9, 5, 0, 2, 2, 2]]), eos=2).tolist()
    [[5, 0, 2, -100, -100]]
    """
    eos = end_token_ids(eos, "eos")
    labels = sequences[:, 1:].clone()
    ends = torch.isin(labels, torch.tensor(eos, device=labels.device)).long()
    labels[(ends.cumsum(1) - ends) > 0] = IGNORE_INDEX  # after the first end token
    return labels


# The settings a model's generation_config may carry that make its answers something other
# than its distribution (or its argmax), change their length or the output's layout: shipped
# configs carry them (Qwen2.5-Instruct: repetition_penalty=1.05; bart-large-cnn:
# no_repeat_ngram_size=3, min_length=56, forced_eos_token_id). generate_ids sets each to its
# neutral value; the special ids (bos / eos / pad, decoder_start_token_id and
# forced_bos_token_id, which picks mBART's / NLLB's language) and the cache stay the config's.
NEUTRAL_GENERATION: dict[str, Any] = {
    # the distribution
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "typical_p": 1.0,
    "min_p": None,
    "top_h": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "guidance_scale": None,
    "watermarking_config": None,
    "dola_layers": None,
    "penalty_alpha": None,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "constraints": None,
    "force_words_ids": None,
    "length_penalty": 1.0,
    # the length
    "min_length": 0,
    "min_new_tokens": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "max_time": None,
    "stop_strings": None,
    # the prompt (token healing rewrites its last tokens) and speculative decoding from the
    # prompt or the model's own early layers (batches of one only: transformers refuses more)
    "token_healing": False,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
    # the output's layout
    "num_return_sequences": 1,
    "return_dict_in_generate": False,
}


def _neutral_generation() -> dict[str, Any]:
    """:data:`NEUTRAL_GENERATION`, less the settings this transformers does not know (each
    unknown keyword would reach the model's forward)."""
    from transformers import GenerationConfig

    known = GenerationConfig()
    return {name: value for name, value in NEUTRAL_GENERATION.items() if hasattr(known, name)}


@torch.no_grad()
def generate_ids(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    max_new_tokens: int,
    *,
    sample: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    temperature: float = 1.0,
    num_beams: int = 1,
    **options,
) -> Tensor:
    """``model.generate`` in eval mode (the training mode restored after), greedy or sampled,
    as ``[B, prompt + new]`` ids.

    The answers follow the explicit options only: the sampling ones are passed, and every
    setting of :data:`NEUTRAL_GENERATION` that the model's ``generation_config`` may carry (a
    repetition penalty, n-gram blocking, a minimum length, suppressed words, ...) is set to
    its neutral value, so the config does not change them silently. ``options`` (the special
    ids, a ``streamer``, or a processor a caller wants after all) go to ``generate`` last."""
    was_training = model.training
    model.eval()
    if sample:
        sampling = {"top_k": top_k, "top_p": top_p, "temperature": temperature}
    else:  # unused by greedy decoding: the config's would only make generate() warn
        sampling = {"top_k": None, "top_p": None, "temperature": None}
    try:
        return model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=sample,
            num_beams=num_beams,
            max_new_tokens=max_new_tokens,
            **{**_neutral_generation(), **sampling, **options},
        )
    finally:
        model.train(was_training)
