"""Differentiable BERTScore losses.

``BERTScoreLoss`` composes three pieces: the generator's distributions become scorer input
embeddings (:mod:`bsloss.distributions`, through the :mod:`bsloss.bridge` when vocabularies
differ), the frozen :class:`~bsloss.scorer.encoder.ScorerEncoder` contextualises them, and
:func:`bsloss.functional.bert_score` (the same function as the evaluation metric) matches them to
the references.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import NamedTuple

import torch
from torch import Tensor, nn

from bsloss._warnings import warn_user
from bsloss.baseline import load_baseline
from bsloss.bridge import (
    BridgeMode,
    Retokenizer,
    VocabularyBridge,
    check_bridge_mode,
    resolve_bridge_mode,
)
from bsloss.candidate_transforms import CandidateTransform, resolve_candidate_transforms
from bsloss.distributions import (
    augment_table,
    check_finite_tensor,
    expected_inputs,
    most_probable_tokens,
    token_distribution,
)
from bsloss.functional import (
    PRF,
    batch_center,
    bert_score,
    best_over_references,
    rescale_with_baseline,
)
from bsloss.functional.fused_expectation import (
    IGNORE_INDEX,
    NonFiniteLogitsError,
    fused_expected_inputs,
)
from bsloss.functional.gumbel_noise import draw_seed
from bsloss.functional.matching import Matching, resolve_matching
from bsloss.functional.matching.base import check_temperature
from bsloss.inputs import (
    check_reference_groups,
    check_texts,
    flatten_groups,
    position_of_first,
)
from bsloss.scorer.batching import pad_embedded
from bsloss.scorer.checkpointing import set_gradient_checkpointing
from bsloss.scorer.encoder import ScorerEncoder
from bsloss.scorer.reference_cache import ReferenceCache, ReferenceEmbedder
from bsloss.scorer.weights import IdfSpec, weight_table
from bsloss.special_tokens import splice_special_tokens

__all__ = ["BERTScoreLoss", "LossAndCrossEntropy"]

_TARGETS = ("precision", "recall", "f1")


class LossAndCrossEntropy(NamedTuple):
    """What :class:`BERTScoreLoss` returns when called with ``target_ids``: the BERTScore loss and
    the cross-entropy of the targets, both from the same chunked pass over the LM head (reduced
    by the loss's ``reduction``: token mean, token sum, or ``[B, L]`` with 0 at ignored ids)."""

    loss: Tensor
    cross_entropy: Tensor


class _Encoded(NamedTuple):
    """Candidates through the scorer: hidden states ``[B, L', d]``, mask and importance
    weights; the ``[B, L]`` log-likelihood of ``target_ids`` (fused path); and, in
    ``bridge_mode="retokenize"``, the decoded texts' own encoding (no gradient), whose score is
    the loss's value while ``hidden`` gives its gradient (:mod:`bsloss.bridge`)."""

    hidden: Tensor
    mask: Tensor
    weights: Tensor
    log_likelihood: Tensor | None = None
    exact: tuple[Tensor, Tensor, Tensor] | None = None


def _float32(hidden: Tensor) -> Tensor:
    return hidden.float()


def _check_tensor(value: object, name: str, kind: str) -> Tensor:
    """``value`` is a tensor of ``kind`` ``"float"`` or ``"integer"`` dtype (``"mask"``: bool or
    integer)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    floating, complex_ = value.is_floating_point(), value.is_complex()
    ok = {
        "float": floating,
        "integer": not floating and not complex_ and value.dtype != torch.bool,
        "mask": not floating and not complex_,
    }[kind]
    if not ok:
        wanted = {"float": "a floating", "integer": "an integer", "mask": "a bool or integer"}
        raise TypeError(f"{name} must have {wanted[kind]} dtype, got {value.dtype}")
    return value


def _arguments(frame_locals: dict) -> dict:
    """A public method's keyword arguments (its ``locals()`` on entry), passed on whole."""
    return {name: value for name, value in frame_locals.items() if name != "self"}


_SCORER = "encoder."


def _drop_scorer_state(module: nn.Module, state_dict: dict, prefix: str, metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + _SCORER)]:
        del state_dict[key]


