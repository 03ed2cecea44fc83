r"""BERTScore in Hugging Face trainers: ``transformers.Trainer`` / ``Seq2SeqTrainer`` and TRL's
``SFTTrainer``.

The training loss is

.. math::  \mathcal L = \frac{1}{N}\sum_{i}\sum_{t \in C_i} -\log p(y_{it})
    \;+\; \lambda\,\frac{1}{N}\sum_i |C_i|\,\bigl(1 - F_{\mathrm{BERT}}(\hat y_i, y_i)\bigr)

with :math:`C_i` the completion positions of sequence :math:`i` (``labels != -100``),
:math:`\hat y_i` its teacher-forced next-token distributions, :math:`y_i` its reference and
:math:`N` the trainer's ``num_items_in_batch`` (completion tokens of every micro-batch of the
optimiser step, on every process) or, without it, the micro-batch's own token count. Both terms
are sums divided by the same :math:`N`, so they add up over gradient-accumulation micro-batches
to the loss of the whole batch, as the trainer's own cross-entropy does; the BERTScore term is
the token-weighted mean of the per-sequence ``1 - F``.

Three pieces:

- :class:`BERTScoreTerm`: the loss above as a ``compute_loss_func(outputs, labels,
  num_items_in_batch)`` (``Trainer(compute_loss_func=term)``). References are the labels,
  decoded once and cached.
- :class:`BERTScoreTrainerMixin`: put it in front of any trainer class
  (``class T(BERTScoreTrainerMixin, SFTTrainer)``): the same loss, CE and F logged as separate
  metrics (``ce``, ``bertscore_f``, ``bertscore_loss``), and references from a dataset column
  (``bertscore_reference_column="reference"``) instead of the labels.
- :func:`bertscore_compute_metrics`: a ``compute_metrics`` for ``evaluate()`` / ``predict()``
  that scores the decoded predictions against the decoded labels with :class:`~bsloss.BERTScorer`.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from bsloss.bridge import Bridge
from bsloss.functional.fused_expectation import ids_outside_vocabulary
from bsloss.inputs import as_token_ids, check_flag, check_reference_groups
from bsloss.integrations.candidates import CandidateSource, resolve_candidates
from bsloss.integrations.lm_head import (
    IGNORE_INDEX,
    LMHead,
    lm_head_inputs,
    lm_head_refusal,
    token_cross_entropy,
)
from bsloss.integrations.packing import PackedDocuments
from bsloss.integrations.term_weights import (
    Fixed,
    TermWeight,
    check_balance,
    check_weight,
    evaluate_term_weight,
    resolve_term_weight,
)
from bsloss.loss import BERTScoreLoss
from bsloss.metric import BERTScorer

__all__ = [
    "BERTScoreTerm",
    "BERTScoreTrainerMixin",
    "bertscore_compute_metrics",
    "REFERENCES_KEY",
]

DECODED_CACHE_SIZE = 10_000  # distinct label rows whose decoded reference text is kept
REFERENCES_KEY = "bertscore_references"  # batch key of the reference texts from a column


class BERTScoreTerm:
    """Cross-entropy plus ``weight`` times the BERTScore loss, as a trainer loss function.

    Args:
        loss: the :class:`~bsloss.BERTScoreLoss` (its scorer, matching, temperature; pass
            ``bridge=Bridge(tokenizer)`` to it when the generator's vocabulary differs from the
            scorer's). Its ``reduction`` is ignored: the term reduces as the trainer does.
        tokenizer: the generator's tokenizer, to decode the labels into references.
        weight: :math:`\\lambda`, the weight of the BERTScore term, or a
            :class:`~bsloss.integrations.term_weights.TermWeight`: ``Balanced(1.0)`` rescales
            the term to the CE's value on every step (EMO's balance). A rule's result is a
            constant (no gradient flows through it) and is checked on every step: NaN, Inf or
            a negative value raises a ``ValueError`` naming the rule's class and the value.
        causal: ``True`` for decoder-only models (logits at ``t`` predict label ``t + 1``, as
            in ``SFTTrainer``), ``False`` for encoder-decoder ones (``Seq2SeqTrainer``).
        ce_weight: weight of the cross-entropy term (``0``: BERTScore only, with a fixed
            weight: ``Balanced`` balances against the CE and is refused with it).

    ``weight`` and ``ce_weight`` may be set again between steps (checked as here).

    Raises:
        TypeError: ``loss`` is not a :class:`~bsloss.BERTScoreLoss`.
        ValueError: a negative weight, or a ``Balanced`` weight with ``ce_weight=0``.

    >>> import torch, bsloss
    >>> from bsloss.integrations.huggingface import BERTScoreTerm
    >>> loss = bsloss.BERTScoreLoss()
    >>> term = BERTScoreTerm(loss, loss.encoder.tokenizer, weight=1.0, causal=False)
    >>> labels = torch.tensor([loss.encoder.tokenizer("a cat sat")["input_ids"][1:-1]])
    >>> logits = torch.randn(1, labels.shape[1], 30522, requires_grad=True)
    >>> value = term({"logits": logits}, labels)
    >>> value.backward(); sorted(term.pop_metrics())
    ['bertscore_f', 'bertscore_loss', 'ce']
    """

    def __init__(
        self,
        loss: BERTScoreLoss,
        tokenizer,
        weight: float | TermWeight = 1.0,
        causal: bool = True,
        ce_weight: float = 1.0,
    ):
        if not isinstance(loss, BERTScoreLoss):
            raise TypeError(f"loss must be a bsloss.BERTScoreLoss, got {type(loss).__name__}")
        self._weight, self._ce_weight = Fixed(0.0), 1.0  # checked together by the setters
        self.ce_weight = ce_weight
        self.weight = weight
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(
                f"tokenizer must be the generator's tokenizer (with decode), got "
                f"{type(tokenizer).__name__}"
            )
        self.loss, self.tokenizer, self.causal = loss, tokenizer, causal
        # label rows -> reference text, least recently used evicted past DECODED_CACHE_SIZE
        self._decoded: OrderedDict[tuple[int, ...], str] = OrderedDict()
        # training and evaluation batches are recorded apart: an evaluation between two
        # logging steps must neither report nor swallow the pending training values
        # each value as (its sum, its weight) over the micro-batches: a logged mean weighs
        # them as the loss does (accumulated micro-batches of different token counts)
        self._metrics: dict[str, dict[str, _RunningSum]] = {
            "train": defaultdict(_RunningSum),
            "eval": defaultdict(_RunningSum),
        }

    @property
    def weight(self) -> TermWeight:
        """The term's :class:`~bsloss.integrations.term_weights.TermWeight` (a number set
        here becomes :class:`~bsloss.integrations.term_weights.Fixed`)."""
        return self._weight

    @weight.setter
    def weight(self, weight: float | TermWeight) -> None:
        weight = resolve_term_weight(weight, "weight")
        check_balance(weight, self._ce_weight)
        self._weight = weight

    @property
    def scores(self) -> bool:
        """Whether the BERTScore term is computed: not under a fixed weight of 0, where the loss
        is the CE alone, at the CE's cost (no scoring, no answers generated)."""
        return not (isinstance(self._weight, Fixed) and self._weight.weight == 0)

    @property
    def ce_weight(self) -> float:
        """The weight of the cross-entropy term."""
        return self._ce_weight

    @ce_weight.setter
    def ce_weight(self, ce_weight: float) -> None:
        ce_weight = check_weight(ce_weight, "ce_weight")
        check_balance(self._weight, ce_weight)
        self._ce_weight = ce_weight

    def references_of(self, labels: Tensor, documents: PackedDocuments | None = None) -> list[str]:
        """The references scored against when none are given: each row's targets (``labels``
        as given to :meth:`__call__`, shifted by one for a causal model) decoded. ``documents``:
        as :meth:`__call__`'s (where a bad label is named)."""
        return self._decoded_rows(self._targets(labels), int(self.causal), documents)

    def _targets(self, labels: Tensor) -> Tensor:
        """``labels`` against the positions that predict them (a causal model's shifted by
        one: position t predicts label t + 1)."""
        return labels[:, 1:] if self.causal else labels

    def references_from_labels(self, labels: Tensor) -> list[str]:
        """Each row's completion tokens (``!= -100``) decoded, each distinct row once (the
        latest ``DECODED_CACHE_SIZE`` distinct rows are kept).

        Raises:
            ValueError: a negative id other than ``-100``, named (the tokenizer's own decode
                fails on it with an ``OverflowError``).
        """
        return self._decoded_rows(labels, 0, None)

    def _decoded_rows(
        self, labels: Tensor, shift: int, documents: PackedDocuments | None
    ) -> list[str]:
        """:meth:`references_from_labels`; a bad id is named ``shift`` positions on (the
        caller's labels before a causal model's shift), in the packed batch of ``documents``."""
        texts = []
        for b, row in enumerate(labels.tolist()):
            key = tuple(t for t in row if t != IGNORE_INDEX)
            if key and min(key) < 0:  # on the host already: no read of the device
                position = next(
                    t for t, token in enumerate(row) if token < 0 and token != IGNORE_INDEX
                )
                raise ValueError(
                    f"labels has a negative id ({row[position]}; {IGNORE_INDEX} marks a "
                    f"position without a label) at {_given_place(b, position + shift, documents)}"
                )
            if key in self._decoded:
                self._decoded.move_to_end(key)
            else:
                self._decoded[key] = self.tokenizer.decode(key, skip_special_tokens=True).strip()
                while len(self._decoded) > DECODED_CACHE_SIZE:
                    self._decoded.popitem(last=False)
            texts.append(self._decoded[key])
        return texts

    def __call__(
        self,
        outputs: Any,
        labels: Tensor,
        num_items_in_batch: Tensor | int | None = None,
        references: Sequence[str] | None = None,
        *,
        training: bool | None = None,
        head: LMHead | None = None,
        candidate_outputs: Any = None,
        candidate_labels: Tensor | None = None,
        candidate_rows: Tensor | None = None,
        documents: PackedDocuments | None = None,
    ) -> Tensor:
        """The loss of one micro-batch (see the module docstring); records CE and mean F.

        Args:
            outputs: the model's outputs: ``outputs["logits"]`` are ``[B, L, V]`` logits, or,
                with ``head``, the LM head's input ``[B, L, d]`` (from the forward pass inside
                :func:`~bsloss.integrations.lm_head.lm_head_inputs`).
            labels: ``[B, L]`` token ids, ``-100`` outside the completion.
            num_items_in_batch: the trainer's count of completion tokens in the whole
                (accumulated, all-process) batch; ``None``: this micro-batch's.
            references: reference texts, one per row; default: the decoded labels.
            training: record the metrics as training (``True``) or evaluation values;
                default: training when gradients are on and the logits require one (the
                trainer evaluates under ``torch.no_grad()``).
            head: the :class:`~bsloss.integrations.lm_head.LMHead` that ``lm_head_inputs``
                yielded: CE and BERTScore then come from one chunked pass over the vocabulary
                (:meth:`~bsloss.BERTScoreLoss.score_and_cross_entropy`), no ``[B, L, V]``.
            candidate_outputs, candidate_labels: the model's own outputs (greedy or sampled,
                one per row) as the candidates, scored under teacher forcing: their forward
                outputs (as ``outputs``) and their token ids (as ``labels``). The CE stays on
                ``labels``; the BERTScore term is the candidates' token-weighted ``1 - F``
                against the references (divided by the candidates' own token count, then
                scaled like the CE by this micro-batch's share of ``num_items_in_batch``). An
                empty candidate of a row that has a completion scores ``F = 0`` and counts as
                one token (answering nothing is the term's worst value); a row with neither
                is not scored. Default: the teacher-forced distributions of ``labels`` are the
                candidates.
            candidate_rows: ``[R]`` the batch rows the ``R`` candidates answer (a subset of
                the batch answered, :class:`~bsloss.integrations.candidates.ModelAnswers`'
                ``rows``): the term is over those rows only; default: all rows, in order.
            documents: where ``outputs`` and ``labels`` come from when they are the documents
                of a packed batch (:meth:`~bsloss.integrations.packing.PackedDocuments.split`):
                a label is then named by its place in the packed labels.

        Raises:
            ValueError: ``labels`` missing or of the wrong shape, ``references`` of the wrong
                length, only one of ``candidate_outputs`` / ``candidate_labels``,
                ``candidate_rows`` without them, outside the batch or repeating a row, or a
                :class:`~bsloss.integrations.term_weights.TermWeight` whose result is NaN,
                infinite or negative.
            TypeError: a ``TermWeight`` whose result is not one number; ``candidate_rows``
                not a 1-D integer tensor.
        """
        if labels is None:
            raise ValueError("BERTScoreTerm needs labels (-100 outside the completion)")
        _check_token_count(num_items_in_batch)
        if (candidate_outputs is None) != (candidate_labels is None):
            raise ValueError("candidate_outputs and candidate_labels go together: pass both")
        if candidate_rows is not None:
            candidate_rows = _checked_candidate_rows(candidate_rows, candidate_outputs is not None)
        logits, labels = self._aligned(outputs, labels, "labels")
        if training is None:
            training = torch.is_grad_enabled() and logits.requires_grad
        if not self.scores:
            return self._cross_entropy_alone(
                logits, labels, num_items_in_batch, head, training, documents
            )
        own = candidate_outputs is not None
        if own:
            candidate_logits, candidate_labels = self._aligned(
                candidate_outputs, candidate_labels, "candidate_labels"
            )
            answered = labels.shape[0] if candidate_rows is None else len(candidate_rows)
            if candidate_labels.shape[0] != answered:
                raise ValueError(
                    f"candidate_labels has {candidate_labels.shape[0]} rows for {answered} "
                    f"answered rows of a batch of {labels.shape[0]}"
                )
        else:
            candidate_logits, candidate_labels = logits, labels
        given_rows = candidate_rows is not None
        if candidate_rows is None:
            candidate_rows = torch.arange(labels.shape[0], device=labels.device)
        candidate_rows = candidate_rows.to(labels.device)
        # rows given are checked on the host by the one read below; until then they index
        # within the batch
        usable_rows = candidate_rows.clamp(0, labels.shape[0] - 1) if given_rows else candidate_rows
        mask = labels != IGNORE_INDEX
        total = mask.sum() if num_items_in_batch is None else num_items_in_batch
        total = torch.as_tensor(total, device=logits.device).clamp(min=1)
        if references is None:
            references = self._decoded_rows(labels, int(self.causal), documents)
        else:
            check_reference_groups(references, "references")
        if len(references) != labels.shape[0]:
            raise ValueError(f"{len(references)} references for a batch of {labels.shape[0]}")
        candidate_mask = candidate_labels != IGNORE_INDEX
        tokens = candidate_mask.sum(dim=1)
        # a row is scored when it has a completion or a candidate; an empty candidate of a row
        # with a completion scores F = 0 (the loss's rule for an empty candidate) and weighs
        # as one token, so that answering nothing is the term's worst value, not its best
        keep = (tokens > 0) | mask[usable_rows].any(dim=1)
        row_weights = tokens.clamp_min(1) * keep
        f1 = torch.zeros(candidate_labels.shape[0], device=logits.device)
        # the host picks the rows' references: one read of the device, for every use below,
        # which also says whether a label is outside the vocabulary (the CE's check, named here
        # by its place in the labels given; the head's shape is whole outside its unit too)
        vocab = logits.shape[-1] if head is None else head.weight.shape[0]
        outside = ids_outside_vocabulary(labels, vocab).any().long()[None]
        host = torch.cat([keep.long(), candidate_rows.long(), outside]).tolist()
        answered = keep.shape[0]
        if host[-1]:
            raise self._labels_outside(labels, vocab, documents)
        host_rows = host[answered : 2 * answered]
        if given_rows:
            _check_row_values(host_rows, labels.shape[0])
        kept_rows = [i for i, kept_row in enumerate(host[:answered]) if kept_row]
        rows = torch.tensor(kept_rows, dtype=torch.long).to(logits.device, non_blocking=True)
        kept = {
            "candidate_mask": candidate_mask[rows],
            "references": [references[host_rows[i]] for i in kept_rows],
        }
        # with batch centering over processes the loss runs also on no row: its all-reduces
        # (and their backward) pair with the other processes' calls only if every process
        # makes every call
        scores = bool(kept_rows) or self.loss.center
        if head is None:
            ce_sum = token_cross_entropy(
                labels, logits=logits, reduction="sum", check_targets=False
            )
            if scores:
                prf = self.loss.score(candidate_logits[rows].float(), **kept)
                f1 = f1.index_put((rows,), getattr(prf, self.loss.target).float())
        elif own:
            ce_sum, f1_kept = head.run(
                self._fused_own_scores, logits, labels, candidate_logits[rows], kept
            )
            if kept_rows:
                f1 = f1.index_put((rows,), f1_kept.float())
        elif scores:
            f1_kept, ce = head.run(self._fused_scores, logits[rows], labels[rows], kept)
            ce_sum = ce.sum()
            f1 = f1.index_put((rows,), f1_kept.float())
        else:  # no target token at all: a zero on the graph of the hidden states
            ce_sum = logits.sum() * 0.0
        bertscore_sum = ((1 - f1) * row_weights).sum()
        metrics = self._metrics["train" if training else "eval"]
        # this micro-batch's share of the batch's tokens: 0 for one without a completion token
        # (clamped to 1, a share of 1 / N joined the step's: logged ce and bertscore_loss low
        # by N / (N + 1); audit h30); the clamped count only divides
        label_tokens = mask.sum()
        # the term is the candidates' token-weighted mean (own candidates: their own count),
        # scaled like the CE by this micro-batch's share of num_items_in_batch, so that
        # accumulated micro-batches and processes add up to the whole batch's mean (a mean
        # per micro-batch would count once per micro-batch and process)
        term_local = bertscore_sum / row_weights.sum().clamp(min=1)
        ce_mean, term_mean = ce_sum / total, term_local * (label_tokens / total)
        # a per-step weight compares the micro-batch's own means (the share cancels in a ratio,
        # not in Balanced's floor on the term); this is the one place a TermWeight is applied:
        # a checked constant whatever the rule returns, checked before anything is recorded
        weight = evaluate_term_weight(self.weight, ce_sum / label_tokens.clamp(min=1), term_local)
        # recorded on the device, read when logged: no wait for the card at every step; the
        # CE and the term weigh by this micro-batch's share of the batch's tokens, as in the
        # loss, so that the logged loss is ce_weight * ce + weight * bertscore_loss
        share = (label_tokens / total).detach()
        metrics["ce"].append((ce_mean.detach(), share))
        metrics["bertscore_loss"].append((term_mean.detach(), share))
        if kept_rows:
            metrics["bertscore_f"].append((f1[rows].sum().detach(), len(kept_rows)))
        if kept_rows and not isinstance(self.weight, Fixed):
            # a step-by-step weight is logged, where it weighs a term (with no row scored,
            # Balanced's is CE / min_term, thousands, and would swamp the window's mean)
            metrics["bertscore_weight"].append((weight, 1))
        return self.ce_weight * ce_mean + weight * term_mean

    def _aligned(self, outputs: Any, labels: Tensor, name: str) -> tuple[Tensor, Tensor]:
        """(logits or hidden states, labels), position t against label t (a causal model's
        shifted by one), their shapes checked."""
        labels = as_token_ids(labels, name)
        if labels.dim() != 2:
            raise ValueError(f"{name} must be [B, L] token ids, got shape {list(labels.shape)}")
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        if self.causal:
            logits = logits[:, :-1]
        labels = self._targets(labels)
        if logits.shape[:2] != labels.shape:
            why = ""
            if not self.causal:  # the trainer takes the labels out before the forward
                why = (
                    "; an encoder-decoder's logits follow its decoder_input_ids, which the "
                    "model builds from the source when the batch has none: give the batch "
                    "decoder_input_ids (DataCollatorForSeq2Seq(tokenizer, model=model)) or use "
                    "BERTScoreTrainerMixin, which builds them from the labels"
                )
            raise ValueError(
                f"{name} {list(labels.shape)} do not match the logits {list(logits.shape[:2])}{why}"
            )
        return logits, labels

    def _labels_outside(
        self, labels: Tensor, vocab: int, documents: PackedDocuments | None = None
    ) -> ValueError:
        """The error for aligned ``labels`` with an id outside ``[0, vocab)``: the first named
        at its place in the labels the caller gave (a causal model's are shifted by one here;
        the documents of a packed batch are rows of their own here). torch's own check is an
        ``IndexError`` on the CPU and, on a GPU, a device-side assert that breaks the process's
        CUDA context."""
        row, position = ids_outside_vocabulary(labels, vocab).nonzero()[0].tolist()
        where = _given_place(row, position + int(self.causal), documents)
        return ValueError(
            f"labels has ids outside [0, {vocab}) (the model's vocabulary; and not "
            f"{IGNORE_INDEX}) at {where}"
        )

    def _check_labels(
        self, labels: Tensor, vocab: int, documents: PackedDocuments | None = None
    ) -> None:
        """Refuse aligned ``labels`` outside ``[0, vocab)`` (one read of the device), named."""
        if ids_outside_vocabulary(labels, vocab).any():
            raise self._labels_outside(labels, vocab, documents)

    def _cross_entropy_alone(
        self,
        logits: Tensor,
        labels: Tensor,
        num_items_in_batch: Tensor | int | None,
        head: LMHead | None,
        training: bool,
        documents: PackedDocuments | None = None,
    ) -> Tensor:
        """``ce_weight`` times the CE, normalised as the full loss is, and recorded (the term
        under a fixed weight of 0: nothing else is computed)."""
        check_labels = functools.partial(self._check_labels, documents=documents)
        if head is None:
            check_labels(labels, logits.shape[-1])
            ce_sum = token_cross_entropy(
                labels, logits=logits, reduction="sum", check_targets=False
            )
        else:
            ce_sum = head.run(_fused_cross_entropy_sum, logits, labels, check_labels)
        label_tokens = (labels != IGNORE_INDEX).sum()  # a share of 0 when there is none
        total = label_tokens if num_items_in_batch is None else num_items_in_batch
        total = torch.as_tensor(total, device=logits.device).clamp(min=1)
        metrics = self._metrics["train" if training else "eval"]
        ce_mean = ce_sum / total
        # read when logged; weighed by this micro-batch's share of the batch's tokens
        metrics["ce"].append((ce_mean.detach(), (label_tokens / total).detach()))
        return self.ce_weight * ce_mean

    def _fused_own_scores(
        self, head: LMHead, hidden: Tensor, labels: Tensor, candidate_hidden: Tensor, kept: dict
    ) -> tuple[Tensor, Tensor]:
        """(the CE summed over ``labels``' tokens, the candidates' target score per kept row),
        each chunked over ``head`` (called through :meth:`LMHead.run`)."""
        ce_sum = _fused_cross_entropy_sum(head, hidden, labels, self._check_labels)
        if not kept["references"] and not self.loss.center:
            return ce_sum, ce_sum.new_zeros(0)
        prf = self.loss.score(head.inputs(candidate_hidden), **kept)
        return ce_sum, getattr(prf, self.loss.target)

    def _fused_scores(
        self, head: LMHead, hidden_states: Tensor, target_ids: Tensor, kept: dict
    ) -> tuple[Tensor, Tensor]:
        """(the target score per row, the CE per token) from one chunked pass over ``head``
        (called through :meth:`LMHead.run`: under FSDP 2, inside the head's unit)."""
        prf, ce = self.loss.score_and_cross_entropy(head.inputs(hidden_states), target_ids, **kept)
        return getattr(prf, self.loss.target), ce

    def pop_metrics(self, training: bool = True, distributed: bool = False) -> dict[str, float]:
        """Mean ``ce`` (per completion token), ``bertscore_f`` (per row) and
        ``bertscore_loss`` (the term's token-weighted ``1 - F`` before its weight) of the
        training batches (``training=False``: the evaluation batches) since the last call, and
        ``bertscore_weight``, the term's mean weight, when it changes step by step. ``ce`` and
        ``bertscore_loss`` weigh the micro-batches as the loss does (by their share of the
        accumulated batch's completion tokens), so that at a fixed weight the trainer's logged
        training loss is ``ce_weight * ce + weight * bertscore_loss``. An evaluation weighs
        each batch as one (it has no accumulated batch), where the trainer's ``eval_loss``
        weighs batches by their rows: with batches of unequal size the two differ a little.
        A key with nothing to average since the last call is left out, never reported as 0:
        ``ce`` when no batch had a completion token, ``bertscore_f`` when no row was scored.

        ``distributed``: the sums and weights of every process, all-reduced (a collective:
        every process must call it, as the mixin's ``log`` and ``evaluation_loop`` do), so
        that each process reports the whole batch's means, not its own rows' (with 2
        processes, rank 0's ``bertscore_f`` was 0.0605 for the batch's 0.0918)."""
        metrics = self._metrics["train" if training else "eval"]
        # the values stay on the device until here (the logging step), read one by one as
        # Python floats: the same sums as reading them at every step
        sums = {
            key: (
                sum(float(v) for v, _ in metrics.get(key, ())),
                sum(float(w) for _, w in metrics.get(key, ())),
            )
            for key in METRIC_KEYS
        }
        metrics.clear()
        if distributed:
            sums = _summed_over_processes(sums)
        return {key: value / weight for key, (value, weight) in sums.items() if weight > 0}


