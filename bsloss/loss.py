"""Differentiable BERTScore losses.

``BERTScoreLoss`` composes parts chosen once when it is built: the candidates, whichever their
source (distributions, the LM head's input, token ids, embeddings), become the frozen scorer's
hidden states (:class:`~bsloss.candidate_encoding.CandidateEncoder`, through the bridge mode of
:mod:`bsloss.bridge` when vocabularies differ and the transforms of
:mod:`bsloss.candidate_transforms`); the references are encoded and cached
(:class:`~bsloss.scorer.reference_cache.ReferenceEmbedder`); and
:func:`bsloss.functional.bert_score` (the same function as the evaluation metric) matches the
two with the chosen :class:`~bsloss.functional.Matching`. This module holds the validation at
the public boundary, the multiple-reference maximum, baseline rescaling and the reduction.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.torch_version import TorchVersion

from bsloss._warnings import warn_user
from bsloss.baseline import load_baseline
from bsloss.bridge import (
    Bridge,
    BridgeMode,
    Retokenizer,
    SharedVocabulary,
    VocabularyBridge,
    _check_tokenizer,
    check_bridge_mode,
)
from bsloss.candidate_encoding import CandidateEncoder, EncodedCandidates
from bsloss.candidate_inputs import (
    CandidateInput,
    Embeddings,
    LMHeadInputs,
    from_keywords,
)
from bsloss.candidate_transforms import (
    CandidateOptions,
    CandidateTransform,
    resolve_candidate_transforms,
)
from bsloss.functional import (
    PRF,
    batch_center,
    bert_score,
    rescale_with_baseline,
)
from bsloss.functional.fused_expectation import (
    IGNORE_INDEX,
)
from bsloss.functional.matching import Matching, resolve_matching
from bsloss.functional.reduction import best_of_owned
from bsloss.inputs import (
    as_token_ids,
    check_device,
    check_flag,
    check_reference_groups,
    check_tensor,
    check_texts,
    flatten_groups,
    position_of_first,
)
from bsloss.scorer.batching import pad_embedded, to_device
from bsloss.scorer.checkpointing import (
    Checkpointing,
    check_checkpointing,
    checkpointing_mode,
    prepare_checkpointing,
)
from bsloss.scorer.encoder import ScorerEncoder
from bsloss.scorer.reference_cache import ReferenceCache, ReferenceEmbedder, Tokenized
from bsloss.scorer.weights import IdfSpec, as_idf_spec, weight_table

__all__ = ["BERTScoreLoss", "LossAndCrossEntropy"]

_TARGETS = ("precision", "recall", "f1")


class LossAndCrossEntropy(NamedTuple):
    """What :class:`BERTScoreLoss` returns when called with ``target_ids``: the BERTScore loss and
    the cross-entropy of the targets, both from the same chunked pass over the LM head (reduced
    by the loss's ``reduction``: token mean, token sum, or ``[B, L]`` with 0 at ignored ids)."""

    loss: Tensor
    cross_entropy: Tensor


def _float32(hidden: Tensor) -> Tensor:
    return hidden.float()


class _TokenizedAhead(dict):
    """The references' tokens, tokenised by the loss before the embedder encodes them, so that
    the loss sees each new reference's ids on the host (their weights: no read of the device).
    Filled ahead with the texts not in the cache; a text the embedder encodes all the same
    (the cache started over: a new device or autocast) is tokenised when it is asked for."""

    def __init__(self, embedder: ReferenceEmbedder, texts: list[str], window: bool):
        super().__init__(embedder.tokenize(texts, window) if texts else {})
        self._embedder, self._window = embedder, window

    def __missing__(self, text: str) -> tuple[list[int], bool]:
        self.update(self._embedder.tokenize([text], self._window))
        return self[text]


# BERTScoreLoss's keywords folded into the 13 it takes, each with its replacement
_DEPRECATED_INIT = {
    "encoder": "model=encoder",
    "temperature": "matching=Softmax(temperature=...) (or LogSumExp(...), Sinkhorn(...))",
    "sinkhorn_iterations": "matching=Sinkhorn(temperature=..., iterations=...)",
    "baseline_path": "rescale_with_baseline=path",
    "generator_tokenizer": "bridge=Bridge(tokenizer) (or bridge=tokenizer)",
    "bridge_cache_dir": "bridge=Bridge(tokenizer, cache_dir=...)",
    "bridge_mode": "bridge=Bridge(tokenizer, mode=...)",
    "top_k": "candidate_transforms=TopK(k)",
    "straight_through": "candidate_transforms=StraightThrough()",
    "gumbel_temperature": "candidate_transforms=Gumbel(temperature)",
    "device": "model=ScorerEncoder.from_pretrained(name, device=device), or .to(device)",
}


@dataclass(frozen=True)
class _DeprecatedOptions:
    """The deprecated keywords of :class:`BERTScoreLoss` (their defaults when not given)."""

    encoder: ScorerEncoder | None = None
    temperature: float | None = None
    sinkhorn_iterations: int | None = None
    baseline_path: str | None = None
    generator_tokenizer: object = None
    bridge_cache_dir: str | None = None
    bridge_mode: str | None = None
    top_k: int | None = None
    straight_through: bool = False
    gumbel_temperature: float | None = None
    device: str | torch.device | None = None

    def bridge(self, bridge: object) -> Bridge | None:
        """``bridge=`` with the deprecated bridge keywords, as one :class:`Bridge`."""
        if (self.generator_tokenizer, self.bridge_cache_dir, self.bridge_mode) == (None,) * 3:
            return Bridge.of(bridge)
        check_bridge_mode(self.bridge_mode)
        if bridge is not None and not isinstance(bridge, VocabularyBridge):
            raise TypeError(
                "with generator_tokenizer, bridge_mode or bridge_cache_dir, bridge must be a "
                "VocabularyBridge; pass bridge=Bridge(tokenizer, mode=..., cache_dir=...) alone"
            )
        if self.generator_tokenizer is None and bridge is None:
            return None
        if self.generator_tokenizer is not None:  # named as the caller passed it
            _check_tokenizer(self.generator_tokenizer, "generator_tokenizer")
        return Bridge(self.generator_tokenizer, self.bridge_mode, self.bridge_cache_dir, bridge)


def _deprecated_options(keywords: dict) -> _DeprecatedOptions:
    """The deprecated keywords given, each warned of with its replacement."""
    for name in keywords:
        if name not in _DEPRECATED_INIT:
            raise TypeError(f"BERTScoreLoss() got an unexpected keyword argument {name!r}")
        warn_user(
            f"BERTScoreLoss({name}=...) is deprecated: pass {_DEPRECATED_INIT[name]} (see the "
            "migration table in CHANGELOG.md)",
            DeprecationWarning,
        )
    return _DeprecatedOptions(**keywords)


_SCORER = "encoder."
# the oldest torch whose Dynamo runs the compiled loss (2.6 fails inside the fused pass)
COMPILE_NEEDS_TORCH = (2, 8)


def _drop_scorer_state(module: nn.Module, state_dict: dict, prefix: str, metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + _SCORER)]:
        del state_dict[key]