def _keep_scorer_state(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A state dict saved without the scorer loads with the scorer left as it is."""
    for key, value in module.encoder.state_dict(prefix=prefix + _SCORER, keep_vars=True).items():
        state_dict.setdefault(key, value)


class BERTScoreLoss(nn.Module):
    """``1 - BERTScore`` of candidates (generator distributions, token ids or embeddings)
    against references, differentiable in the candidates.

    Args:
        model, num_layers: the scorer (``None``: embedded all-MiniLM-L6-v2), or pass ``encoder``.
        matching: a :class:`~bsloss.functional.Matching` object (``Hard()``: gradient
            through the argmax cells; ``Softmax(temperature=...)``, ``LogSumExp(...)``,
            ``Sinkhorn(temperature=..., iterations=...)``, or your own subclass), or its
            string shorthand ``"hard"``, ``"softmax"``, ``"logsumexp"`` or ``"sinkhorn"``.
            Stored resolved, as an object, in ``loss.matching``.
        temperature: with a shorthand, ``T`` of the soft matchings (default 0.05). With an
            object: leave it out (or repeat the object's value; another value is an error).
        sinkhorn_iterations: with a shorthand, Sinkhorn steps for ``matching="sinkhorn"``
            (default 1). With an object: as ``temperature``.
        target: which score the loss is ``1 -`` of: ``"f1"``, ``"precision"`` or ``"recall"``.
        idf: ``False``, a list of sentences, or a ``{scorer_token_id: weight}`` dict.
        center: subtract the batch mean of the candidates' and of the references' token vectors
            (Chen et al., 2020), over all processes under torch.distributed.
        rescale_with_baseline, baseline_path: baseline rescaling of the score.
        generator_tokenizer: the generator's tokenizer when it differs from the scorer's (a
            :class:`~bsloss.bridge.VocabularyBridge` is built, or pass ``bridge``).
        bridge_mode: ``"retokenize"`` (exact: the decoded candidate text is scored with the
            scorer's own tokenisation, gradient straight-through the bridge) or ``"average"``
            (one averaged scorer position per generator token); see :mod:`bsloss.bridge`.
            ``None``: ``"retokenize"`` when the vocabularies differ and ``generator_tokenizer``
            is given, ``"average"`` for a ``bridge`` passed without it. After a retokenize
            call, ``loss.last_texts`` holds the decoded candidates that were scored.
        candidate_transforms: how the candidates' distributions become token weights
            (:mod:`bsloss.candidate_transforms`): :class:`~bsloss.TopK` ``(k)``,
            :class:`~bsloss.StraightThrough` ``()``, :class:`~bsloss.Gumbel` ``(temperature)``,
            one object or several. Stored resolved in ``loss.candidates``.
        top_k, straight_through, gumbel_temperature: their keyword shorthands (not with the
            same object in ``candidate_transforms``). ``top_k=1`` is refused: the renormalised
            top-1 weight is always 1, so its gradient is exactly zero.
        gradient_checkpointing: recompute the scorer's layer activations in the backward pass.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``. An empty batch (``B = 0``) gives the
            loss 0 (with a zero gradient) for ``"mean"`` and ``"sum"``.
        long_inputs: reference texts longer than the scorer's maximum: ``"truncate"`` (with a
            warning naming them) or ``"window"`` (encoded whole with overlapping windows, as
            :class:`~bsloss.BERTScorer` does). Candidates with more real tokens than the scorer
            takes are truncated with a warning (the tokens beyond get no score and no gradient).
        reference_cache_size: reference texts whose hidden states are kept across calls, on the
            scorer's device, least recently used evicted first (``0``: none); :meth:`clear_cache`
            empties it. It is bounded in bytes too: ``loss.reference_cache.max_bytes``.

    The frozen scorer is not part of the loss's ``state_dict()`` (a model holding the loss does
    not save it in each checkpoint); such a state dict loads strictly, the scorer left as it is.

    Returns:
        Calling it (:meth:`forward`) returns ``1 - score`` of ``target``, reduced by
        ``reduction``; :meth:`score` returns the per-sample ``PRF``.

    Raises:
        ValueError, TypeError: an argument of the wrong type or out of range, named.
        FileNotFoundError: no baseline file for ``rescale_with_baseline``.

    >>> import torch, bsloss
    >>> loss_fn = bsloss.BERTScoreLoss(matching="softmax", temperature=0.05)
    >>> logits = torch.randn(2, 6, 30522, requires_grad=True)  # a generator's [B, L, V] output
    >>> loss = loss_fn(logits=logits, references=["a cat sat", "the dog ran"])
    >>> loss.backward(); logits.grad.shape
    torch.Size([2, 6, 30522])

    The matching as an object (parameters validated where it is built):

    >>> from bsloss import Sinkhorn
    >>> loss_fn = bsloss.BERTScoreLoss(matching=Sinkhorn(temperature=0.1, iterations=2))
    >>> loss_fn.matching
    Sinkhorn(temperature=0.1, iterations=2)
    >>> loss_fn(logits=logits, references=["a cat sat", "the dog ran"]).shape
    torch.Size([])

    Candidate-distribution transforms as objects (or ``top_k=32, straight_through=True``):

    >>> from bsloss import StraightThrough, TopK
    >>> loss_fn = bsloss.BERTScoreLoss(candidate_transforms=[TopK(32), StraightThrough()])
    >>> loss_fn.candidates
    CandidateOptions(top_k=32, straight_through=True, gumbel_temperature=None)
    """

    def __init__(
        self,
        model: str | None = None,
        num_layers: int | None = None,
        *,
        encoder: ScorerEncoder | None = None,
        matching: str | Matching = "softmax",
        temperature: float | None = None,
        sinkhorn_iterations: int | None = None,
        target: str = "f1",
        idf: IdfSpec = False,
        center: bool = False,
        rescale_with_baseline: bool = False,
        baseline_path: str | None = None,
        generator_tokenizer=None,
        bridge: VocabularyBridge | None = None,
        bridge_cache_dir: str | None = None,
        bridge_mode: str | None = None,
        candidate_transforms: CandidateTransform | Sequence[CandidateTransform] | None = None,
        top_k: int | None = None,
        straight_through: bool = False,
        gumbel_temperature: float | None = None,
        gradient_checkpointing: bool = True,
        reduction: str = "mean",
        device: str | torch.device | None = None,
        long_inputs: str = "truncate",
        reference_cache_size: int = 10_000,
    ):
        super().__init__()
        matching = resolve_matching(matching, temperature, sinkhorn_iterations)
        if target not in _TARGETS:
            raise ValueError(f"target must be one of {_TARGETS}, got {target!r}")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        candidates = resolve_candidate_transforms(
            candidate_transforms,
            top_k=top_k,
            straight_through=straight_through,
            gumbel_temperature=gumbel_temperature,
        )
        if candidates.top_k == 1:
            raise ValueError(
                "top_k=1 gives an exactly zero gradient (the renormalised top-1 weight is "
                "always 1); use top_k >= 2, or candidate_ids to score decoded tokens"
            )
        if long_inputs not in ("truncate", "window"):
            raise ValueError(f"long_inputs must be 'truncate' or 'window', got {long_inputs!r}")
        self.long_inputs = long_inputs
        self.encoder = encoder or ScorerEncoder.from_pretrained(model, num_layers, device)
        set_gradient_checkpointing(self.encoder.model, gradient_checkpointing)
        self.matching = matching
        self.target, self.center, self.reduction = target, center, reduction
        self.candidates = candidates
        check_bridge_mode(bridge_mode)  # before building a bridge
        if generator_tokenizer is not None and not all(
            callable(getattr(generator_tokenizer, method, None))
            for method in ("get_vocab", "convert_ids_to_tokens", "batch_decode")
        ):
            raise TypeError(
                "generator_tokenizer must be a Hugging Face tokenizer (get_vocab, batch_decode), "
                f"got {type(generator_tokenizer).__name__} {generator_tokenizer!r:.60}; load it "
                "with transformers.AutoTokenizer.from_pretrained(...)"
            )
        if bridge is None and generator_tokenizer is not None:
            bridge = VocabularyBridge.build(
                generator_tokenizer, self.encoder, cache_dir=bridge_cache_dir
            )
        self.bridge = bridge
        # how the candidates reach the scorer; the modes' differences live in bsloss.bridge
        self.bridging: BridgeMode = resolve_bridge_mode(
            bridge, bridge_mode, generator_tokenizer, self.encoder
        )
        self.last_texts: list[str] = []  # the decoded candidates of the last retokenize call
        if idf is True:
            raise ValueError(
                "idf=True (from each call's references) is for BERTScorer; pass the "
                "reference corpus as idf=[...] to fix the loss's weights"
            )
        vocab = self.encoder.input_embeddings.num_embeddings
        weights = weight_table(self.encoder, idf, vocab)
        self.register_buffer("scorer_weights", weights.float(), persistent=False)
        self.baseline: Tensor | None = None
        if rescale_with_baseline:
            baseline = load_baseline(baseline_path, self.encoder.name, self.encoder.num_layers)
            self.baseline = baseline.float()
        # raw float32 hidden states under the caller's autocast (part of the cache key)
        self._references = ReferenceEmbedder(
            self.encoder,
            reference_cache_size,
            transform=_float32,
            autocast_dtype="ambient",
            inference_mode=False,
        )
        self._generator_tables: dict[tuple, Tensor] = {}
        # The frozen scorer is not the loss's state: a model holding the loss as a submodule
        # would otherwise save the scorer (87 MB for MiniLM) in every checkpoint.
        self._register_state_dict_hook(_drop_scorer_state)
        self._register_load_state_dict_pre_hook(_keep_scorer_state, with_module=True)

    # ------------------------------------------------------------------ caches
    @property
    def reference_cache(self) -> ReferenceCache:
        """The cached reference hidden states (text -> (hidden ``[L, d]``, ids ``[L]``))."""
        return self._references.cache

    def clear_cache(self) -> None:
        """Forget the cached reference hidden states and generator embedding tables."""
        self._references.cache.clear()
        self._generator_tables.clear()

    # ------------------------------------------------------------------ candidates
    @property
    def bridge_mode(self) -> str | None:
        """``"retokenize"``, ``"average"``, or ``None`` (the scorer's own vocabulary)."""
        return self.bridging.name

    @property
    def retokenizer(self) -> Retokenizer | None:
        """The decoder of ``bridge_mode="retokenize"`` (``None`` in the other modes)."""
        return getattr(self.bridging, "retokenizer", None)

    @property
    def generator_vocab_size(self) -> int:
        return self.bridging.vocab_size(self.encoder.input_embeddings.num_embeddings)

    def _generator_table(self) -> Tensor:
        """``[V_gen, d + 1]``: input embeddings and importance weights of the generator's tokens
        (through the bridge when vocabularies differ). The scorer is frozen, so it is built once
        per device and dtype."""
        table = self.encoder.input_embeddings.weight
        key = (table.device, table.dtype)
        if key not in self._generator_tables:
            weights = self.scorer_weights
            # a plain tensor even when first built under torch.inference_mode(): a later
            # training call saves it for backward
            with torch.inference_mode(False), torch.no_grad():
                table, weights = self.bridging.tables(table.detach(), weights)
                self._generator_tables = {key: augment_table(table, weights)}
        return self._generator_tables[key]

    def _check_vocab(self, size: int, name: str) -> None:
        if size != self.generator_vocab_size:
            raise ValueError(self.bridging.vocabulary_error(name, size, self.generator_vocab_size))

    def _check_candidates(
        self, logits, probs, candidate_ids, embeddings, hidden_states, candidate_mask
    ):
        """The one candidate input and its ``[B, L]`` bool mask, validated."""
        named = {
            "logits": logits,
            "probs": probs,
            "candidate_ids": candidate_ids,
            "embeddings": embeddings,
            "hidden_states": hidden_states,
        }
        given = [name for name, x in named.items() if x is not None]
        if len(given) != 1:
            raise ValueError(
                "pass exactly one of logits, probs, candidate_ids, embeddings or hidden_states"
                + (f" (got {', '.join(given)})" if given else "")
            )
        name = given[0]
        source = _check_tensor(named[name], name, "integer" if name == "candidate_ids" else "float")
        rank = 2 if name == "candidate_ids" else 3
        if source.dim() != rank:
            shape = {
                "candidate_ids": "[B, L]",
                "embeddings": "[B, L, d]",
                "hidden_states": "[B, L, d_model]",
            }.get(name, "[B, L, V]")
            raise ValueError(f"{name} must be {shape}, got shape {list(source.shape)}")
        if source.device.type != self.encoder.device.type:
            raise ValueError(
                f"{name} is on {source.device} but the scorer is on {self.encoder.device}; "
                "move the loss with .to(device)"
            )
        if candidate_mask is None:
            candidate_mask = torch.ones(source.shape[:2], dtype=torch.bool, device=source.device)
        _check_tensor(candidate_mask, "candidate_mask", "mask")
        if tuple(candidate_mask.shape) != tuple(source.shape[:2]):
            raise ValueError(
                f"candidate_mask must have shape {list(source.shape[:2])} "
                f"([B, L] of the candidates), got {list(candidate_mask.shape)}"
            )
        return name, source, candidate_mask.to(source.device).bool()

    def _fit_candidates(self, mask: Tensor, name: str) -> Tensor:
        """Keep at most as many real tokens per row as the scorer takes between its special
        tokens; warn naming the rows cut (their later tokens get no score and no gradient)."""
        limit = self.encoder.tokenization.content_length
        if mask.shape[1] <= limit:
            return mask
        rank = torch.cumsum(mask.long(), dim=1)
        cut = mask & (rank > limit)
        rows = cut.any(dim=1).nonzero().flatten().tolist()
        if not rows:
            return mask
        shown = ", ".join(f"{name}[{i}]" for i in rows[:10]) + (", ..." if len(rows) > 10 else "")
        fate = self.bridging.truncation
        warn_user(
            f"{len(rows)} of {mask.shape[0]} candidates have more than {limit} real tokens, "
            f"the most {self.encoder.name} takes between its special tokens ({shown}); {fate}"
        )
        return mask & ~cut

    def encode_candidates(self, **candidates) -> tuple[Tensor, Tensor, Tensor]:
        """Scorer hidden states ``[B, L', d]``, real-token mask and importance weights of the
        candidates (the keyword arguments of :meth:`score` that describe them): the encoding
        the gradient flows through (in ``bridge_mode="retokenize"``, the average bridge's; the
        decoded text's own encoding gives the value, see :mod:`bsloss.bridge`).

        Raises:
            TypeError, ValueError: not exactly one candidate input, a non-tensor, a wrong dtype,
                shape or device, NaN/Inf, ids outside the vocabulary (all named).
        """
        return self._encode_candidates(**candidates)[:3]

    def _encode_candidates(
        self,
        *,
        logits: Tensor | None = None,
        probs: Tensor | None = None,
        candidate_ids: Tensor | None = None,
        embeddings: Tensor | None = None,
        hidden_states: Tensor | None = None,
        output_embeddings: Tensor | nn.Module | None = None,
        target_ids: Tensor | None = None,
        logit_softcap: float | None = None,
        generator_temperature: float | None = None,
        candidate_mask: Tensor | None = None,
    ) -> _Encoded:
        """The candidates, whichever their source (validated here, once), encoded by the
        scorer: one method per source below."""
        name, source, candidate_mask = self._check_candidates(
            logits, probs, candidate_ids, embeddings, hidden_states, candidate_mask
        )
        head = {
            "output_embeddings": output_embeddings,
            "target_ids": target_ids,
            "logit_softcap": logit_softcap,
            "generator_temperature": generator_temperature,
        }
        if hidden_states is None:
            # the options of the fused LM-head pass: another input has no logits to apply them to
            given = [key for key, value in head.items() if value is not None]
            if given:
                raise ValueError(
                    f"the fused LM-head pass's options go with hidden_states, not with {name}: "
                    f"got {', '.join(given)} (apply a temperature or soft-cap to the logits "
                    "before passing them)"
                )
        else:
            if logit_softcap is not None:
                head["logit_softcap"] = check_temperature(logit_softcap, "logit_softcap")
            head["generator_temperature"] = check_temperature(
                1.0 if generator_temperature is None else generator_temperature,
                "generator_temperature",
            )
        if source.shape[0] == 0:
            return self._encode_nothing(source, name, target_ids)
        if name == "embeddings":
            return self._encode_embeddings(source, candidate_mask)
        if name == "candidate_ids":
            return self._encode_ids(source, candidate_mask, name)
        return self._encode_distributions(name, logits, probs, hidden_states, candidate_mask, head)

    def _encode_nothing(self, source: Tensor, name: str, target_ids: Tensor | None) -> _Encoded:
        """An empty batch: nothing to encode (kept on the graph of the input)."""
        nothing = source.reshape(-1)[:0].float()
        empty_mask = torch.zeros(0, 0, dtype=torch.bool, device=source.device)
        hidden = nothing.reshape(0, 0, self.encoder.hidden_size)
        log_likelihood = None if target_ids is None else nothing.reshape(0, 0)
        encoded = (hidden, empty_mask, nothing.reshape(0, 0))
        # a decoding bridge scores distributions twice (the gradient's encoding and the text's)
        twice = self.bridging.decodes and name not in ("candidate_ids", "embeddings")
        return _Encoded(*encoded, log_likelihood, encoded if twice else None)

    def _encode_embeddings(self, embeddings: Tensor, candidate_mask: Tensor) -> _Encoded:
        """Scorer hidden states given as the candidates: taken as they are."""
        if embeddings.shape[-1] != self.encoder.hidden_size:
            raise ValueError(
                f"embeddings must be [B, L, {self.encoder.hidden_size}] scorer "
                f"hidden states, got {list(embeddings.shape)}"
            )
        check_finite_tensor(embeddings, "embeddings")
        return _Encoded(embeddings, candidate_mask, candidate_mask.to(torch.float32))

    def _encode_ids(self, candidate_ids: Tensor, candidate_mask: Tensor, name: str) -> _Encoded:
        """Token ids: their rows of the generator table, or (a decoding bridge) their text."""
        table = self._generator_table()
        bad = (candidate_ids < 0) | (candidate_ids >= table.shape[0])
        if (bad & candidate_mask).any():
            raise ValueError(
                f"candidate_ids has ids outside [0, {table.shape[0]}) at "
                f"candidate_ids{position_of_first(bad & candidate_mask)}"
            )
        special = self._scorer_special_ids(candidate_ids.device)
        candidate_mask = self.bridging.content_ids(candidate_ids, candidate_mask, special)
        ids = candidate_ids.clamp(0, table.shape[0] - 1)
        if self.bridging.decodes:  # the decoded text, whole: the scorer's own limit
            return _Encoded(*self._retokenized(ids, candidate_mask))
        candidate_mask = self._fit_candidates(candidate_mask, name)
        rows = table[ids]
        return _Encoded(*self._encode_inputs(rows[..., :-1], rows[..., -1], candidate_mask))

    def _encode_distributions(
        self,
        name: str,
        logits: Tensor | None,
        probs: Tensor | None,
        hidden_states: Tensor | None,
        candidate_mask: Tensor,
        head: dict,
    ) -> _Encoded:
        """Distributions (``[B, L, V]`` logits or probabilities, or the LM head's input): their
        expected embeddings and weights under the candidate transforms; with a decoding bridge
        also the decoded argmax text's encoding (``exact``, no gradient)."""
        table = self._generator_table()
        # in retokenize mode the decoded text is scored whole (the scorer's limit applies to its
        # pieces); the one-position-per-token encoding that gives the gradient is cut
        whole_mask = candidate_mask
        candidate_mask = self._fit_candidates(candidate_mask, name)
        log_likelihood = None
        # one seed per call: the dense and the fused path draw the same Gumbel noise from it
        seed = None if self.candidates.gumbel_temperature is None else draw_seed()
        if hidden_states is not None:
            check_finite_tensor(hidden_states, "hidden_states")
            inputs, weights, log_likelihood, tokens = self._fused_inputs(
                seed,
                hidden_states,
                head["output_embeddings"],
                head["target_ids"],
                candidate_mask,
                table,
                head["logit_softcap"],
                head["generator_temperature"],
            )
        else:
            self._check_vocab((logits if probs is None else probs).shape[-1], name)
            distribution = token_distribution(
                logits, probs, **asdict(self.candidates), gumbel_seed=seed
            )
            inputs, weights = expected_inputs(distribution, table)
            # float64 logits give float64 expectations; the scorer runs in its own dtype
            inputs = inputs.to(table.dtype)
            tokens = most_probable_tokens(distribution) if self.bridging.decodes else None
        encoded = self._encode_inputs(inputs, weights, candidate_mask)
        exact = None
        if self.bridging.decodes:
            with torch.no_grad():
                exact = self._retokenized(tokens, whole_mask)
        return _Encoded(*encoded, log_likelihood, exact)

    def _scorer_special_ids(self, device: torch.device) -> Tensor:
        pad = self.encoder.tokenizer.pad_token_id
        ids = {*self.encoder.tokenization.special_token_ids, pad} - {None}
        return torch.tensor(sorted(ids), dtype=torch.long, device=device)

    def _retokenized(self, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The scorer's encoding of the decoded ``tokens``, tokenised as the metric tokenises
        text (:mod:`bsloss.bridge`); ``self.last_texts`` keeps the decoded texts."""
        batch = self.bridging.retokenize(tokens, mask)
        self.last_texts = batch.texts
        inputs = self.encoder.input_embeddings.weight.detach()[batch.piece_ids]
        weights = self.scorer_weights[batch.piece_ids].to(inputs.dtype)
        return self._encode_inputs(inputs, weights, batch.piece_mask)

    def _encode_inputs(self, inputs: Tensor, weights: Tensor, candidate_mask: Tensor):
        tokens = self.encoder.tokenization
        inputs, attention, special = splice_special_tokens(
            inputs,
            candidate_mask,
            self.encoder.input_embeddings.weight,
            tokens.prefix_ids,
            tokens.suffix_ids,
            tokens.max_length,
        )
        hidden = self.encoder(inputs_embeds=inputs, attention_mask=attention.long())
        # Weights follow the tokens to their packed slots; special tokens weigh 0.
        packed = torch.zeros(attention.shape, dtype=weights.dtype, device=hidden.device)
        real = attention & ~special
        packed[real] = weights[candidate_mask]
        return hidden, attention, packed

    def _fused_inputs(
        self,
        seed: int | None,
        hidden_states: Tensor,
        output_embeddings: Tensor | nn.Module | None,
        target_ids: Tensor | None,
        candidate_mask: Tensor,
        table: Tensor,
        softcap: float | None,
        temperature: float,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """Expected inputs and weights ``[B, L, d]``, ``[B, L]`` from the LM head's input and
        weight, chunked (:mod:`bsloss.functional.fused_expectation`), the targets'
        log-likelihood ``[B, L]`` from the same pass, and the most probable tokens ``[B, L]``
        (what ``bridge_mode="retokenize"`` decodes)."""
        if output_embeddings is None:
            raise ValueError("hidden_states needs output_embeddings (the LM head or its weight)")
        weight = getattr(output_embeddings, "weight", output_embeddings)
        if isinstance(weight, Tensor) and weight.dim() == 2:
            self._check_vocab(weight.shape[0], "output_embeddings")
        # Only the positions that are scored or have a target go through the head.
        selected = candidate_mask
        if target_ids is not None:
            _check_tensor(target_ids, "target_ids", "integer")
            if tuple(target_ids.shape) != tuple(hidden_states.shape[:2]):
                raise ValueError(
                    f"target_ids must have shape {list(hidden_states.shape[:2])} ([B, L] of "
                    f"hidden_states), got {list(target_ids.shape)}"
                )
            selected = candidate_mask | (target_ids != IGNORE_INDEX)
        try:
            out = fused_expected_inputs(
                hidden_states[selected],
                output_embeddings,
                table,
                target_ids=None if target_ids is None else target_ids[selected],
                softcap=softcap,
                temperature=temperature,
                top_k=self.candidates.top_k,
                straight_through=self.candidates.straight_through,
                gumbel_temperature=self.candidates.gumbel_temperature,
                gumbel_seed=seed,
                # the noise is addressed by the position in [B, L], as on the dense path
                row_ids=selected.flatten().nonzero().squeeze(1),
                # the retokenizer needs the argmax tokens, which the chunked pass tracks
                use_sdpa=not self.bridging.decodes,
            )
        except NonFiniteLogitsError as error:
            where = selected.nonzero()[error.row].tolist()  # the pass's row -> its [b, t]
            raise ValueError(
                f"the logits of hidden_states{where} under output_embeddings are NaN or Inf (NaN "
                "or Inf in hidden_states or the LM head's weight, a float16 overflow of h W^T, "
                f"or logit_softcap={softcap} / generator_temperature={temperature} making them "
                "overflow)"
            ) from None
        batch, length = selected.shape
        # float64 hidden states give float64 expectations; the scorer runs in its own dtype
        expected = out.expected.to(table.dtype)
        full = expected.new_zeros(batch, length, expected.shape[-1])
        full = full.masked_scatter(selected[..., None], expected)
        tokens = torch.zeros(batch, length, dtype=torch.long, device=hidden_states.device)
        if out.tokens is not None:
            tokens = tokens.masked_scatter(selected, out.tokens)
        log_likelihood = None
        if out.log_likelihood is not None:
            log_likelihood = out.log_likelihood.new_zeros(batch, length)
            log_likelihood = log_likelihood.masked_scatter(selected, out.log_likelihood)
        return full[..., :-1], full[..., -1], log_likelihood, tokens

    # ------------------------------------------------------------------ references
    def _embed_references(self, texts: list[str]) -> tuple[Tensor, Tensor, Tensor, set[str]]:
        embedded, truncated = self._references.embed(
            texts, cache_texts=texts, window=self.long_inputs == "window", batch_size=64
        )
        hidden, mask, weights = pad_embedded([embedded[t] for t in texts], self.scorer_weights)
        return hidden, mask, weights, truncated

    def encode_references(self, texts: Sequence[str]) -> tuple[Tensor, Tensor, Tensor]:
        """Padded hidden states ``[N, L, d]``, mask and importance weights of reference texts,
        each encoded once and cached (:attr:`reference_cache`).

        Raises:
            TypeError, ValueError: ``texts`` is not a list of valid strings (position named).
        """
        texts = check_texts(texts, "texts")
        hidden, mask, weights, truncated = self._embed_references(texts)
        if truncated:
            where = [f"texts[{i}]" for i, t in enumerate(texts) if t in truncated]
            self._warn_truncated(where, len(texts))
        return hidden, mask, weights

    def _warn_truncated(self, where: list[str], total: int) -> None:
        shown = ", ".join(where[:10]) + (", ..." if len(where) > 10 else "")
        warn_user(self.encoder.tokenization.truncation_message(len(where), total, shown))

    @torch.no_grad()
    def encode_reference_ids(self, reference_ids: Tensor, reference_mask: Tensor | None):
        """Hidden states ``[B, L, d]``, mask and importance weights of reference token ids
        (special tokens included, as the scorer's tokenizer adds them).

        Raises:
            TypeError, ValueError: a wrong dtype, shape or device, ids outside the scorer's
                vocabulary, or a row with more tokens than the scorer takes (all named).
        """
        _check_tensor(reference_ids, "reference_ids", "integer")
        if reference_ids.dim() != 2:
            raise ValueError(f"reference_ids must be [B, L], got {list(reference_ids.shape)}")
        if reference_mask is None:
            reference_mask = torch.ones_like(reference_ids, dtype=torch.bool)
        _check_tensor(reference_mask, "reference_mask", "mask")
        if reference_mask.shape != reference_ids.shape:
            raise ValueError(
                f"reference_mask must have shape {list(reference_ids.shape)}, got "
                f"{list(reference_mask.shape)}"
            )
        if reference_ids.device.type != self.encoder.device.type:
            raise ValueError(
                f"reference_ids is on {reference_ids.device} but the scorer is on "
                f"{self.encoder.device}; move the loss with .to(device)"
            )
        mask = reference_mask.to(reference_ids.device).bool()
        vocab = self.encoder.input_embeddings.num_embeddings
        bad = ((reference_ids < 0) | (reference_ids >= vocab)) & mask
        if bad.any():
            raise ValueError(
                f"reference_ids has ids outside the scorer's vocabulary [0, {vocab}) at "
                f"reference_ids{position_of_first(bad)}"
            )
        # padding after the last real column is dropped: a long padded batch of short rows fits
        if mask.shape[1] > self.encoder.max_length:
            columns = mask.any(dim=0).nonzero()
            width = int(columns.max()) + 1 if len(columns) else 0
            if width > self.encoder.max_length:
                row = int(mask[:, self.encoder.max_length :].any(dim=1).nonzero()[0])
                raise ValueError(
                    f"reference_ids[{row}] has tokens past position {self.encoder.max_length}, "
                    f"the most {self.encoder.name} takes; pass the reference texts as "
                    "references=[...] (long_inputs='window' scores them whole) or shorten them"
                )
            reference_ids, mask = reference_ids[:, :width], mask[:, :width]
        ids = reference_ids.clamp(0, vocab - 1)
        hidden = self.encoder(input_ids=ids, attention_mask=mask.long()).float()
        return hidden, mask, self.scorer_weights[ids] * mask

    # ------------------------------------------------------------------ scoring
    def score(
        self,
        *,
        logits: Tensor | None = None,
        probs: Tensor | None = None,
        candidate_ids: Tensor | None = None,
        embeddings: Tensor | None = None,
        hidden_states: Tensor | None = None,
        output_embeddings: Tensor | nn.Module | None = None,
        logit_softcap: float | None = None,
        generator_temperature: float | None = None,
        candidate_mask: Tensor | None = None,
        references: Sequence[str] | Sequence[Sequence[str]] | None = None,
        reference_ids: Tensor | None = None,
        reference_mask: Tensor | None = None,
    ) -> PRF:
        """Per-sample (P, R, F) ``[B]``, differentiable in the candidates. With several
        references per sample, the max of each over the references.

        Args:
            logits, probs: the generator's ``[B, L, V]`` distributions; or
            candidate_ids: ``[B, L]`` token ids (the scorer's special tokens in them, such
                as the ``[CLS]``/``[SEP]``/``[PAD]`` of ``tokenizer(texts)``, are skipped: the
                loss wraps each candidate in its own); or
            embeddings: ``[B, L, d]`` scorer input embeddings of the candidates; or
            hidden_states: ``[B, L, d_model]`` the generator's LM-head input, with
            output_embeddings: the LM head (or its weight ``[V, d_model]``), and optional
            logit_softcap, generator_temperature: then the ``[B, L, V]`` distributions are
                never materialised (:mod:`bsloss.functional.fused_expectation`). Both are
                finite numbers > 0 (default: no soft-cap, temperature 1) and go with
                ``hidden_states`` only (refused with the other inputs, which they would not
                change).
            candidate_mask: ``[B, L]``, true on real candidate tokens (default: all).
            references: one reference text, or a non-empty list of them, per sample; or
            reference_ids: ``[B, L_r]`` scorer token ids with special tokens, and
            reference_mask: ``[B, L_r]`` (default: all).

        Raises:
            TypeError, ValueError: bad input, with the argument and position named.

        >>> loss = BERTScoreLoss()  # doctest: +SKIP
        >>> loss.score(logits=logits, references=["A cat sat."]).f1  # doctest: +SKIP
        """
        prf, _ = self._score(**_arguments(locals()))
        return prf

    def score_and_cross_entropy(
        self,
        *,
        hidden_states: Tensor,
        output_embeddings: Tensor | nn.Module,
        target_ids: Tensor,
        logit_softcap: float | None = None,
        generator_temperature: float | None = None,
        candidate_mask: Tensor | None = None,
        references: Sequence[str] | Sequence[Sequence[str]] | None = None,
        reference_ids: Tensor | None = None,
        reference_mask: Tensor | None = None,
    ) -> tuple[PRF, Tensor]:
        """Per-sample (P, R, F) ``[B]`` and the per-token cross-entropy ``[B, L]`` of
        ``target_ids`` (0 where ``-100``) under the LM head's logits (soft-capped, temperature
        1), both from one chunked pass over the vocabulary: what a training step needs, with no
        ``[B, L, V]`` logits. Arguments as in :meth:`score`.

        Raises:
            TypeError, ValueError: bad input, with the argument and position named.
        """
        prf, log_likelihood = self._score(**_arguments(locals()))
        return prf, -log_likelihood

    def _score(
        self,
        *,
        references: Sequence[str] | Sequence[Sequence[str]] | None = None,
        reference_ids: Tensor | None = None,
        reference_mask: Tensor | None = None,
        **candidates,
    ) -> tuple[PRF, Tensor | None]:
        """:meth:`score` and the ``[B, L]`` log-likelihood of ``target_ids`` (or ``None``)."""
        groups = None
        if (references is None) == (reference_ids is None):
            raise ValueError("pass exactly one of references (texts) or reference_ids")
        if references is not None:
            groups = check_reference_groups(references, "references")
        encoded = self._encode_candidates(**candidates)
        log_likelihood = encoded.log_likelihood
        batch = encoded.hidden.shape[0]
        owner = list(range(batch))
        if groups is not None:
            if len(groups) != batch:
                raise ValueError(
                    f"references has {len(groups)} entries for a batch of {batch} candidates"
                )
        elif reference_ids.shape[0] != batch:
            raise ValueError(
                f"reference_ids has {reference_ids.shape[0]} rows for a batch of {batch} candidates"
            )
        if batch == 0:
            if self.center:
                # every process joins the centering all-reduces, in the same order, even with
                # nothing to add: a process that skipped them would leave the others waiting
                # (in the dtypes of the others' statistics: the scorer's output, float32 refs)
                device, width = self.encoder.device, self.encoder.hidden_size
                dtype = self.encoder.input_embeddings.weight.dtype
                no_mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
                for _ in range(1 if encoded.exact is None else 2):  # as many as _prf calls
                    batch_center(torch.zeros(0, 0, width, dtype=dtype, device=device), no_mask)
                    batch_center(torch.zeros(0, 0, width, device=device), no_mask)
            # an empty batch scores nothing; kept on the graph so that backward() still works
            empty = encoded.hidden.reshape(-1)[:0].float()
            return PRF(empty, empty, empty), log_likelihood
        if groups is not None:
            _, flat_refs, owner = flatten_groups([""] * batch, groups)
            references = self._embed_references(flat_refs)
            if references[3]:
                truncated = references[3]
                where = [
                    f"references[{i}]" if len(group) == 1 else f"references[{i}][{k}]"
                    for i, group in enumerate(groups)
                    for k, ref in enumerate(group)
                    if ref in truncated
                ]
                self._warn_truncated(where, len(flat_refs))
            references = references[:3]
        else:
            references = self.encode_reference_ids(reference_ids, reference_mask)
        index = torch.tensor(owner, device=encoded.hidden.device)
        prf = self._prf(encoded[:3], references, index, batch)
        if encoded.exact is None:
            return prf, log_likelihood
        # retokenize: the decoded text's score, with the gradient of the average bridge's
        with torch.no_grad():
            exact = self._prf(encoded.exact, references, index, batch)
        return PRF(*(e + (x - x.detach()) for e, x in zip(exact, prf, strict=True))), log_likelihood

    def _prf(self, candidates: tuple, references: tuple, index: Tensor, batch: int) -> PRF:
        """P, R, F ``[B]`` of encoded candidates against encoded references (``index``: each
        reference's candidate; the max over a candidate's references)."""
        cand_hidden, cand_mask, cand_weights = candidates
        ref_hidden, ref_mask, ref_weights = references
        if self.center:
            cand_hidden = batch_center(cand_hidden, cand_mask)
            ref_hidden = batch_center(ref_hidden, ref_mask)
        prf = bert_score(
            cand_hidden[index],
            ref_hidden,
            cand_mask[index],
            ref_mask,
            cand_weights[index],
            ref_weights,
            matching=self.matching,
        )
        if self.baseline is not None:
            prf = PRF(
                *(
                    rescale_with_baseline(x, b)
                    for x, b in zip(prf, self.baseline.to(prf.f1.device), strict=True)
                )
            )
        if len(index) == batch:
            return prf
        return PRF(*(best_over_references(x, index, batch) for x in prf))

    def forward(
        self,
        *,
        logits: Tensor | None = None,
        probs: Tensor | None = None,
        candidate_ids: Tensor | None = None,
        embeddings: Tensor | None = None,
        hidden_states: Tensor | None = None,
        output_embeddings: Tensor | nn.Module | None = None,
        target_ids: Tensor | None = None,
        logit_softcap: float | None = None,
        generator_temperature: float | None = None,
        candidate_mask: Tensor | None = None,
        references: Sequence[str] | Sequence[Sequence[str]] | None = None,
        reference_ids: Tensor | None = None,
        reference_mask: Tensor | None = None,
    ) -> Tensor | LossAndCrossEntropy:
        """``1 - score`` (the ``target``), reduced by ``reduction``; arguments as in
        :meth:`score`.

        With ``hidden_states`` and ``target_ids`` ``[B, L]`` (``-100`` ignored), a
        :class:`LossAndCrossEntropy` ``(loss, cross_entropy)`` instead: the CE of the targets
        under the LM head's logits (soft-capped, temperature 1) comes from the same chunked
        pass, so a training step needs no ``[B, L, V]`` logits at all."""
        prf, log_likelihood = self._score(**_arguments(locals()))
        loss = self._reduce(1 - getattr(prf, self.target))
        if log_likelihood is None:
            return loss
        if self.reduction == "mean":
            count = (target_ids != IGNORE_INDEX).sum().clamp_min(1)
            return LossAndCrossEntropy(loss, -log_likelihood.sum() / count)
        per_token = -log_likelihood
        return LossAndCrossEntropy(loss, per_token.sum() if self.reduction == "sum" else per_token)

    def _reduce(self, loss: Tensor) -> Tensor:
        if self.reduction == "mean" and loss.numel() == 0:
            return loss.sum()  # an empty batch: 0, not the NaN of a mean over nothing
        if self.reduction == "mean":
            return loss.mean()
        if self.reduction == "sum":
            return loss.sum()
        return loss
