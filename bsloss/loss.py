"""Differentiable BERTScore losses.

``BERTScoreLoss`` composes three pieces: the generator's distributions become scorer input
embeddings (:mod:`bsloss.distributions`, through the :mod:`bsloss.bridge` when vocabularies
differ), the frozen :class:`~bsloss.scorer.encoder.ScorerEncoder` contextualises them, and
:func:`bsloss.functional.bert_score` (the same function as the evaluation metric) matches them to
the references.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from bsloss.baseline import read_baseline, shipped_baseline_path
from bsloss.bridge import VocabularyBridge
from bsloss.distributions import augment_table, expected_inputs, token_distribution
from bsloss.functional import PRF, batch_center, bert_score, rescale_with_baseline
from bsloss.functional.matching import check_temperature, get_matching
from bsloss.inputs import flatten_groups
from bsloss.scorer.batching import pad_embedded
from bsloss.scorer.checkpointing import set_gradient_checkpointing
from bsloss.scorer.encoder import ScorerEncoder
from bsloss.scorer.weights import IdfSpec, weight_table

__all__ = ["BERTScoreLoss"]

_TARGETS = ("precision", "recall", "f1")


class BERTScoreLoss(nn.Module):
    """``1 - BERTScore`` of candidates (generator distributions, token ids or embeddings)
    against references, differentiable in the candidates.

    Args:
        model, num_layers: the scorer (``None``: embedded all-MiniLM-L6-v2), or pass ``encoder``.
        matching: ``"hard"`` (gradient through the argmax cells), ``"softmax"``,
            ``"logsumexp"`` or ``"sinkhorn"``.
        temperature: ``T`` of the soft matchings.
        sinkhorn_iterations: Sinkhorn steps for ``matching="sinkhorn"``.
        target: which score the loss is ``1 -`` of: ``"f1"``, ``"precision"`` or ``"recall"``.
        idf: ``False``, a list of sentences, or a ``{scorer_token_id: weight}`` dict.
        center: subtract the batch mean of the candidates' and of the references' token vectors
            (Chen et al., 2020), over all processes under torch.distributed.
        rescale_with_baseline, baseline_path: baseline rescaling of the score.
        generator_tokenizer: the generator's tokenizer when it differs from the scorer's (a
            :class:`~bsloss.bridge.VocabularyBridge` is built, or pass ``bridge``).
        top_k, straight_through, gumbel_temperature: see :mod:`bsloss.distributions`.
        gradient_checkpointing: recompute the scorer's layer activations in the backward pass.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Returns:
        Calling it (:meth:`forward`) returns ``1 - score`` of ``target``, reduced by
        ``reduction``; :meth:`score` returns the per-sample ``PRF``.

    Raises:
        ValueError: an unknown ``matching``, ``target`` or ``reduction``, a temperature that is
            not positive, ``sinkhorn_iterations < 1`` or ``idf=True``; at call time, inputs
            whose shapes or vocabulary do not fit (named in the message).

    >>> import torch, bsloss
    >>> loss_fn = bsloss.BERTScoreLoss(matching="softmax", temperature=0.05)
    >>> logits = torch.randn(2, 6, 30522, requires_grad=True)  # a generator's [B, L, V] output
    >>> loss = loss_fn(logits=logits, references=["a cat sat", "the dog ran"])
    >>> loss.backward(); logits.grad.shape
    torch.Size([2, 6, 30522])
    """

    def __init__(
        self,
        model: str | None = None,
        num_layers: int | None = None,
        *,
        encoder: ScorerEncoder | None = None,
        matching: str = "softmax",
        temperature: float = 0.05,
        sinkhorn_iterations: int = 1,
        target: str = "f1",
        idf: IdfSpec = False,
        center: bool = False,
        rescale_with_baseline: bool = False,
        baseline_path: str | None = None,
        generator_tokenizer=None,
        bridge: VocabularyBridge | None = None,
        bridge_cache_dir: str | None = None,
        top_k: int | None = None,
        straight_through: bool = False,
        gumbel_temperature: float | None = None,
        gradient_checkpointing: bool = True,
        reduction: str = "mean",
        device: str | torch.device | None = None,
    ):
        super().__init__()
        get_matching(matching)
        if matching != "hard":
            temperature = check_temperature(temperature)
        if target not in _TARGETS:
            raise ValueError(f"target must be one of {_TARGETS}, got {target!r}")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if sinkhorn_iterations < 1:
            raise ValueError(f"sinkhorn_iterations must be >= 1, got {sinkhorn_iterations}")
        self.encoder = encoder or ScorerEncoder.from_pretrained(model, num_layers, device)
        set_gradient_checkpointing(self.encoder.model, gradient_checkpointing)
        self.matching, self.temperature = matching, temperature
        self.sinkhorn_iterations = sinkhorn_iterations
        self.target, self.center, self.reduction = target, center, reduction
        self.top_k, self.straight_through = top_k, straight_through
        self.gumbel_temperature = gumbel_temperature
        if bridge is None and generator_tokenizer is not None:
            bridge = VocabularyBridge.build(
                generator_tokenizer, self.encoder, cache_dir=bridge_cache_dir
            )
        self.bridge = bridge
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
            path = baseline_path or shipped_baseline_path(self.encoder.name)
            self.baseline = read_baseline(path, self.encoder.num_layers).float()
        self._reference_cache: dict[str, tuple[Tensor, Tensor]] = {}
        self._generator_tables: dict[tuple, Tensor] = {}

    # ------------------------------------------------------------------ candidates
    @property
    def generator_vocab_size(self) -> int:
        if self.bridge is not None:
            return self.bridge.generator_vocab_size
        return self.encoder.input_embeddings.num_embeddings

    def _generator_table(self) -> Tensor:
        """``[V_gen, d + 1]``: input embeddings and importance weights of the generator's tokens
        (through the bridge when vocabularies differ). The scorer is frozen, so it is built once
        per device and dtype."""
        table = self.encoder.input_embeddings.weight
        key = (table.device, table.dtype)
        if key not in self._generator_tables:
            weights = self.scorer_weights
            if self.bridge is not None:
                table, weights = (
                    self.bridge.embedding_table(table.detach()),
                    self.bridge.weight_table(weights),
                )
            self._generator_tables = {key: augment_table(table, weights)}
        return self._generator_tables[key]

    def _check_vocab(self, size: int, name: str) -> None:
        if size == self.generator_vocab_size:
            return
        if self.bridge is None:
            where, hint = "the scorer", "; pass generator_tokenizer=... to build a bridge"
        else:
            where, hint = "the vocabulary bridge", ""
        raise ValueError(
            f"{name} has a vocabulary of {size} entries but {where} expects "
            f"{self.generator_vocab_size}{hint}"
        )

    def encode_candidates(
        self,
        *,
        logits: Tensor | None = None,
        probs: Tensor | None = None,
        candidate_ids: Tensor | None = None,
        embeddings: Tensor | None = None,
        candidate_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Scorer hidden states ``[B, L', d]``, real-token mask and importance weights."""
        given = [x is not None for x in (logits, probs, candidate_ids, embeddings)]
        if sum(given) != 1:
            raise ValueError("pass exactly one of logits, probs, candidate_ids or embeddings")
        source = next(x for x in (logits, probs, candidate_ids, embeddings) if x is not None)
        if candidate_mask is None:
            candidate_mask = torch.ones(source.shape[:2], dtype=torch.bool, device=source.device)
        if tuple(candidate_mask.shape) != tuple(source.shape[:2]):
            raise ValueError(
                f"candidate_mask must have shape {list(source.shape[:2])} "
                f"([B, L] of the candidates), got {list(candidate_mask.shape)}"
            )
        candidate_mask = candidate_mask.bool()
        if embeddings is not None:
            if embeddings.dim() != 3 or embeddings.shape[-1] != self.encoder.hidden_size:
                raise ValueError(
                    f"embeddings must be [B, L, {self.encoder.hidden_size}] scorer "
                    f"hidden states, got {list(embeddings.shape)}"
                )
            weights = candidate_mask.to(torch.float32)
            return embeddings, candidate_mask, weights
        table = self._generator_table()
        if candidate_ids is not None:
            if candidate_ids.dim() != 2:
                raise ValueError(f"candidate_ids must be [B, L], got {list(candidate_ids.shape)}")
            bad = (candidate_ids < 0) | (candidate_ids >= table.shape[0])
            if (bad & candidate_mask).any():
                raise ValueError(
                    f"candidate_ids has ids outside [0, {table.shape[0]}) at "
                    f"{(bad & candidate_mask).nonzero()[0].tolist()}"
                )
            ids = candidate_ids.clamp(0, table.shape[0] - 1)
            rows = table[ids]
            inputs, weights = rows[..., :-1], rows[..., -1]
        else:
            name = "logits" if logits is not None else "probs"
            self._check_vocab(source.shape[-1], name)
            distribution = token_distribution(
                logits,
                probs,
                top_k=self.top_k,
                straight_through=self.straight_through,
                gumbel_temperature=self.gumbel_temperature,
            )
            inputs, weights = expected_inputs(distribution, table)
        hidden, attention, special = self.encoder.forward_token_embeddings(inputs, candidate_mask)
        # Weights follow the tokens to their packed slots; special tokens weigh 0.
        packed = torch.zeros(attention.shape, dtype=weights.dtype, device=hidden.device)
        real = attention & ~special
        packed[real] = weights[candidate_mask]
        return hidden, attention, packed

    # ------------------------------------------------------------------ references
    @torch.no_grad()
    def encode_references(self, texts: Sequence[str]) -> tuple[Tensor, Tensor, Tensor]:
        """Hidden states of reference texts, computed once per text and cached."""
        missing = [t for t in dict.fromkeys(texts) if t not in self._reference_cache]
        if missing:
            token_ids = self.encoder.tokenize(missing, name="references")
            hidden = self.encoder.embed_token_ids(token_ids, batch_size=64)
            device = self.encoder.device
            for text, ids, h in zip(missing, token_ids, hidden, strict=True):
                # clone: a row must not keep the whole packed tensor of this call alive
                self._reference_cache[text] = (h.float().clone(), torch.tensor(ids, device=device))
        return pad_embedded([self._reference_cache[t] for t in texts], self.scorer_weights)

    @torch.no_grad()
    def encode_reference_ids(self, reference_ids: Tensor, reference_mask: Tensor | None):
        if reference_mask is None:
            reference_mask = torch.ones_like(reference_ids, dtype=torch.bool)
        if reference_mask.shape != reference_ids.shape:
            raise ValueError(
                f"reference_mask must have shape {list(reference_ids.shape)}, got "
                f"{list(reference_mask.shape)}"
            )
        hidden = self.encoder(input_ids=reference_ids, attention_mask=reference_mask.long()).float()
        mask = reference_mask.bool()
        return hidden, mask, self.scorer_weights[reference_ids] * mask

    # ------------------------------------------------------------------ scoring
    def score(
        self,
        *,
        logits: Tensor | None = None,
        probs: Tensor | None = None,
        candidate_ids: Tensor | None = None,
        embeddings: Tensor | None = None,
        candidate_mask: Tensor | None = None,
        references: Sequence[str] | Sequence[Sequence[str]] | None = None,
        reference_ids: Tensor | None = None,
        reference_mask: Tensor | None = None,
    ) -> PRF:
        """Per-sample (P, R, F) ``[B]``, differentiable in the candidates. With several
        references per sample, the max of each over the references."""
        cand_hidden, cand_mask, cand_weights = self.encode_candidates(
            logits=logits,
            probs=probs,
            candidate_ids=candidate_ids,
            embeddings=embeddings,
            candidate_mask=candidate_mask,
        )
        batch = cand_hidden.shape[0]
        owner = list(range(batch))
        if (references is None) == (reference_ids is None):
            raise ValueError("pass exactly one of references (texts) or reference_ids")
        if references is not None:
            if len(references) != batch:
                raise ValueError(
                    f"references has {len(references)} entries for a batch of {batch} candidates"
                )
            groups = [[r] if isinstance(r, str) else list(r) for r in references]
            for i, group in enumerate(groups):
                if not group:
                    raise ValueError(f"references[{i}] is an empty list")
            _, flat_refs, owner = flatten_groups([""] * batch, groups)
            ref_hidden, ref_mask, ref_weights = self.encode_references(flat_refs)
        else:
            if reference_ids.shape[0] != batch:
                raise ValueError(
                    f"reference_ids has {reference_ids.shape[0]} rows for a batch "
                    f"of {batch} candidates"
                )
            ref_hidden, ref_mask, ref_weights = self.encode_reference_ids(
                reference_ids, reference_mask
            )
        if self.center:
            cand_hidden = batch_center(cand_hidden, cand_mask)
            ref_hidden = batch_center(ref_hidden, ref_mask)
        index = torch.tensor(owner, device=cand_hidden.device)
        prf = bert_score(
            cand_hidden[index],
            ref_hidden,
            cand_mask[index],
            ref_mask,
            cand_weights[index],
            ref_weights,
            matching=self.matching,
            temperature=self.temperature,
            sinkhorn_iterations=self.sinkhorn_iterations,
        )
        if self.baseline is not None:
            prf = PRF(
                *(
                    rescale_with_baseline(x, b)
                    for x, b in zip(prf, self.baseline.to(prf.f1.device), strict=True)
                )
            )
        if len(owner) == batch:
            return prf
        return PRF(*(self._group_max(x, index, batch) for x in prf))

    @staticmethod
    def _group_max(values: Tensor, index: Tensor, batch: int) -> Tensor:
        """Max per candidate over its references; the gradient flows to the best one."""
        best = torch.full((batch,), float("-inf"), device=values.device, dtype=values.dtype)
        best = best.scatter_reduce(0, index, values.detach(), "amax")
        position = torch.arange(len(index), device=values.device)
        candidates = torch.where(values.detach() == best[index], position, len(index))
        first = torch.full((batch,), len(index), device=values.device)
        first = first.scatter_reduce(0, index, candidates, "amin")
        return values[first]

    def forward(self, **inputs) -> Tensor:
        """``1 - score`` (the ``target``), reduced by ``reduction``."""
        prf = self.score(**inputs)
        loss = 1 - getattr(prf, self.target)
        if self.reduction == "mean":
            return loss.mean()
        if self.reduction == "sum":
            return loss.sum()
        return loss