def _keep_scorer_state(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A state dict saved without the scorer loads with the scorer left as it is."""
    for key, value in module.encoder.state_dict(prefix=prefix + _SCORER, keep_vars=True).items():
        state_dict.setdefault(key, value)


def _entry_point(method: Callable[..., Any]) -> Callable[..., Any]:
    """A public call of the loss, which Dynamo skips when it traces a caller
    (``torch.compile(loss)``, a compiled model or step that calls it): the call's reference
    texts would go into the caller's graph, which would compile again for every new batch of
    them. The loss's own compiled steps (:meth:`BERTScoreLoss.compile`) still run compiled."""
    return torch.compiler.disable(method)


class BERTScoreLoss(nn.Module):
    """``1 - BERTScore`` of candidates (generator distributions, token ids or embeddings)
    against references, differentiable in the candidates.

    Args:
        model, num_layers: the scorer: a model name (``None``: embedded all-MiniLM-L6-v2) and
            its layer, or a :class:`~bsloss.scorer.encoder.ScorerEncoder`.
        matching: a :class:`~bsloss.functional.Matching` object (``Hard()``: gradient
            through the argmax cells; ``Softmax(temperature=...)``, ``LogSumExp(...)``,
            ``Sinkhorn(temperature=..., iterations=...)``, or your own subclass), or its
            string shorthand ``"hard"``, ``"softmax"``, ``"logsumexp"`` or ``"sinkhorn"``
            (default temperature 0.05). Stored resolved, as an object, in ``loss.matching``.
        target: which score the loss is ``1 -`` of: ``"f1"``, ``"precision"`` or ``"recall"``.
            F is bert_score's harmonic mean where P and R are both positive, ``min(P, R)``
            elsewhere (the harmonic mean's pole at ``P = -R``, which the soft matchings
            reach, would make the loss unbounded below; docs/loss.md).
        idf: ``False`` (or ``None``, ``0``, as the metric takes them), a list of sentences, or
            a ``{scorer_token_id: weight}`` dict (``True`` and ``1``, the metric's idf from each
            call's references, are refused: pass the corpus). A candidate whose references'
            tokens all weigh 0 (each in every idf sentence, or only special tokens) scores 0
            with no gradient; the loss warns of it once.
        center: subtract the batch mean of the candidates' and of the references' token vectors
            (Chen et al., 2020), over all processes under torch.distributed. A bool (numpy's
            and 0/1 taken as one; any other value, a string included, is refused).
        rescale_with_baseline: baseline rescaling of the score: ``True`` (the packaged baseline
            of the scorer) or the path of a baseline file (a bool as ``center`` takes one).
        bridge: when the generator's vocabulary is not the scorer's, a
            :class:`~bsloss.bridge.Bridge` ``(tokenizer, mode=None, cache_dir=None,
            vocabulary=None)``, or its shorthand: the generator's tokenizer, or a built
            :class:`~bsloss.bridge.VocabularyBridge`. Its mode: ``"retokenize"`` (exact: the
            decoded candidate text is scored with the scorer's own tokenisation; the gradient
            is the average mode's score's) or ``"average"`` (one averaged scorer position per
            generator token); see :mod:`bsloss.bridge`. ``None``: ``"retokenize"`` with a
            tokenizer, ``"average"`` for a ``VocabularyBridge`` alone. After a retokenize call,
            ``loss.last_texts`` holds the decoded candidates that were scored.
        candidate_transforms: how the candidates' distributions become token weights
            (:mod:`bsloss.candidate_transforms`): :class:`~bsloss.TopK` ``(k)``,
            :class:`~bsloss.StraightThrough` ``()``, :class:`~bsloss.Gumbel` ``(temperature)``,
            one object or several. Stored resolved in ``loss.candidates``. ``TopK(1)`` is
            refused where it is built: the renormalised top-1 weight is always 1, so its gradient
            is exactly zero.
        gradient_checkpointing: recompute the scorer's layer activations in the backward pass:
            ``True``, ``False``, or ``"auto"`` (default): only for the calls whose stored
            activations would exceed 1 GiB (a large scorer or long inputs), where it saves
            memory; below that it would cost a scorer forward pass for nothing
            (:mod:`bsloss.scorer.checkpointing`). The mode is this loss's: it applies to its
            own calls only, so other losses (and metrics) sharing the scorer keep theirs.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``. An empty batch (``B = 0``) gives the
            loss 0 (with a zero gradient) for ``"mean"`` and ``"sum"``.
        long_inputs: reference texts longer than the scorer's maximum: ``"truncate"`` (with a
            warning naming them) or ``"window"`` (encoded whole with overlapping windows, as
            :class:`~bsloss.BERTScorer` does). Candidates with more real tokens than the scorer
            takes are truncated with a warning (the tokens beyond get no score and no gradient).
        reference_cache_size: reference texts whose hidden states are kept across calls, on the
            scorer's device, least recently used evicted first (``0``: none); :meth:`clear_cache`
            empties it. It is bounded in bytes too: ``loss.reference_cache.max_bytes``.
        deprecated: the keywords these replace (``encoder``, ``temperature``,
            ``sinkhorn_iterations``, ``baseline_path``, ``generator_tokenizer``, ``bridge_mode``,
            ``bridge_cache_dir``, ``top_k``, ``straight_through``, ``gumbel_temperature``,
            ``device``) still work, with a ``DeprecationWarning`` naming the replacement.

    The frozen scorer is not part of the loss's ``state_dict()`` (a model holding the loss does
    not save it in each checkpoint); such a state dict loads strictly, the scorer left as it is.

    Calling it (:meth:`forward`) with the candidates, one value of :mod:`bsloss.candidate_inputs`
    (a bare tensor: logits), and the references returns ``1 - score`` of ``target``, reduced by
    ``reduction``; :meth:`score` returns the per-sample ``PRF``; :meth:`loss_and_cross_entropy`
    and :meth:`score_and_cross_entropy` add the targets' cross-entropy from the LM head's pass.

    Raises:
        ValueError, TypeError: an argument of the wrong type or out of range, named.
        FileNotFoundError: no baseline file for ``rescale_with_baseline``.

    >>> import torch, bsloss
    >>> loss_fn = bsloss.BERTScoreLoss(matching=bsloss.Softmax(temperature=0.05))
    >>> logits = torch.randn(2, 6, 30522, requires_grad=True)  # a generator's [B, L, V] output
    >>> loss = loss_fn(logits, ["a cat sat", "the dog ran"])
    >>> loss.backward(); logits.grad.shape
    torch.Size([2, 6, 30522])

    The matching as an object (parameters validated where it is built):

    >>> from bsloss import Sinkhorn
    >>> loss_fn = bsloss.BERTScoreLoss(matching=Sinkhorn(temperature=0.1, iterations=2))
    >>> loss_fn.matching
    Sinkhorn(temperature=0.1, iterations=2)
    >>> loss_fn(bsloss.Logits(logits), ["a cat sat", "the dog ran"]).shape
    torch.Size([])

    Candidate-distribution transforms as objects:

    >>> from bsloss import StraightThrough, TopK
    >>> loss_fn = bsloss.BERTScoreLoss(candidate_transforms=[TopK(32), StraightThrough()])
    >>> loss_fn.candidates
    CandidateOptions(top_k=32, straight_through=True, gumbel_temperature=None)
    """

    def __init__(
        self,
        model: str | ScorerEncoder | None = None,
        num_layers: int | None = None,
        *,
        matching: str | Matching = "softmax",
        target: str = "f1",
        idf: IdfSpec | None = False,
        center: bool = False,
        rescale_with_baseline: bool | str | os.PathLike = False,
        bridge: Bridge | VocabularyBridge | object | None = None,
        candidate_transforms: CandidateTransform | Sequence[CandidateTransform] | None = None,
        gradient_checkpointing: Checkpointing = "auto",
        reduction: str = "mean",
        long_inputs: str = "truncate",
        reference_cache_size: int = 10_000,
        **deprecated,
    ):
        super().__init__()
        old = _deprecated_options(deprecated)
        matching = resolve_matching(matching, old.temperature, old.sinkhorn_iterations)
        if target not in _TARGETS:
            raise ValueError(f"target must be one of {_TARGETS}, got {target!r}")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        candidates = resolve_candidate_transforms(
            candidate_transforms,
            top_k=old.top_k,
            straight_through=old.straight_through,
            gumbel_temperature=old.gumbel_temperature,
        )
        if long_inputs not in ("truncate", "window"):
            raise ValueError(f"long_inputs must be 'truncate' or 'window', got {long_inputs!r}")
        center = check_flag(center, "center")
        if not isinstance(rescale_with_baseline, (str, os.PathLike)):
            try:
                rescale_with_baseline = check_flag(rescale_with_baseline, "rescale_with_baseline")
            except TypeError:
                raise TypeError(
                    "rescale_with_baseline must be a bool (or 0, 1), a path or a string, got "
                    f"{rescale_with_baseline!r}"
                ) from None
        self.long_inputs = long_inputs
        encoder = old.encoder
        if isinstance(model, ScorerEncoder):
            model, encoder = None, model
        gradient_checkpointing = check_checkpointing(gradient_checkpointing)
        self.encoder = encoder or ScorerEncoder.from_pretrained(model, num_layers, old.device)
        self.matching = matching
        self.target, self.center, self.reduction = target, center, reduction
        spec = old.bridge(bridge)
        self.bridge: VocabularyBridge | None = None
        # how the candidates reach the scorer; the modes' differences live in bsloss.bridge
        self.bridging: BridgeMode = SharedVocabulary()
        if spec is not None:
            self.bridge, self.bridging = spec.resolve(self.encoder)
        given_idf, idf = idf, as_idf_spec(idf)  # None, 0 -> False and 1 -> True, as the metric
        if idf is True:
            raise ValueError(
                f"idf={given_idf!r} (from each call's references) is for BERTScorer; pass the "
                "reference corpus as idf=[...] to fix the loss's weights"
            )
        # the first half of the loss: candidates of any source to scorer hidden states
        self.candidate_encoder = CandidateEncoder(
            self.encoder, self.bridging, candidates, idf=idf is not False
        )
        # the tensor steps compiled by compile(): {"encode": ..., "prf": ...}
        self._compiled_steps: dict[str, Callable[..., Any]] | None = None
        self._idf = idf
        self.register_buffer("scorer_weights", self._weight_table(), persistent=False)
        self.baseline: Tensor | None = None
        # on the host too: the weightless warning gives the rescaled value without a read
        self._baseline_values: list[float] | None = None
        baseline_path = old.baseline_path
        if isinstance(rescale_with_baseline, (str, os.PathLike)):
            baseline_path = rescale_with_baseline
        if rescale_with_baseline:
            baseline = load_baseline(baseline_path, self.encoder.name, self.encoder.num_layers)
            self._baseline_values = baseline.float().tolist()
            self.baseline = baseline.float().to(self.encoder.device)
        # raw float32 hidden states under the caller's autocast (part of the cache key)
        self._references = ReferenceEmbedder(
            self.encoder,
            reference_cache_size,
            transform=_float32,
            autocast_dtype="ambient",
            inference_mode=False,
        )
        self._warned_empty_references = False  # once per loss: a training loop calls often
        self._warned_weightless = False
        # the cached references found weightless when they were tokenised (a cached text is not
        # tokenised again); pruned to the cache's texts, cleared once the loss has warned
        self._weightless_texts: set[str] = set()
        # The frozen scorer is not the loss's state: a model holding the loss as a submodule
        # would otherwise save the scorer (87 MB for MiniLM) in every checkpoint.
        self._register_state_dict_hook(_drop_scorer_state)
        self._register_load_state_dict_pre_hook(_keep_scorer_state, with_module=True)
        # the loss's own mode, applied to its own scorer calls only (_checkpointing): a scorer
        # shared with other losses or a metric keeps theirs. Last, once nothing can fail but
        # this check: a refused loss leaves the scorer as it was
        self.gradient_checkpointing: Checkpointing = prepare_checkpointing(
            self.encoder.model, gradient_checkpointing
        )

    def _checkpointing(self) -> contextlib.AbstractContextManager[None]:
        """The scorer's layers checkpoint as this loss's ``gradient_checkpointing`` says, for
        the duration of the block."""
        return checkpointing_mode(self.encoder.model, self.gradient_checkpointing)

    # ------------------------------------------------------------------ placement
    def _weight_table(self) -> Tensor:
        """The ``[V]`` importance weights of the scorer's tokens, on its device from the start
        (a loss built around a CUDA encoder works with no ``.to()``); with which tokens weigh
        0, on the host: a reference whose tokens all do scores 0 with no gradient (warned once:
        :meth:`_warn_weightless`), found from its host token ids, no device read."""
        vocab = self.encoder.input_embeddings.num_embeddings
        truncate = self.long_inputs == "truncate"
        weights = weight_table(self.encoder, self._idf, vocab, truncate=truncate).float()
        self._zero_weight = (weights == 0).numpy()
        return weights.to(self.encoder.device)

    def _placed(self) -> Tensor:
        """The importance-weight table on the scorer's device. The loss follows its encoder:
        ``loss.to(device)`` moves both, and an encoder moved on its own (``loss.encoder.to``,
        a trainer placing the scorer) takes the table along at the next call; one whose input
        embeddings were resized (tokens added to its tokenizer) gets a table of its new size
        (audit h25: the old one failed inside the candidates' table)."""
        if self.scorer_weights.shape[0] != self.encoder.input_embeddings.num_embeddings:
            self.scorer_weights = self._weight_table()
        if self.scorer_weights.device != self.encoder.device:
            self.scorer_weights = self.scorer_weights.to(self.encoder.device)
        return self.scorer_weights

    # ------------------------------------------------------------------ caches
    @property
    def reference_cache(self) -> ReferenceCache:
        """The cached reference hidden states (text -> (hidden ``[L, d]``, ids ``[L]``))."""
        return self._references.cache

    def clear_cache(self) -> None:
        """Forget the cached reference hidden states and generator embedding tables."""
        self._references.cache.clear()
        self.candidate_encoder.clear_cache()

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
        return self.candidate_encoder.generator_vocab_size

    @property
    def candidates(self) -> CandidateOptions:
        """The resolved candidate transforms (:mod:`bsloss.candidate_transforms`)."""
        return self.candidate_encoder.candidates

    @property
    def last_texts(self) -> list[str]:
        """The decoded candidates the last ``bridge_mode="retokenize"`` call scored."""
        return self.candidate_encoder.last_texts

    def _generator_table(self) -> Tensor:
        """``[V_gen, d + 1]``: the generator tokens' scorer input embeddings and weights."""
        return self.candidate_encoder.generator_table(self._placed())

    def encode_candidates(
        self, candidates: CandidateInput | Tensor | None = None, candidate_mask=None, **deprecated
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Scorer hidden states ``[B, L', d]``, real-token mask and importance weights of the
        candidates (as in :meth:`score`): the encoding the gradient flows through (in
        ``bridge_mode="retokenize"``, the average bridge's; the decoded text's own encoding
        gives the value, see :mod:`bsloss.bridge`).

        Raises:
            TypeError, ValueError: not exactly one candidate input, a non-tensor, a wrong dtype,
                shape or device, NaN/Inf, ids outside the vocabulary (all named).
        """
        candidates = from_keywords(candidates, deprecated, "encode_candidates")
        with self._checkpointing():
            return self.candidate_encoder.encode(self._placed(), candidates, candidate_mask)[:3]

    # ------------------------------------------------------------------ references
    def _embed_references(
        self, texts: list[str]
    ) -> tuple[Tensor, Tensor, Tensor, set[str], set[str], list[bool]]:
        """Padded hidden states, mask and weights of ``texts``, the texts truncated, those
        whose tokens all weigh 0 (looked for until the loss has warned of them), and which
        texts are empty (:meth:`_special_count`; known on the host)."""
        window = self.long_inputs == "window"
        tokenized = None
        if not self._warned_weightless:
            # the embedder tokenises the texts it has not cached; done here instead, the ids
            # are on the host for the check (no extra tokenisation, no read of the device)
            cache = self._references.cache
            new = [t for t in dict.fromkeys(texts) if t not in cache]
            tokenized = _TokenizedAhead(self._references, new, window)
        # no progress bar: a training step's references are one small batch, and a bar per step
        # would flicker over the trainer's own bar on a terminal
        embedded, truncated = self._references.embed(
            texts,
            cache_texts=texts,
            window=window,
            batch_size=64,
            progress=False,
            tokenized=tokenized,
        )
        weightless: set[str] = set()
        if tokenized is not None:
            weightless = self._weightless_among(texts, tokenized)
        hidden, mask, weights = pad_embedded([embedded[t] for t in texts], self._placed())
        # as the metric: empty or whitespace-only, or nothing the tokenizer keeps (the length
        # of the host-side ids: no read)
        specials = self._special_count()
        empty = [not t.strip() or embedded[t][1].shape[0] <= specials for t in texts]
        return hidden, mask, weights, truncated, weightless, empty

    def _special_count(self) -> int:
        """The special tokens the scorer's tokenizer wraps a text in (``[CLS]``, ``[SEP]``):
        a sentence of no more tokens than these is empty, and its pair scores 0, rescaled or
        not (as in the metric)."""
        tokens = self.encoder.tokenization
        return len(tokens.prefix_ids) + len(tokens.suffix_ids)

    def _weightless_among(self, texts: list[str], tokenized: Tokenized) -> set[str]:
        """The texts whose tokens all weigh 0: those just tokenised, by their host ids, and the
        cached ones found so when they were tokenised."""
        known = self._weightless_texts
        known.update(text for text, (ids, _) in tokenized.items() if self._zero_weight[ids].all())
        found = {text for text in texts if text in known}
        if len(known) > self.reference_cache.max_size:
            # only the cached ones are not tokenised again: the others are checked when met
            known.intersection_update(self.reference_cache)
        return found

    @_entry_point
    def encode_references(self, texts: Sequence[str]) -> tuple[Tensor, Tensor, Tensor]:
        """Padded hidden states ``[N, L, d]``, mask and importance weights of reference texts,
        each encoded once and cached (:attr:`reference_cache`).

        Raises:
            TypeError, ValueError: ``texts`` is not a list of valid strings (position named).
        """
        texts = check_texts(texts, "texts")
        if not texts:  # an empty batch, which the loss takes too: empty tensors of its shapes
            table = self._placed()
            dtype = self.encoder.input_embeddings.weight.dtype
            hidden = table.new_zeros(0, 0, self.encoder.hidden_size, dtype=dtype)
            return hidden, table.new_zeros(0, 0, dtype=torch.bool), table.new_zeros(0, 0)
        hidden, mask, weights, truncated, _, _ = self._embed_references(texts)
        if truncated:
            where = [f"texts[{i}]" for i, t in enumerate(texts) if t in truncated]
            self._warn_truncated(where, len(texts))
        return hidden, mask, weights

    def _warn_empty_references(self, where: list[str], total: int) -> None:
        """Warn (once per loss) of candidates whose references are all empty (``where``
        names them): their pairs score 0, with no gradient, rescaled or not (the metric warns
        too)."""
        if self._warned_empty_references or not where:
            return
        self._warned_empty_references = True
        shown = ", ".join(where[:10]) + (", ..." if len(where) > 10 else "")
        warn_user(
            f"{len(where)} of {total} candidates have only empty or whitespace-only "
            f"references ({shown}): their pairs score 0, with no gradient, also with "
            "rescale_with_baseline (an empty completion in the data? a reference with nothing "
            "the tokenizer keeps, such as a zero-width space, counts as empty); this loss warns "
            "once"
        )

    def _warn_weightless(self, where: list[str], total: int) -> None:
        """Warn (once per loss) of candidates whose references' tokens all weigh 0 (``where``
        names them): their pairs score 0, with no gradient, as the metric warns; with a
        baseline ``(0 - b) / (1 - b)``, as the metric (and bert_score) rescale them too."""
        if self._warned_weightless or not where:
            return
        self._warned_weightless = True
        self._weightless_texts.clear()
        shown = ", ".join(where[:10]) + (", ..." if len(where) > 10 else "")
        score = "score 0"
        if self._baseline_values is not None:
            # rescaled like every pair, as the metric and bert_score do (an empty text's pair
            # is not: it stays 0)
            p, r, f = (-b / (1 - b) for b in self._baseline_values)
            score = f"score (0 - b) / (1 - b) (P {p:.3f}, R {r:.3f}, F {f:.3f}; 0 before rescaling)"
        warn_user(
            f"{len(where)} of {total} candidates {score}, with no gradient, because the weights "
            f"of their references' tokens sum to 0 ({shown}): they are all special tokens, as "
            'in the literal text "[SEP]"; or, with idf, each is in every idf sentence; this '
            "loss warns once"
        )

    def _warn_truncated(self, where: list[str], total: int) -> None:
        shown = ", ".join(where[:10]) + (", ..." if len(where) > 10 else "")
        warn_user(self.encoder.tokenization.truncation_message(len(where), total, shown))

    @torch.no_grad()
    def encode_reference_ids(
        self, reference_ids: Tensor, reference_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Hidden states ``[B, L, d]``, mask and importance weights of reference token ids
        (special tokens included, as the scorer's tokenizer adds them).

        Raises:
            TypeError, ValueError: a wrong dtype, shape or device, no columns (``[B, 0]``), ids
                outside the scorer's vocabulary, or a row with more tokens than the scorer
                takes (all named).
        """
        return self._encode_reference_ids(reference_ids, reference_mask)[:3]

    @torch.no_grad()
    def _encode_reference_ids(
        self, reference_ids: Tensor, reference_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, list[int], list[int], Tensor]:
        """:meth:`encode_reference_ids`, the rows whose weights all vanish and the empty rows
        (no token besides the special ones: read with the ids' range check, no read of the
        device of its own), and the empty rows as a ``[B]`` bool tensor on the device."""
        reference_ids = _as_reference_ids(reference_ids)
        if reference_ids.shape[1] == 0 and reference_ids.shape[0] > 0:
            # the scorer cannot run on a sequence of length 0 (it failed inside its attention)
            raise ValueError(
                f"reference_ids has no columns ({list(reference_ids.shape)}); each row needs at "
                "least the scorer's special tokens, as its tokenizer adds them (an empty "
                "reference text: references=[''] scores 0)"
            )
        if reference_mask is None:
            reference_mask = torch.ones_like(reference_ids, dtype=torch.bool)
        check_tensor(reference_mask, "reference_mask", "mask")
        if reference_mask.shape != reference_ids.shape:
            raise ValueError(
                f"reference_mask must have shape {list(reference_ids.shape)}, got "
                f"{list(reference_mask.shape)}"
            )
        check_device(reference_ids, "reference_ids", self.encoder.device, "the scorer")
        mask = reference_mask.to(reference_ids.device).bool()
        vocab = self.encoder.input_embeddings.num_embeddings
        bad = ((reference_ids < 0) | (reference_ids >= vocab)) & mask
        weights = self._placed()[reference_ids.clamp(0, vocab - 1)] * mask
        # a row of no more tokens than the special ones is empty, as the same text's
        empty = mask.sum(dim=1) <= self._special_count()
        # one read for all: the range check, the rows whose weights all vanish (their
        # candidates score 0 with no gradient: _warn_weightless) and the empty rows
        flags = torch.cat([bad.any()[None], weights.sum(dim=1) == 0, empty]).tolist()
        if flags[0]:
            raise ValueError(
                f"reference_ids has ids outside the scorer's vocabulary [0, {vocab}) at "
                f"reference_ids{position_of_first(bad)}"
            )
        rows = len(empty)
        zero, is_empty = flags[1 : 1 + rows], flags[1 + rows :]
        empty_rows = [row for row in range(rows) if is_empty[row]]
        # an empty row weighs nothing too: it has its own warning
        weightless = [row for row in range(rows) if zero[row] and not is_empty[row]]
        # each row's tokens packed to the front, in order, as a text's come: the scorer numbers
        # positions 0, 1, ... whatever the mask, so a left-padded row (padding_side="left", as
        # decoder-only pipelines set it) was encoded at shifted positions (a reference's loss
        # 0.4369 where its text gives 0.3817), and the length check below saw its last column
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
        reference_ids, mask, weights = (t.gather(1, order) for t in (reference_ids, mask, weights))
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
            weights = weights[:, :width]
        ids = reference_ids.clamp(0, vocab - 1)
        hidden = self.encoder(input_ids=ids, attention_mask=mask.long()).float()
        return hidden, mask, weights, weightless, empty_rows, empty

    # ------------------------------------------------------------------ scoring
    @_entry_point
    def score(
        self,
        candidates: CandidateInput | Tensor | None = None,
        references: Sequence[str] | Sequence[Sequence[str]] | None = None,
        *,
        candidate_mask: Tensor | None = None,
        reference_ids: Tensor | None = None,
        reference_mask: Tensor | None = None,
        **deprecated,
    ) -> PRF:
        """Per-sample (P, R, F) ``[B]``, differentiable in the candidates. With several
        references per sample, the max of each over the references.

        Args:
            candidates: one value of :mod:`bsloss.candidate_inputs`: ``Logits`` or
                ``Probabilities`` ``[B, L, V]`` (a bare tensor is logits), ``TokenIds``
                ``[B, L]``, ``Embeddings`` ``[B, L, d]`` (the scorer's
                hidden states, with their weights), or
                ``LMHeadInputs(hidden_states, head, softcap=, temperature=)``
                (the ``[B, L, V]`` distributions are never materialised:
                :mod:`bsloss.functional.fused_expectation`). A position whose token (a
                distribution's most probable one) is special, such as the
                ``[CLS]``/``[SEP]``/``[PAD]`` of ``tokenizer(texts)``, is skipped: the loss
                wraps each candidate in its own. Ties go to the smallest id, so an exactly
                flat or tied distribution counts as its smallest tied id, a special token in
                most vocabularies (``[PAD]``/``<pad>`` at id 0). Its position is skipped and
                gives no gradient: a zero-initialised LM head gets none from this term
                (initialise it with nonzero weights).
            references: one reference text, or a non-empty list of them, per sample; or
            reference_ids: ``[B, L_r]`` scorer token ids with special tokens, and
            reference_mask: ``[B, L_r]`` (default: all).
            candidate_mask: ``[B, L]``, true on real candidate tokens (default: all).
            deprecated: ``logits=``, ``probs=``, ``candidate_ids=``, ``embeddings=``,
                ``hidden_states=`` with ``output_embeddings=``, ``logit_softcap=``,
                ``generator_temperature=`` (a ``DeprecationWarning`` names the replacement).

        Raises:
            TypeError, ValueError: bad input, with the argument and position named.

        >>> import torch, bsloss
        >>> loss = bsloss.BERTScoreLoss()
        >>> probs = torch.softmax(torch.randn(1, 4, 30522), dim=-1)
        >>> loss.score(bsloss.Probabilities(probs), ["A cat sat."]).f1.shape
        torch.Size([1])
        """
        candidates = from_keywords(candidates, deprecated, "score")
        prf, _ = self._score(
            candidates, candidate_mask, None, references, reference_ids, reference_mask
        )
        return prf

    @_entry_point
    def score_and_cross_entropy(
        self,
        candidates: LMHeadInputs | None = None,
        target_ids: Tensor | None = None,
        references: Sequence[str] | Sequence[Sequence[str]] | None = None,
        *,
        candidate_mask: Tensor | None = None,
        reference_ids: Tensor | None = None,
        reference_mask: Tensor | None = None,
        **deprecated,
    ) -> tuple[PRF, Tensor]:
        """Per-sample (P, R, F) ``[B]`` and the per-token cross-entropy ``[B, L]`` of
        ``target_ids`` (0 where ``-100``) under the LM head's logits (soft-capped, temperature
        1), both from one chunked pass over the vocabulary: what a training step needs, with no
        ``[B, L, V]`` logits. ``candidates`` is an
        :class:`~bsloss.candidate_inputs.LMHeadInputs`; the other arguments as in :meth:`score`.

        Raises:
            TypeError, ValueError: bad input, with the argument and position named.
        """
        candidates = from_keywords(candidates, deprecated, "score_and_cross_entropy")
        if target_ids is None:
            raise ValueError("target_ids ([B, L], -100 ignored) is required")
        prf, log_likelihood = self._score(
            candidates, candidate_mask, target_ids, references, reference_ids, reference_mask
        )
        return prf, -log_likelihood

    def _score(
        self,
        candidates: CandidateInput,
        candidate_mask: Tensor | None,
        target_ids: Tensor | None,
        references: Sequence[str] | Sequence[Sequence[str]] | None,
        reference_ids: Tensor | None,
        reference_mask: Tensor | None,
    ) -> tuple[PRF, Tensor | None]:
        """:meth:`score` and the ``[B, L]`` log-likelihood of ``target_ids`` (or ``None``)."""
        groups = None
        if (references is None) == (reference_ids is None):
            raise ValueError("pass exactly one of references (texts) or reference_ids")
        if references is not None:
            if reference_mask is not None:
                raise ValueError(
                    "reference_mask goes with reference_ids; reference texts (references=) "
                    "are tokenised by the scorer, which makes their mask"
                )
            groups = check_reference_groups(references, "references")
        else:  # its shape before its rows are counted (a [L] row is not L candidates)
            reference_ids = _as_reference_ids(reference_ids)
        with self._checkpointing():
            encoded = self._step("encode")(self, candidates, candidate_mask, target_ids)
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
            # an empty batch scores nothing; kept on the graph so that backward() still works
            empty = encoded.hidden.reshape(-1)[:0].float()
            if self.center:
                empty = empty + 0.0 * self._join_centering(encoded)
            return PRF(empty, empty, empty), log_likelihood
        if groups is not None:
            _, flat_refs, owner = flatten_groups([""] * batch, groups)
            references = self._embed_references(flat_refs)
            is_empty = dict(zip(flat_refs, references[5], strict=True))
            self._warn_empty_references(
                [
                    f"references[{i}]"
                    for i, group in enumerate(groups)
                    if all(is_empty[ref] for ref in group)
                ],
                batch,
            )
            if references[3]:
                truncated = references[3]
                where = [
                    f"references[{i}]" if len(group) == 1 else f"references[{i}][{k}]"
                    for i, group in enumerate(groups)
                    for k, ref in enumerate(group)
                    if ref in truncated
                ]
                self._warn_truncated(where, len(flat_refs))
            if references[4]:
                # a candidate with one reference that weighs something still trains; one with
                # only empty references was warned of as such
                weightless = references[4]
                where = [
                    f"references[{i}]"
                    for i, group in enumerate(groups)
                    if all(ref in weightless for ref in group)
                    and not all(is_empty[ref] for ref in group)
                ]
                self._warn_weightless(where, batch)
            # which pairs are empty: they score 0, rescaled or not, and do not compete for a
            # candidate's best (a host list to the device, pinned and asynchronous: a plain
            # copy from pageable memory would wait for the scorer's forward queued before it)
            reference_empty = None
            if self.baseline is not None or owner != list(range(batch)):
                reference_empty = to_device(torch.tensor(references[5]), references[1].device)
            references = references[:3]
        else:
            *encoded_refs, weightless, empty_rows, reference_empty = self._encode_reference_ids(
                reference_ids, reference_mask
            )
            references = tuple(encoded_refs)
            self._warn_empty_references([f"reference_ids[{row}]" for row in empty_rows], batch)
            self._warn_weightless([f"reference_ids[{row}]" for row in weightless], batch)
        # an empty candidate has no content position: only the special tokens the loss wraps it
        # in; Embeddings come as they are, [CLS] and [SEP] in their mask where they came from
        # encode_references (weight 0): None, their weights decide (audit h35: an empty one
        # counted as content was rescaled to a loss of 1.184, where token ids score 1.0)
        specials = None if isinstance(candidates, Embeddings) else self._special_count()
        # one reference per candidate, in order: no gather, no max over references
        one_each = owner == list(range(batch))
        index = None if one_each else to_device(torch.tensor(owner), encoded.hidden.device)
        empty = (reference_empty, specials)
        prf = self._step("prf")(self, encoded[:3], references, index, batch, *empty)
        if encoded.exact is None:
            return prf, log_likelihood
        # retokenize: the decoded text's score, with the gradient of the average bridge's
        with torch.no_grad():
            exact = self._step("prf")(self, encoded.exact, references, index, batch, *empty)
        return PRF(*(e + (x - x.detach()) for e, x in zip(exact, prf, strict=True))), log_likelihood

    def _join_centering(self, encoded: EncodedCandidates) -> Tensor:
        """An empty batch's part in the centering all-reduces of the other processes' calls,
        in the same order (a process that skipped them would leave the others waiting), in
        the dtypes of their statistics (the scorer's output; float32 references), and on the
        graph where theirs is: their candidates' reduction runs again in the backward pass,
        so this process's must too (the differentiable pass only, as the others': the
        decoded text's is without grad). Returns a zero on that graph."""
        device, width = self.encoder.device, self.encoder.hidden_size
        dtype = self.encoder.input_embeddings.weight.dtype
        no_mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        tracked = encoded.hidden.requires_grad and torch.is_grad_enabled()
        joined = encoded.hidden.new_zeros(())
        for call in range(1 if encoded.exact is None else 2):  # as many as _prf calls
            with torch.set_grad_enabled(tracked and call == 0):
                candidates = torch.zeros(0, 0, width, dtype=dtype, device=device)
                centered = batch_center(candidates.requires_grad_(tracked and call == 0), no_mask)
                batch_center(torch.zeros(0, 0, width, device=device), no_mask)
            if centered.requires_grad:
                joined = joined + centered.sum()
        return joined

    def _encode(
        self, candidates: CandidateInput, candidate_mask: Tensor | None, target_ids: Tensor | None
    ) -> EncodedCandidates:
        """The candidates to the scorer's hidden states (:class:`CandidateEncoder`)."""
        return self.candidate_encoder.encode(self._placed(), candidates, candidate_mask, target_ids)

    def _step(self, name: str) -> Callable[..., Any]:
        """The loss's tensor step ``name`` (``"encode"``: :meth:`_encode`, ``"prf"``:
        :meth:`_prf`) as an unbound function of the loss, compiled after :meth:`compile`."""
        if self._compiled_steps is not None:
            return self._compiled_steps[name]
        return getattr(type(self), "_" + name)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile the loss's tensor work with :func:`torch.compile` (its arguments: ``mode``,
        ``backend``, ``dynamic``, ...) for every entry point: :meth:`forward`, :meth:`score`,
        :meth:`score_and_cross_entropy` and :meth:`loss_and_cross_entropy` (the trainer
        integration's calls).

        Two steps are compiled: the candidates' encoding (their distributions, the bridge or
        the fused LM-head pass, the special tokens, the scorer) and the matching with its
        reductions. Between them the references stay eager: texts are validated, looked up in
        the cache and encoded on a miss, host work on Python strings that a compiled graph
        would guard on, so that every new batch of reference texts would compile again (what
        ``nn.Module.compile``, which compiles :meth:`forward` whole, did: three new graphs a
        call until its recompile limit). New shapes still compile again, the candidates' and
        the references' padded lengths among them (``dynamic=None``, the default, makes a
        changing size dynamic after its first change).

        A caller compiled whole (``torch.compile(loss)``, a compiled model or step that calls
        the loss) does not trace into the loss's entry points, which Dynamo skips: traced, their
        reference texts went into the caller's graph. These steps run compiled from it too.

        The compiled encoding builds the candidate table once: in-place changes of
        ``loss.scorer_weights`` or of the scorer's parameters are not followed there (loads
        through ``load_state_dict`` are); call ``loss.clear_cache()`` after such a change.

        Raises:
            ValueError: for ``fullgraph=True``: the encoding breaks its graph where it reads the
                device (the logits' finiteness check; the LM-head pass's row selection).
            RuntimeError: under torch < 2.8, whose Dynamo fails in the compiled LM-head pass
                (torch 2.6 tried; 2.8 and later pass the compiled loss's tests).
        """
        if kwargs.get("fullgraph"):
            raise ValueError(
                "loss.compile(fullgraph=True): the loss's encoding breaks its graph where it "
                "reads the device (the logits' finiteness check, the LM head's row selection); "
                "compile without fullgraph"
            )
        if TorchVersion(torch.__version__) < COMPILE_NEEDS_TORCH:
            raise RuntimeError(
                f"loss.compile() needs torch >= {'.'.join(map(str, COMPILE_NEEDS_TORCH))}, "
                f"found {torch.__version__} (its Dynamo fails inside the compiled LM-head pass); "
                "upgrade torch or run the loss eager"
            )
        cls = type(self)
        self._compiled_steps = {
            name: torch.compile(getattr(cls, "_" + name), *args, **kwargs)
            for name in ("encode", "prf")
        }

    def _prf(
        self,
        candidates: tuple,
        references: tuple,
        index: Tensor | None,
        batch: int,
        reference_empty: Tensor | None = None,
        candidate_specials: int | None = 0,
    ) -> PRF:
        """P, R, F ``[B]`` of encoded candidates against encoded references (``index``: each
        reference's candidate, the max taken over a candidate's references; ``None``: one
        reference per candidate, in order).

        A pair is empty when its reference is (``reference_empty``, ``[N]`` bool, ``None``:
        none is) or its candidate has no more masked positions than ``candidate_specials``
        (the special tokens it was wrapped in; ``None``: no masked position of positive
        weight, for embeddings given as they are): it scores 0 after rescaling too, and does
        not compete for its candidate's best, as in the metric (bert_score would rescale it)."""
        cand_hidden, cand_mask, cand_weights = candidates
        ref_hidden, ref_mask, ref_weights = references
        if self.center:
            cand_hidden = batch_center(cand_hidden, cand_mask)
            ref_hidden = batch_center(ref_hidden, ref_mask)
        prf = bert_score(
            cand_hidden if index is None else cand_hidden[index],
            ref_hidden,
            cand_mask if index is None else cand_mask[index],
            ref_mask,
            cand_weights if index is None else cand_weights[index],
            ref_weights,
            matching=self.matching,
            # no pole at P = -R, which the soft matchings reach: 1 - F stays in [0, 2]
            bounded_f=True,
        )
        empty = None
        if self.baseline is not None or index is not None:
            # on the device, from the masks and the host's facts: no read
            if candidate_specials is None:
                empty = ~(cand_mask & (cand_weights > 0)).any(dim=1)
            else:
                empty = cand_mask.sum(dim=1) <= candidate_specials
            empty = empty if index is None else empty[index]
            if reference_empty is not None:
                empty = empty | reference_empty.to(empty.device)
        if self.baseline is not None:
            # an empty pair scored 0 (no weight on a side); (0 - b) / (1 - b) would make it
            # -0.184 for MiniLM, where the docs, the warning and the metric say 0
            prf = PRF(
                *(
                    torch.where(empty, 0.0, rescale_with_baseline(x, b))
                    for x, b in zip(prf, self.baseline.to(prf.f1.device), strict=True)
                )
            )
        if index is None:
            return prf
        return PRF(*(best_of_owned(x, index, batch, ignore=empty) for x in prf))

    @_entry_point
    def forward(
        self,
        candidates: CandidateInput | Tensor | None = None,
        references: Sequence[str] | Sequence[Sequence[str]] | None = None,
        *,
        candidate_mask: Tensor | None = None,
        reference_ids: Tensor | None = None,
        reference_mask: Tensor | None = None,
        **deprecated,
    ) -> Tensor:
        """``1 - score`` (the ``target``), reduced by ``reduction``; arguments as in
        :meth:`score`. The loss and the targets' cross-entropy from one chunked pass over the
        LM head: :meth:`loss_and_cross_entropy`."""
        if "target_ids" in deprecated:
            target_ids = deprecated.pop("target_ids")
            warn_user(
                "BERTScoreLoss(...)(hidden_states=..., target_ids=...) is deprecated: call "
                "loss.loss_and_cross_entropy(LMHeadInputs(hidden_states, head), target_ids, "
                "references) (see the migration table in CHANGELOG.md)",
                DeprecationWarning,
            )
            if target_ids is not None:
                return self.loss_and_cross_entropy(
                    candidates,
                    target_ids,
                    references,
                    candidate_mask=candidate_mask,
                    reference_ids=reference_ids,
                    reference_mask=reference_mask,
                    **deprecated,
                )
        candidates = from_keywords(candidates, deprecated, "forward")
        prf, _ = self._score(
            candidates, candidate_mask, None, references, reference_ids, reference_mask
        )
        return self._reduce(1 - getattr(prf, self.target))

    @_entry_point
    def loss_and_cross_entropy(
        self,
        candidates: LMHeadInputs | None = None,
        target_ids: Tensor | None = None,
        references: Sequence[str] | Sequence[Sequence[str]] | None = None,
        *,
        candidate_mask: Tensor | None = None,
        reference_ids: Tensor | None = None,
        reference_mask: Tensor | None = None,
        **deprecated,
    ) -> LossAndCrossEntropy:
        """The loss (as :meth:`forward`) and the cross-entropy of ``target_ids`` ``[B, L]``
        (``-100`` ignored) under the LM head's logits (soft-capped, temperature 1), both from
        one chunked pass over the vocabulary and reduced by ``reduction`` (``"mean"``: the CE
        per target token): a training step needs no ``[B, L, V]`` logits at all. Arguments as
        in :meth:`score_and_cross_entropy`."""
        prf, per_token = self.score_and_cross_entropy(
            candidates,
            target_ids,
            references,
            candidate_mask=candidate_mask,
            reference_ids=reference_ids,
            reference_mask=reference_mask,
            **deprecated,
        )
        loss = self._reduce(1 - getattr(prf, self.target))
        if self.reduction == "mean":
            count = (target_ids != IGNORE_INDEX).sum().clamp_min(1)
            return LossAndCrossEntropy(loss, per_token.sum() / count)
        return LossAndCrossEntropy(loss, per_token.sum() if self.reduction == "sum" else per_token)

    def _reduce(self, loss: Tensor) -> Tensor:
        if self.reduction == "mean" and loss.numel() == 0:
            return loss.sum()  # an empty batch: 0, not the NaN of a mean over nothing
        if self.reduction == "mean":
            return loss.mean()
        if self.reduction == "sum":
            return loss.sum()
        return loss


def _as_reference_ids(reference_ids: object) -> Tensor:
    """``reference_ids`` checked: an integer tensor ``[B, L]``."""
    reference_ids = as_token_ids(reference_ids, "reference_ids")
    if reference_ids.dim() != 2:
        raise ValueError(f"reference_ids must be [B, L], got {list(reference_ids.shape)}")
    return reference_ids
