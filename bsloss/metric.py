"""BERTScore as an evaluation metric: text in, per-pair P, R, F out.

A thin stateful wrapper: the :class:`~bsloss.scorer.encoder.ScorerEncoder` turns text into token
embeddings, :func:`bsloss.functional.bert_score` does the math (the same function the losses use).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor

from bsloss import __version__
from bsloss._warnings import warn_user
from bsloss.baseline import load_baseline
from bsloss.functional import bert_score, rescale_with_baseline
from bsloss.functional.idf import document_frequency, idf_from_frequency
from bsloss.inputs import check_int, check_texts, flatten_groups, validate_pairs
from bsloss.scorer.batching import pad_embedded
from bsloss.scorer.encoder import ScorerEncoder
from bsloss.scorer.reference_cache import ReferenceCache, ReferenceEmbedder
from bsloss.scorer.weights import IdfSpec, weight_table

__all__ = ["BERTScorer", "score"]


class BERTScorer:
    """Exact BERTScore (Zhang et al., 2020) with any Hugging Face encoder.

    Args:
        model: hub name or local folder; ``None``: the embedded all-MiniLM-L6-v2.
        num_layers: layer whose output is used (0 = embeddings); default from the layer table.
        idf: ``False`` (uniform weights), ``True`` (idf from the references of each
            :meth:`score` call, like ``bert_score.score(idf=True)``), a list of sentences to
            compute idf from, or a ``{token_id: weight}`` dict.
        rescale_with_baseline: rescale with ``(x - b) / (1 - b)``.
        baseline_path: a bert_score-format baseline file; default: the one shipped for ``model``.
        batch_size: sentences per encoder batch and pairs per matching batch.
        device: default CUDA when available, else CPU.
        autocast_dtype: fast mode: run the encoder under ``torch.autocast`` in this dtype
            (``torch.bfloat16``; ``torch.float16`` on GPU). Matching and reductions stay float32.
            The scorer's own encoder then keeps its linear weights in this dtype
            (:meth:`~bsloss.scorer.encoder.ScorerEncoder.keep_linear_weights_in`); an ``encoder``
            passed in is left as it is. ``None`` (default): exact float32.
        compile: encode through ``torch.compile`` with weight freezing
            (:meth:`~bsloss.scorer.encoder.ScorerEncoder.compile_inference`): the first calls
            compile (tens of seconds on a CPU, again for a batch of one), later ones are faster;
            for a validation set or reward scored many times. Needs a C++ compiler on CPU.
        long_inputs: ``"truncate"`` (as bert_score, with a warning) texts longer than the
            model's maximum, or ``"window"``: encode them whole with overlapping windows
            (:meth:`~bsloss.scorer.encoder.ScorerEncoder.embed_windows`).
        chunk_size: pairs scored per chunk. Embeddings live only for one chunk, so memory is
            bounded by the chunk, not by the corpus; unique sentences are encoded once per chunk.
        reference_cache_size: keep the embeddings of up to this many reference texts across
            :meth:`score` calls (oldest evicted first), for a validation set or an RL reward that
            scores new candidates against the same references again and again. ``0``: no cache.
            :meth:`clear_cache` empties it.

    Raises:
        ValueError, TypeError: an argument of the wrong type or out of range, named.
        FileNotFoundError: no baseline file for ``rescale_with_baseline``.
        OSError: a model that cannot be loaded.
    """

    def __init__(
        self,
        model: str | None = None,
        num_layers: int | None = None,
        idf: IdfSpec = False,
        rescale_with_baseline: bool = False,
        baseline_path: str | None = None,
        batch_size: int = 64,
        device: str | torch.device | None = None,
        *,
        autocast_dtype: torch.dtype | None = None,
        chunk_size: int = 8192,
        long_inputs: str = "truncate",
        encoder: ScorerEncoder | None = None,
        reference_cache_size: int = 0,
        compile: bool = False,
    ):
        if long_inputs not in ("truncate", "window"):
            raise ValueError(f"long_inputs must be 'truncate' or 'window', got {long_inputs!r}")
        self.long_inputs = long_inputs
        batch_size = check_int(batch_size, "batch_size", 1)
        chunk_size = check_int(chunk_size, "chunk_size", 1)
        reference_cache_size = check_int(reference_cache_size, "reference_cache_size", 0)
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"autocast_dtype must be None, torch.bfloat16 or torch.float16, "
                f"got {autocast_dtype}"
            )
        if encoder is not None and not isinstance(encoder, ScorerEncoder):
            raise TypeError(f"encoder must be a ScorerEncoder, got {type(encoder).__name__}")
        if encoder is None:
            encoder = ScorerEncoder.from_pretrained(model, num_layers, device)
            if autocast_dtype is not None:
                encoder.keep_linear_weights_in(autocast_dtype)
        self.encoder = encoder
        self.autocast_dtype = autocast_dtype
        self._references = self._embedder(reference_cache_size)
        if compile:
            self.encoder.compile_inference()
        self.batch_size = batch_size
        self.chunk_size = chunk_size
        self.rescale = rescale_with_baseline
        self.baseline: Tensor | None = None
        if rescale_with_baseline:
            self.baseline = load_baseline(baseline_path, self.encoder.name, self.encoder.num_layers)
        self.idf = idf
        self._weight_table = weight_table(self.encoder, idf, self.vocab_size)

    # ----------------------------------------------------------------- weights
    @property
    def vocab_size(self) -> int:
        return max(len(self.encoder.tokenizer), self.encoder.input_embeddings.num_embeddings)

    @property
    def hash(self) -> str:
        """Reproducibility signature: model, layer, idf, rescaling and versions."""
        import transformers

        idf = "idf" if self.idf is not False else "no-idf"
        signature = (
            f"{self.encoder.name}_L{self.encoder.num_layers}_{idf}_bsloss={__version__}"
            f"(torch={torch.__version__},transformers={transformers.__version__})"
        )
        signature += "-rescaled" if self.rescale else ""
        if self.autocast_dtype is not None:
            signature += f"-autocast={str(self.autocast_dtype).removeprefix('torch.')}"
        return signature

    # ----------------------------------------------------------------- embedding
    @property
    def reference_cache_size(self) -> int:
        """Reference texts whose embeddings are kept across :meth:`score` calls."""
        return self._references.cache.max_size

    @reference_cache_size.setter
    def reference_cache_size(self, size: int) -> None:
        self._references.cache.max_size = size

    @property
    def _reference_cache(self) -> ReferenceCache:
        return self._references.cache

    def clear_cache(self) -> None:
        """Forget the cached reference embeddings (:class:`ReferenceCache`)."""
        self._references.cache.clear()

    clear_reference_cache = clear_cache

    def with_reference_cache(self, size: int) -> BERTScorer:
        """A scorer that shares this one's encoder and settings, with its own reference cache of
        ``size`` texts (this scorer is left as it is).

        >>> cached = BERTScorer().with_reference_cache(10_000)  # doctest: +SKIP
        """
        clone = copy.copy(self)
        clone._references = self._embedder(size)
        return clone

    def _embedder(self, cache_size: int) -> ReferenceEmbedder:
        """Texts -> float32 unit-norm token embeddings, the references cached."""
        return ReferenceEmbedder(
            self.encoder,
            cache_size,
            transform=_unit_norm_float32,
            autocast_dtype=self.autocast_dtype,
            inference_mode=True,
        )

    def embed(
        self, texts: Sequence[str], progress: bool | None = None
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """Unique text -> (unit-norm token embeddings ``[L, d]`` float32, token ids ``[L]``).

        Args:
            texts: a list of strings.
            progress: a progress bar (``None``: only on a terminal).

        Raises:
            TypeError, ValueError: ``texts`` is not a list of valid strings (position named).

        >>> scorer = BERTScorer()  # doctest: +SKIP
        >>> embeddings, ids = scorer.embed(["A cat."])["A cat."]  # doctest: +SKIP
        """
        texts = check_texts(texts, "texts")
        embedded, truncated = self._references.embed(
            texts,
            window=self.long_inputs == "window",
            batch_size=self.batch_size,
            progress=progress,
        )
        if truncated:
            where = ", ".join(f"texts[{i}]" for i, t in enumerate(texts) if t in truncated)
            warn_user(self.encoder.truncation_message(len(truncated), len(embedded), where))
        return embedded

    def _warn_truncated(self, long_texts: set[str], cands, groups) -> None:
        where = [f"cands[{i}]" for i, c in enumerate(cands) if c in long_texts]
        for i, group in enumerate(groups):
            for k, ref in enumerate(group):
                if ref in long_texts:
                    where.append(f"refs[{i}]" if len(group) == 1 else f"refs[{i}][{k}]")
        shown = ", ".join(where[:10]) + (", ..." if len(where) > 10 else "")
        total = len(cands) + sum(len(g) for g in groups)
        warn_user(self.encoder.truncation_message(len(where), total, shown))

    def _idf_from_references(self, pair_refs: list[str]) -> Tensor:
        """idf=True: weights from this call's references (as ``bert_score.score`` does),
        counted chunk by chunk."""
        frequency = torch.zeros(self.vocab_size, dtype=torch.float64)
        for start in range(0, len(pair_refs), self.chunk_size):
            ids, _ = self.encoder.tokenize_checked(
                pair_refs[start : start + self.chunk_size],
                truncate=self.long_inputs == "truncate",
            )
            frequency += document_frequency(ids, self.vocab_size)
        return idf_from_frequency(frequency, len(pair_refs), self.encoder.special_token_ids)

    # ----------------------------------------------------------------- scoring
    def score(
        self,
        cands: Sequence[str],
        refs: Sequence[str] | Sequence[Sequence[str]],
        *,
        batch_size: int | None = None,
        progress: bool | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per-candidate ``(P, R, F)``, float32 tensors of shape ``[N]`` on the CPU.

        ``refs`` is one reference per candidate, or a list of references per candidate (the
        maximum of P, of R and of F is taken independently, as in bert_score). An empty or
        whitespace-only candidate or reference makes its pair score 0, with one warning.

        Args:
            cands: candidate texts.
            refs: one reference text, or a non-empty list of them, per candidate.
            batch_size: pairs per matching batch (default: the scorer's).
            progress: a progress bar (``None``: only on a terminal).

        Raises:
            TypeError, ValueError: input of the wrong type, lengths that differ, an empty list of
                references, a text that is not valid Unicode, ``batch_size < 1`` (all named).

        >>> P, R, F = BERTScorer().score(["A cat sat."], ["A cat sat down."])  # doctest: +SKIP
        """
        cands, groups = validate_pairs(cands, refs)
        if batch_size is not None:
            batch_size = check_int(batch_size, "batch_size", 1)
        pair_cands, pair_refs, owner = flatten_groups(cands, groups)
        if not pair_cands:
            empty = torch.zeros(0)
            return empty, empty.clone(), empty.clone()
        table = self._weight_table
        if table is None:
            table = self._idf_from_references(pair_refs)
        table = table.to(self.encoder.device, torch.float32)
        pair_scores = torch.empty(len(pair_cands), 3)
        long_texts: set[str] = set()
        for start in range(0, len(pair_cands), self.chunk_size):
            chunk = slice(start, start + self.chunk_size)
            embeddings, truncated = self._references.embed(
                pair_cands[chunk] + pair_refs[chunk],
                cache_texts=pair_refs[chunk],
                window=self.long_inputs == "window",
                batch_size=self.batch_size,
                progress=progress,
            )
            long_texts.update(truncated)
            pair_scores[chunk] = self._score_pairs(
                pair_cands[chunk],
                pair_refs[chunk],
                embeddings,
                table,
                batch_size or self.batch_size,
            )
            del embeddings
        if long_texts:
            self._warn_truncated(long_texts, cands, groups)
        if self.baseline is not None:
            pair_scores = rescale_with_baseline(pair_scores, self.baseline.float())
        empty = self._empty_pairs(pair_cands, pair_refs, owner, groups)
        return self._group_max(pair_scores, empty, owner, len(cands))

    def _score_pairs(self, pair_cands, pair_refs, embeddings, table, batch_size) -> Tensor:
        """``[num_pairs, 3]`` raw P, R, F, in batches of pairs of similar lengths."""
        order = sorted(
            range(len(pair_cands)),
            key=lambda i: len(embeddings[pair_cands[i]][1]) + len(embeddings[pair_refs[i]][1]),
        )
        scores = torch.empty(len(pair_cands), 3)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            cand_emb, cand_mask, cand_w = pad_embedded(
                [embeddings[pair_cands[i]] for i in batch], table
            )
            ref_emb, ref_mask, ref_w = pad_embedded(
                [embeddings[pair_refs[i]] for i in batch], table
            )
            prf = bert_score(
                cand_emb,
                ref_emb,
                cand_mask,
                ref_mask,
                cand_w,
                ref_w,
                matching="hard",
                normalized=True,
            )
            scores[batch] = torch.stack(prf, dim=-1).float().cpu()
        return scores

    @staticmethod
    def _empty_pairs(pair_cands, pair_refs, owner, groups) -> Tensor:
        empty = torch.tensor(
            [not c.strip() or not r.strip() for c, r in zip(pair_cands, pair_refs, strict=True)],
            dtype=torch.bool,
        )
        if empty.any():
            where = []
            for pair in empty.nonzero().flatten().tolist():
                i = owner[pair]
                k = pair - owner.index(i)
                where.append(str(i) if len(groups[i]) == 1 else f"{i} (reference {k})")
            shown = ", ".join(where[:20]) + (", ..." if len(where) > 20 else "")
            warn_user(
                f"{len(where)} empty or whitespace-only candidate/reference pair(s) "
                f"score 0: candidate index {shown}"
            )
        return empty

    @staticmethod
    def _group_max(pair_scores: Tensor, empty: Tensor, owner: list[int], n: int):
        """Max over each candidate's references of P, of R and of F; empty pairs don't compete
        and a candidate with only empty pairs scores 0."""
        index = torch.tensor(owner)[:, None].expand(-1, 3)
        competing = pair_scores.masked_fill(empty[:, None], float("-inf"))
        best = torch.full((n, 3), float("-inf")).scatter_reduce(0, index, competing, "amax")
        best = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
        return best[:, 0].contiguous(), best[:, 1].contiguous(), best[:, 2].contiguous()


def _unit_norm_float32(hidden: Tensor) -> Tensor:
    return torch.nn.functional.normalize(hidden.float(), dim=-1)


def score(
    cands: Sequence[str],
    refs: Sequence[str] | Sequence[Sequence[str]],
    model: str | None = None,
    num_layers: int | None = None,
    idf: IdfSpec = False,
    rescale_with_baseline: bool = False,
    baseline_path: str | None = None,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    progress: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One-shot :class:`BERTScorer` ``(P, R, F)``; see its arguments."""
    scorer = BERTScorer(
        model=model,
        num_layers=num_layers,
        idf=idf,
        rescale_with_baseline=rescale_with_baseline,
        baseline_path=baseline_path,
        batch_size=batch_size,
        device=device,
    )
    return scorer.score(cands, refs, progress=progress)