class _RunningSum:
    """A recorded metric's (sum of values, sum of weights), added as each micro-batch records
    it (on the device, no read): one pair per key, where a list of pairs grew by one per
    micro-batch until popped, ~1 KB of host objects and a few device blocks each, without end
    where nothing pops (``compute_loss_func``; ``logging_strategy="no"``; audit h30)."""

    __slots__ = ("value", "weight")

    def __init__(self) -> None:
        self.value: Tensor | float = 0.0
        self.weight: Tensor | float = 0.0

    def append(self, pair: tuple[Tensor | float, Tensor | float]) -> None:
        value, weight = pair
        self.value, self.weight = self.value + value, self.weight + weight

    def extend(self, pairs) -> None:
        for pair in pairs:
            self.append(pair)

    def __iter__(self):
        yield self.value, self.weight


# what BERTScoreTerm records (its only keys), in a fixed order: all-reduced as one tensor,
# whichever a process recorded (bertscore_f not when it kept no row)
METRIC_KEYS = ("ce", "bertscore_loss", "bertscore_f", "bertscore_weight")


def _refuse_unread_options(args) -> None:
    """The trainer's loss options this step would not apply: it computes the CE itself (audit
    h30: a label smoothing of 0.1 or SFTTrainer's ``loss_type="dft"`` trained on plain NLL,
    unnoticed), and scores each packed document alone, which TRL's ``"wrapped"`` packing gives
    no boundaries for (its rows were scored cut and joined).

    Raises:
        ValueError: naming the option and what to set.
    """
    smoothing = getattr(args, "label_smoothing_factor", 0.0) or 0.0
    if smoothing:
        raise ValueError(
            f"label_smoothing_factor={smoothing}: BERTScoreTrainerMixin computes the CE itself, "
            "without label smoothing; set it to 0"
        )
    loss_type = getattr(args, "loss_type", None)
    if loss_type not in (None, "nll"):
        raise ValueError(
            f"loss_type={loss_type!r}: BERTScoreTrainerMixin computes the CE itself (the NLL, "
            "loss_type='nll'), not TRL's other losses"
        )
    if getattr(args, "packing", False) and getattr(args, "packing_strategy", None) == "wrapped":
        raise ValueError(
            "packing_strategy='wrapped' cuts and joins the examples with no document "
            "boundaries: the term would score pieces of two answers as one; use "
            "packing_strategy='bfd' (TRL's default) or padding_free=True"
        )


def _summed_over_processes(sums: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Each ``(sum, weight)`` of :data:`METRIC_KEYS` added up over the processes (the identity
    without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return sums
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL moves CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    table = torch.tensor([sums[key] for key in METRIC_KEYS], dtype=torch.float64, device=device)
    dist.all_reduce(table)
    return dict(zip(METRIC_KEYS, map(tuple, table.cpu().tolist()), strict=True))


def _given_place(row: int, position: int, documents: PackedDocuments | None) -> str:
    """``labels[b, t]``: a place in the labels the term sees (a causal model's already shifted
    back) as the caller gave them, in the packed batch of ``documents`` when there is one."""
    if documents is not None:
        row, position = documents.place(row, position)
    return f"labels[{row}, {position}]"


def _checked_candidate_rows(rows: Any, with_candidates: bool) -> Tensor:
    """``candidate_rows`` as ``[R]`` long row indices (a ``uint8`` tensor would index as a
    mask); its values are read with the term's one read of the device
    (:func:`_check_row_values`)."""
    if not with_candidates:
        raise ValueError(
            "candidate_rows names the batch rows that candidate_outputs answer: pass it with "
            "candidate_outputs and candidate_labels"
        )
    rows = as_token_ids(rows, "candidate_rows")
    if rows.dim() != 1:
        raise ValueError(f"candidate_rows must be [R] row indices, got shape {list(rows.shape)}")
    return rows


def _check_row_values(rows: list[int], batch_size: int) -> None:
    """Each of ``candidate_rows`` a row of the batch, none twice (a candidate per row)."""
    first: dict[int, int] = {}
    for position, row in enumerate(rows):
        if not 0 <= row < batch_size:
            raise ValueError(
                f"candidate_rows[{position}] is {row}: outside the batch's rows 0..{batch_size - 1}"
            )
        if row in first:
            raise ValueError(
                f"candidate_rows[{position}] repeats row {row} (candidate_rows[{first[row]}]): "
                "one candidate a row"
            )
        first[row] = position


def _check_token_count(num_items_in_batch: object) -> None:
    """Refuse a ``num_items_in_batch`` given by hand that is no count of tokens (negative, NaN
    or infinite: the loss was divided by 1, NaN or infinity). The trainer's own, a tensor on
    the device, has its shape checked but not its value: that would cost a read of the device;
    a tensor on the CPU is read."""
    if num_items_in_batch is None:
        return
    if isinstance(num_items_in_batch, Tensor):
        if num_items_in_batch.numel() != 1 or num_items_in_batch.is_complex():
            raise ValueError(
                "num_items_in_batch must be one number of tokens, got a tensor of shape "
                f"{list(num_items_in_batch.shape)} and dtype {num_items_in_batch.dtype}"
            )
        if num_items_in_batch.device.type != "cpu":
            return
        num_items_in_batch = num_items_in_batch.item()
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, numbers.Real):
        raise TypeError(
            "num_items_in_batch must be a number of tokens (or the trainer's tensor), got "
            f"{type(num_items_in_batch).__name__} {num_items_in_batch!r}"
        )
    if not math.isfinite(num_items_in_batch) or num_items_in_batch < 0:
        raise ValueError(
            f"num_items_in_batch must be a number of tokens >= 0, got {num_items_in_batch}"
        )


def _fused_cross_entropy_sum(
    head: LMHead,
    hidden: Tensor,
    labels: Tensor,
    check_labels: Callable[[Tensor, int], None],
) -> Tensor:
    """The CE summed over ``labels``' tokens, chunked over ``head`` (through
    :meth:`LMHead.run`, where the head's weight is whole); ``check_labels`` refuses a label
    outside its vocabulary, named (in the read the pass's own check would make)."""
    check_labels(labels, head.weight.shape[0])
    return token_cross_entropy(
        labels, hidden_states=hidden, head=head, reduction="sum", check_targets=False
    )


class _WithReferences:
    """A data collator that takes the reference column out of the examples and hands the texts
    over as one batch entry (the wrapped collator sees the examples without it)."""

    def __init__(self, collator: Callable, column: str):
        self.collator, self.column = collator, column

    def __call__(self, features: list[dict]) -> dict:
        missing = [i for i, f in enumerate(features) if self.column not in f]
        if missing:
            raise KeyError(
                f"bertscore_reference_column={self.column!r}: examples {missing[:5]} have no "
                f"such column (columns: {sorted(features[0])})"
            )
        references = [f[self.column] for f in features]
        batch = self.collator([{k: v for k, v in f.items() if k != self.column} for f in features])
        batch[REFERENCES_KEY] = references
        return batch


class BERTScoreTrainerMixin:
    """Adds the BERTScore term to a Hugging Face trainer: ``class MyTrainer(
    BERTScoreTrainerMixin, Trainer)`` (or ``Seq2SeqTrainer``, TRL's ``SFTTrainer``).

    Keyword args (the others go to the trainer):
        bertscore_loss: the :class:`~bsloss.BERTScoreLoss`; default: one over the embedded
            scorer with the generator's tokenizer (a vocabulary bridge when they differ).
        bertscore_weight: :math:`\\lambda`, or a
            :class:`~bsloss.integrations.term_weights.TermWeight` (``Balanced(1.0)``).
        bertscore_reference_column: a dataset column of reference texts (kept through the
            trainer's column removal and collator); ``None``: the decoded labels.
        bertscore_fused: the training step's CE and BERTScore from one chunked pass over the
            LM head (:mod:`bsloss.integrations.lm_head`): the model's forward stops before its
            head and no ``[B, L, V]`` logits exist. ``None`` (default): on when
            :func:`~bsloss.integrations.lm_head.lm_head_refusal` finds nothing to refuse (a
            plain ``nn.Linear`` head, a soft-cap it can switch off). Under FSDP 2
            (``fully_shard``) the head's weight is gathered for the chunked pass by its unit
            (:meth:`~bsloss.integrations.lm_head.LMHead.run`); FSDP 1's wrapper is refused,
            named. Evaluation
            (``prediction_step``, which hands the logits to ``compute_metrics``) runs the
            model's full forward either way. Fused, arguments that leave
            ``ddp_find_unused_parameters`` open (``None``) get ``False``: the head is used after
            the forward, which DDP's search for unused parameters takes for a second use.
        bertscore_candidates: where the term's candidates come from
            (:mod:`bsloss.integrations.candidates`): ``"teacher_forced"`` (default, the labels'
            next-token distributions), ``"sample"`` / ``"greedy"`` (the model's own answers to
            the batch's prompts, generated without gradient in each training step and scored
            under teacher forcing; the CE stays on the labels), or a source object such as
            ``SampledAnswers(top_k=50, max_new_tokens=64)``. Sampled answers with
            ``bertscore_weight=Balanced(1.0)`` are the setting that beat continued CE in the
            efficacy study (``recipes/RESULTS.md``). Evaluation scores the labels.
        bertscore_ce_weight: the weight of the cross-entropy (``0``: the BERTScore term alone,
            BERTTune's objective, with a fixed ``bertscore_weight``).

    A fixed ``bertscore_weight`` of ``0`` (``trainer.bertscore_term.weight = 0`` between steps
    too) makes the step the CE alone, at its cost: nothing is scored and no answer generated.

    ``ce`` and ``bertscore_f`` are logged with the trainer's loss (``eval_``-prefixed in
    evaluation). The loss is normalised by ``num_items_in_batch`` as the trainer's own loss is.

    A tokenizer without an end-of-sequence token (a BERT tokenizer, such as the scorer's own,
    shared with the generator) gets its ``[SEP]`` as one when the trainer appends it to the
    completions (TRL's ``SFTTrainer``, whose ``SFTConfig(eos_token=...)`` chooses another); the
    trainer gets a copy, the tokenizer passed in is not changed.

    Raises:
        ValueError: no ``processing_class`` (tokenizer), a negative ``bertscore_weight``, or a
            trainer that appends an end-of-sequence token with a tokenizer that has neither
            one nor ``[SEP]`` (the message says what to set).
    """

    def __init__(
        self,
        *args,
        bertscore_loss: BERTScoreLoss | None = None,
        bertscore_weight: float | TermWeight = 1.0,
        bertscore_reference_column: str | None = None,
        bertscore_fused: bool | None = None,
        bertscore_candidates: str | CandidateSource = "teacher_forced",
        bertscore_ce_weight: float = 1.0,
        **kwargs,
    ):
        self.bertscore_reference_column = bertscore_reference_column
        self.bertscore_candidates = resolve_candidates(bertscore_candidates, "bertscore_candidates")
        if bertscore_fused not in (None, True, False):
            raise TypeError(f"bertscore_fused must be None or a bool, got {bertscore_fused!r}")
        model = kwargs.get("model", args[0] if args else None)
        # whether the fused path may be taken, before the trainer builds its accelerator (a
        # model given as a path is loaded, a PEFT config applied, inside __init__)
        maybe_fused = bertscore_fused is True or (
            bertscore_fused is None
            and (not isinstance(model, nn.Module) or lm_head_refusal(model) is None)
        )
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if maybe_fused and getattr(training_args, "ddp_find_unused_parameters", 0) is None:
            # The fused pass uses the LM head after the model's forward. DDP told to look for
            # unused parameters (the trainer's choice when the arguments leave it open and
            # there is no gradient checkpointing) marks the head ready at the end of the
            # forward, then again in the backward pass: an error. Every parameter is used in
            # every step here, so there is nothing to look for. Read by the accelerator the
            # trainer's __init__ builds: set before it.
            training_args.ddp_find_unused_parameters = False
        if "processing_class" in kwargs:
            kwargs["processing_class"] = _with_end_of_sequence(
                kwargs["processing_class"], kwargs.get("args")
            )
        super().__init__(*args, **kwargs)
        _refuse_unread_options(self.args)
        if bertscore_fused is None:
            # fused where lm_head_inputs can account for the head, decided on the model the
            # trainer holds: TRL loads a model given as a path, and wraps one in PEFT, in its
            # __init__
            held = self.accelerator.unwrap_model(self.model)
            bertscore_fused = held is not None and lm_head_refusal(held) is None
        tokenizer = self.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text tokenizer
        if tokenizer is None:
            raise ValueError(
                "BERTScoreTrainerMixin needs the generator's tokenizer: pass processing_class="
                "tokenizer (it decodes the labels into references)"
            )
        if bertscore_loss is None:
            bertscore_loss = BERTScoreLoss()
            if tokenizer.get_vocab() != bertscore_loss.encoder.tokenizer.get_vocab():
                bertscore_loss = BERTScoreLoss(bertscore_loss.encoder, bridge=Bridge(tokenizer))
        bertscore_loss.to(self.args.device)
        config = getattr(self.model, "config", None)
        causal = not getattr(config, "is_encoder_decoder", False)
        self.bertscore_fused = bertscore_fused
        self.bertscore_term = BERTScoreTerm(
            bertscore_loss, tokenizer, bertscore_weight, causal, ce_weight=bertscore_ce_weight
        )
        if self.bertscore_candidates.generates:
            self._answer_tokens = _answer_tokens(self.model, tokenizer)
        # a compute_loss_func makes the trainer count num_items_in_batch and leave gradient
        # accumulation to the loss; compute_loss below calls the term itself
        self.compute_loss_func = self.bertscore_term
        if causal and hasattr(self, "_loss_shifts_labels"):
            # The term scores logits t against labels t + 1: the first label of a row is never
            # a target. Without this the trainer (transformers >= 5, for models it does not
            # know to be causal) counts it in num_items_in_batch, and the logged loss would be
            # below the CE by a factor (T - 1) / T.
            self._loss_shifts_labels = True
        if bertscore_reference_column is not None:
            self.data_collator = _WithReferences(self.data_collator, bertscore_reference_column)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The trainer's count of target tokens: under transformers 4.x (no
        ``_loss_shifts_labels``) it counts every label of a causal batch, each row's first
        too, which no logit scores, so a batch whose labels start at its first token had its
        loss scaled by (T - 1) / T; counted over ``labels[..., 1:]`` here, as 5.x does."""
        if self.bertscore_term.causal and not hasattr(self, "_loss_shifts_labels"):
            batch_samples = [
                {**batch, "labels": batch["labels"][..., 1:]}
                if isinstance(batch.get("labels"), Tensor) and "shift_labels" not in batch
                else batch
                for batch in batch_samples
            ]
        return super()._get_num_items_in_batch(batch_samples, device)

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        column = self.bertscore_reference_column
        if column is not None and column not in self._signature_columns:
            self._signature_columns.append(column)  # survives remove_unused_columns

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's forward pass without labels (stopping before the LM head when
        ``bertscore_fused``), then :class:`BERTScoreTerm`; in a training step with generated
        candidates the model's answers join the batch as extra rows of that one pass."""
        references = inputs.pop(REFERENCES_KEY, None)
        labels = inputs.pop("labels", None)
        inputs = {k: v for k, v in inputs.items() if k != "completion_mask"}
        unwrapped = self.accelerator.unwrap_model(model)
        joint, ce_alone = None, False
        source, step = self.bertscore_candidates, self.state.global_step
        answers = source.generates and self.bertscore_term.scores
        if answers and model.training and not return_outputs:
            # a step between answering steps (every=k) is the cross-entropy alone
            ce_alone = not source.answers_at(step)
        if answers and model.training and not return_outputs and not ce_alone:
            pad, ends = self._answer_tokens
            joint = source.answer(
                unwrapped, inputs, labels, causal=self.bertscore_term.causal,
                pad_token_id=pad, eos_token_ids=ends, step=step,
            )  # fmt: skip
            inputs = joint.inputs
        elif "decoder_input_ids" not in inputs and hasattr(
            unwrapped, "prepare_decoder_input_ids_from_labels"
        ):
            # an encoder-decoder model builds its decoder inputs from the labels it no longer gets
            inputs["decoder_input_ids"] = unwrapped.prepare_decoder_input_ids_from_labels(
                labels=labels
            )
        # a packed (padding-free) batch: the forward runs packed, the term on one row per
        # document (scored against its own reference, not the row's examples joined)
        documents = None
        if joint is None and self.bertscore_term.causal and isinstance(labels, Tensor):
            documents = PackedDocuments.of(inputs.get("position_ids"), labels)
        term_labels = labels if documents is None else documents.split(labels, IGNORE_INDEX)
        prefetch = self.bertscore_term.scores and not ce_alone and references is None
        if prefetch and term_labels is not None and term_labels.dim() == 2:
            # decoded before the forward: reading the labels after it would wait on a GPU for
            # the whole forward to finish
            references = self.bertscore_term.references_of(term_labels, documents)
        if self.bertscore_fused and not return_outputs:
            # the forward stops before the LM head: CE and BERTScore from one chunked pass
            with lm_head_inputs(unwrapped) as head:
                outputs = model(**inputs)
        else:  # return_outputs: the caller (prediction_step) wants the real logits
            head, outputs = None, model(**inputs)
        term_outputs, own = outputs, {}
        if documents is not None:
            term_outputs = {"logits": documents.split(outputs["logits"])}
        if joint is not None:
            logits, answers = joint.split(outputs["logits"])
            term_outputs = {"logits": logits}
            own = {"candidate_outputs": {"logits": answers},
                   "candidate_labels": joint.candidate_labels,
                   "candidate_rows": joint.candidate_rows}  # fmt: skip
        if ce_alone:
            logits, aligned = self.bertscore_term._aligned(term_outputs, term_labels, "labels")
            loss = self.bertscore_term._cross_entropy_alone(
                logits, aligned, num_items_in_batch, head, training=True, documents=documents
            )
        else:
            loss = self.bertscore_term(
                term_outputs, term_labels, num_items_in_batch, references,
                training=model.training, head=head, documents=documents, **own,
            )  # fmt: skip
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # num_items_in_batch counts every process's tokens and DDP averages the gradients
            loss = loss * self.accelerator.num_processes
        router = self._router_loss(outputs)
        if router is not None:
            # a per-micro-batch mean, as TRL's SFTTrainer adds it: with num_items_in_batch the
            # trainer leaves the accumulation to the loss, so it is averaged over the steps
            steps = 1
            if num_items_in_batch:  # set by the training loop (a step called alone: the args')
                steps = getattr(self, "current_gradient_accumulation_steps", None)
                steps = steps or self.args.gradient_accumulation_steps
            loss = loss + router / steps
        return (loss, outputs) if return_outputs else loss

    def _router_loss(self, outputs) -> Tensor | None:
        """A mixture-of-experts model's weighted load-balancing loss (``router_aux_loss_coef *
        aux_loss``), which the model adds to its own loss only when it gets the labels, which
        this step takes out: without it the router trained on the CE alone (audit h30: a
        Mixtral's router gradient 40x smaller). ``None`` for other models."""
        aux = outputs.get("aux_loss") if hasattr(outputs, "get") else None
        if aux is None:
            return None
        config = self.accelerator.unwrap_model(self.model).config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        # TRL's SFTTrainer keeps its own coefficient (args.router_aux_loss_coef, synced)
        coef = getattr(self, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", 0.0))
        return coef * aux if coef else None

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **kwargs):
        """The trainer's prediction step; the reference column is for :meth:`compute_loss`,
        which takes it out of the batch, and is dropped where the step does not call it
        (``Seq2SeqTrainer``'s generation with ``predict_with_generate``, a split without
        labels): ``generate()`` and the model's forward refuse an argument they do not know.
        There the evaluation loss is the model's own, and no ``eval_ce`` / ``eval_bertscore_f``
        is recorded."""
        generating = getattr(self.args, "predict_with_generate", False) and not (
            prediction_loss_only
        )
        labelled = all(inputs.get(name) is not None for name in self.label_names)
        if REFERENCES_KEY in inputs and (generating or not labelled):
            inputs = {k: v for k, v in inputs.items() if k != REFERENCES_KEY}
        return super().prediction_step(
            model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs
        )

    def evaluate(self, *args, **kwargs) -> dict[str, float]:
        self._bertscore_evaluating = True  # its log() call carries evaluation metrics only
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._bertscore_evaluating = False

    def evaluation_loop(self, *args, **kwargs):
        """The trainer's loop, its metrics joined by the evaluation batches' ``ce`` and
        ``bertscore_f`` (``eval_``-prefixed, or the ``metric_key_prefix`` given)."""
        # the batches of an evaluation that failed part-way must not count in this one
        self.bertscore_term.pop_metrics(training=False)
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        # every process runs the loop: the batches of all of them, as the trainer's eval_loss
        measured = self.bertscore_term.pop_metrics(
            training=False, distributed=self.args.world_size > 1
        )
        output.metrics.update({f"{prefix}_{k}": v for k, v in measured.items()})
        return output

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if not getattr(self, "_bertscore_evaluating", False):
            # every process logs (the trainer gathers its loss there): the rows of all of them
            logs.update(
                self.bertscore_term.pop_metrics(training=True, distributed=self.args.world_size > 1)
            )
        super().log(logs, *args, **kwargs)


def _answer_tokens(model, tokenizer) -> tuple[int, list[int]]:
    """(padding, the tokens that end an answer) for generating the model's answers: the
    generation config's end tokens and the tokenizer's; refused, named, when there is none."""
    config = getattr(model, "generation_config", None)
    ends = getattr(config, "eos_token_id", None)
    ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ends:
        ends.append(tokenizer.eos_token_id)
    if not ends:
        raise ValueError(
            "bertscore_candidates: generating the model's answers needs an end-of-sequence "
            "token; set model.generation_config.eos_token_id or the tokenizer's eos_token"
        )
    pad = tokenizer.pad_token_id
    return (ends[0] if pad is None else pad), ends


def _with_end_of_sequence(processing_class, args):
    """``processing_class``, or for a trainer that appends an end-of-sequence token (its
    arguments have ``eos_token``, as TRL's ``SFTConfig``) and a tokenizer that has none, a copy
    whose end-of-sequence token is its ``[SEP]``."""
    import copy

    tokenizer = processing_class  # a processor (multimodal) is left as it is
    if (
        tokenizer is None
        or hasattr(tokenizer, "tokenizer")
        or not hasattr(args, "eos_token")
        or args.eos_token is not None
        or getattr(tokenizer, "eos_token", None) is not None
    ):
        return processing_class
    if getattr(tokenizer, "sep_token", None) is None:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no end-of-sequence token, which "
            "this trainer appends to every completion: set tokenizer.eos_token = '...' or "
            f"{type(args).__name__}(eos_token='...') to a token of its vocabulary"
        )
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.eos_token = tokenizer.sep_token  # a BERT tokenizer ends a sequence with [SEP]
    return tokenizer


def bertscore_compute_metrics(
    tokenizer,
    scorer: BERTScorer | None = None,
    prefix: str = "bertscore_",
    *,
    teacher_forced: bool | None = None,
    causal: bool = False,
) -> Callable[[Any], dict[str, float]]:
    """A ``compute_metrics`` for ``Trainer`` / ``Seq2SeqTrainer``: mean BERTScore P, R and F of
    the decoded predictions against the decoded labels (``-100`` in the labels: not part of
    the reference).

    Predictions are either
    - generated token ids (``Seq2SeqTrainer(predict_with_generate=True)``), decoded whole
      (``-100``, the evaluation loop's padding, skipped); or
    - teacher-forced: logits ``[N, L, V]`` or their argmax ``[N, L]`` (what a
      ``preprocess_logits_for_metrics`` returning ``logits.argmax(-1)`` leaves), aligned with
      the labels, of which only the positions with a label are decoded (the prompt's and the
      padding's predictions are not the model's answer).

    Args:
        tokenizer: the generator's tokenizer.
        scorer: the :class:`~bsloss.BERTScorer`; default: the embedded all-MiniLM-L6-v2.
        prefix: prefix of the metric names.
        teacher_forced: whether the predictions are teacher-forced; default: logits are,
            token ids are not (generated).
        causal: teacher-forced predictions of a causal LM, whose position ``t`` predicts the
            label at ``t + 1`` (``True`` implies ``teacher_forced``).

    Returns:
        A function of an ``EvalPrediction`` (or ``(predictions, label_ids)``) returning
        ``{prefix + "precision": ..., prefix + "recall": ..., prefix + "f1": ...}``.

    Raises:
        ValueError: predictions and labels differ in number of rows, or teacher-forced
            predictions not of the labels' ``[N, L]`` (from the returned function);
            ``teacher_forced=False`` with ``causal=True``.

    >>> import numpy as np, bsloss
    >>> from bsloss.integrations.huggingface import bertscore_compute_metrics
    >>> scorer = bsloss.BERTScorer()
    >>> metrics = bertscore_compute_metrics(scorer.encoder.tokenizer, scorer)
    >>> ids = np.array([scorer.encoder.tokenizer("a cat sat")["input_ids"]])
    >>> round(metrics((ids, ids))["bertscore_f1"], 4)
    1.0
    """
    causal = check_flag(causal, "causal")
    if teacher_forced is not None:
        teacher_forced = check_flag(teacher_forced, "teacher_forced")
    scorer = scorer or BERTScorer()
    if teacher_forced is False and causal:
        raise ValueError("causal=True is for teacher-forced predictions: teacher_forced=False")

    def decode(rows: Tensor, keep: Tensor) -> list[str]:
        # each row's kept ids alone: -100 mapped to a padding id would decode as a token in a
        # vocabulary whose padding is an ordinary token (or that has none: id 0, GPT-2's "!")
        texts = tokenizer.batch_decode(
            [row[kept].tolist() for row, kept in zip(rows, keep, strict=True)],
            skip_special_tokens=True,
        )
        return [t.strip() for t in texts]

    def compute_metrics(eval_prediction) -> dict[str, float]:
        predictions, label_ids = eval_prediction[0], eval_prediction[1]
        if isinstance(predictions, tuple):
            predictions = predictions[0]
        predictions, label_ids = torch.as_tensor(predictions), torch.as_tensor(label_ids)
        if len(predictions) != len(label_ids):
            raise ValueError(f"{len(predictions)} predictions but {len(label_ids)} label rows")
        forced = causal or (predictions.dim() == 3 if teacher_forced is None else teacher_forced)
        if predictions.dim() == 3:
            predictions = predictions.argmax(dim=-1)
        if forced:
            if predictions.shape != label_ids.shape:
                raise ValueError(
                    f"teacher-forced predictions must be [N, L] as the labels, "
                    f"{list(label_ids.shape)}; got {list(predictions.shape)}"
                )
            if causal:  # position t predicts the label at t + 1
                predictions, label_ids = predictions[:, :-1], label_ids[:, 1:]
            candidates = decode(predictions, label_ids != IGNORE_INDEX)
        else:
            candidates = decode(predictions, predictions != IGNORE_INDEX)
        references = decode(label_ids, label_ids != IGNORE_INDEX)
        P, R, F = scorer.score(candidates, references, progress=False)
        return {
            prefix + "precision": P.mean().item(),
            prefix + "recall": R.mean().item(),
            prefix + "f1": F.mean().item(),
        }

    return compute_metrics
