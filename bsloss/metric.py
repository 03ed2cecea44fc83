"""BERTScore as an evaluation metric: text in, per-pair P, R, F out.

A thin stateful wrapper: the :class:`~bsloss.scorer.encoder.ScorerEncoder` turns text into token
embeddings, :func:`bsloss.functional.bert_score` does the math (the same function the losses use).

Drop-in for bert_score: :func:`score` and :class:`BERTScorer` take bert_score 0.3.13's keywords
(``model_type``, ``lang``, ``verbose``, ``return_hash``, ``all_layers``, ``idf_sents``, ...) and
return what it returns: ``(P, R, F)``, each ``[N]`` (``[num_layers + 1, N]`` with
``all_layers``), or ``((P, R, F), hash)`` with ``return_hash=True``.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import time
import warnings
from collections.abc import Mapping, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bsloss._version import __version__
from bsloss._warnings import warn_user
from bsloss.baseline import load_baseline, shipped_baseline_path
from bsloss.functional import bert_score, rescale_with_baseline
from bsloss.functional.idf import document_frequency, idf_from_frequency
from bsloss.functional.reduction import best_of_owned
from bsloss.functional.similarity import l2_normalize
from bsloss.inputs import check_flag, check_int, check_texts, flatten_groups, validate_pairs
from bsloss.plot import draw_pair
from bsloss.scorer.batching import paced_by_host, pad_embedded, pair_budget_batches
from bsloss.scorer.encoder import ScorerEncoder
from bsloss.scorer.layers import num_hidden_layers
from bsloss.scorer.reference_cache import ReferenceCache, ReferenceEmbedder, TokenizeAhead
from bsloss.scorer.weights import IdfSpec, as_idf_spec, weight_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["BERTScorer", "score", "LANG_TO_MODEL", "model_for_lang", "get_hash"]

# what score() returns: (P, R, F), or ((P, R, F), hash) with return_hash
ScoreResult = tuple[Tensor, Tensor, Tensor] | tuple[tuple[Tensor, Tensor, Tensor], str]

# bert_score 0.3.13's ``lang2model``: the model each language gets when no model is named.
LANG_TO_MODEL: dict[str, str] = {
    "en": "roberta-large",
    "zh": "bert-base-chinese",
    "tr": "dbmdz/bert-base-turkish-cased",
    "en-sci": "allenai/scibert_scivocab_uncased",
}
MULTILINGUAL_MODEL = "bert-base-multilingual-cased"


def model_for_lang(lang: str) -> str:
    """bert_score's default model for a language (``bert-base-multilingual-cased`` for any
    language without its own entry).

    Args:
        lang: a language code such as ``"en"``, ``"zh"`` or ``"en-sci"``.

    Returns:
        The Hugging Face hub name bert_score would load.

    Raises:
        TypeError: ``lang`` is not a string.

    >>> model_for_lang("en"), model_for_lang("de")
    ('roberta-large', 'bert-base-multilingual-cased')
    """
    if not isinstance(lang, str):
        raise TypeError(f"lang must be a string such as 'en', got {type(lang).__name__}")
    return LANG_TO_MODEL.get(lang.lower(), MULTILINGUAL_MODEL)


def _pick_model(model_type: str | None, model: str | None, lang: str | None) -> str | None:
    """The scorer model from bert_score's ``model_type`` / ``lang`` or bsloss's ``model``."""
    if model_type is not None and model is not None and str(model_type) != str(model):
        raise ValueError(
            f"model_type={model_type!r} and model={model!r} name different scorers; pass one"
        )
    chosen = model_type if model_type is not None else model
    if chosen is None and lang is not None:
        return model_for_lang(lang)
    return chosen


def _load_encoder(
    model: str | None, num_layers, device, all_layers: bool, lang: str | None, from_lang: bool
) -> ScorerEncoder:
    try:
        return ScorerEncoder.from_pretrained(model, num_layers, device, all_layers=all_layers)
    except OSError as error:
        if not from_lang:
            raise
        raise OSError(
            f"lang={lang!r} picks bert_score's default model {model!r}, which could not be "
            "loaded (the Hugging Face hub is unreachable or the model is not cached). Pass a "
            "local copy instead: model_type='/path/to/model_folder' (with num_layers=N unless "
            "the folder holds a known model), or use bsloss's embedded all-MiniLM-L6-v2: "
            "model_type=None and no lang."
        ) from error


def _inputs_digest(cands: Sequence[str], groups: Sequence[Sequence[str]]) -> bytes:
    r"""16 bytes that differ for different ``cands`` / reference groups (whole inputs, not
    process shares): every field length-prefixed, so no text can imitate a separator (the
    texts may hold any character, ``\0`` included).

    >>> _inputs_digest(["a\0b"], [["c"]]) == _inputs_digest(["a"], [["b\0c"]])
    False
    """

    def field(text: str) -> bytes:
        encoded = text.encode()
        return len(encoded).to_bytes(8, "little") + encoded

    # a parseable sequence: the count of pairs, then each pair's candidate, its group's size
    # and its references
    digest = hashlib.sha256(len(cands).to_bytes(8, "little"))
    for cand, group in zip(cands, groups, strict=True):
        digest.update(field(cand) + len(group).to_bytes(8, "little"))
        for reference in group:
            digest.update(field(reference))
    return digest.digest()[:16]


def _check_progress(progress: object) -> bool | None:
    """``progress``: ``None`` (a bar only on a terminal) or a flag (:func:`check_flag`)."""
    return None if progress is None else check_flag(progress, "progress")


def get_hash(
    model: str,
    num_layers: int,
    idf: bool,
    rescale_with_baseline: bool,
    use_custom_baseline: bool,
    use_fast_tokenizer: bool,
) -> str:
    """The signature of a scoring setup in bert_score's layout, with bsloss's version (and
    torch's): ``MODEL_L{layer}_{idf|no-idf}_version=bsloss-V(hug_trans=…,torch=…)`` then
    ``-rescaled`` / ``-custom-rescaled`` and ``_fast-tokenizer``.

    >>> get_hash("roberta-large", 17, False, True, False, False).split("_version=")[0]
    'roberta-large_L17_no-idf'
    """
    import transformers

    idf = check_flag(idf, "idf")
    rescale_with_baseline = check_flag(rescale_with_baseline, "rescale_with_baseline")
    use_custom_baseline = check_flag(use_custom_baseline, "use_custom_baseline")
    use_fast_tokenizer = check_flag(use_fast_tokenizer, "use_fast_tokenizer")
    signature = (
        f"{model}_L{num_layers}{'_idf' if idf else '_no-idf'}_version=bsloss-{__version__}"
        f"(hug_trans={transformers.__version__},torch={torch.__version__})"
    )
    if rescale_with_baseline:
        signature += "-custom-rescaled" if use_custom_baseline else "-rescaled"
    if use_fast_tokenizer:
        signature += "_fast-tokenizer"
    return signature


class BERTScorer:
    """Exact BERTScore (Zhang et al., 2020) with any Hugging Face encoder; a drop-in for
    ``bert_score.BERTScorer`` (same keywords and return conventions).

    Args:
        model_type: hub name or local folder; ``None`` with no ``lang``: the embedded
            all-MiniLM-L6-v2 (bert_score requires ``model_type`` or ``lang``; bsloss does not).
            ``model`` is bsloss's name for the same argument.
        num_layers: layer whose output is used (0 = embeddings); default from the layer table.
        batch_size: sentences per encoder batch and pairs per matching batch, as a memory
            bound: a batch holds at most ``batch_size`` sentences of 128 tokens (fewer longer
            ones). On a GPU, where each batch costs the host the same whatever its size, a batch
            of shorter sentences is filled to that bound (more than ``batch_size`` of them;
            :func:`~bsloss.scorer.batching.paced_by_host`).
        nthreads: accepted for bert_score compatibility; bsloss counts idf without worker
            processes, so it has no effect.
        all_layers: score with every layer: P, R and F become ``[num_hidden_layers + 1, N]``
            (layer 0 = embeddings), as bert_score shapes them. ``num_layers`` still names the
            layer in the hash. This flag and ``rescale_with_baseline`` take a bool, a numpy
            bool, 0 or 1; any other value (a string such as ``"false"`` included) is refused.
        idf: ``False`` (uniform weights), ``True`` (idf from ``idf_sents``, or else from the
            references of each :meth:`score` call, like ``bert_score.score(idf=True)``), a list
            of sentences to compute idf from, or a ``{token_id: weight}`` dict.
        idf_sents: sentences to compute idf weights from when ``idf=True`` (bert_score's name):
            a list of strings (a string, or a bad item ``idf_sents[i]``, is refused by name);
            beside an ``idf`` list or dict, refused (pass one); with ``idf=False``, unused, as
            in bert_score.
        device: default this process's GPU when CUDA is available (its ``LOCAL_RANK``'s
            under a launcher, before the device is set), else CPU.
        lang: pick bert_score's default model for this language when ``model_type`` is None
            (``"en"``: roberta-large, ``"zh"``: bert-base-chinese, ``"tr"``:
            dbmdz/bert-base-turkish-cased, ``"en-sci"``: allenai/scibert_scivocab_uncased,
            others: bert-base-multilingual-cased); see :func:`model_for_lang`.
        rescale_with_baseline: rescale with ``(x - b) / (1 - b)``.
        baseline_path: a bert_score-format baseline file; default: the one shipped for the model.
        use_fast_tokenizer: accepted for bert_score compatibility; bsloss always tokenises with
            the tokenizer ``AutoTokenizer`` loads (the fast one), whose ids match bert_score's
            (tests/test_parity.py) under transformers 5 for WordPiece and SentencePiece
            scorers; byte-level BPE ones (RoBERTa, GPT-2, BART: ``lang="en"``'s roberta-large)
            get the leading space bert_score means to add, which bert_score 0.3.13 loses under
            transformers 5 (docs/metric.md, "Differences"); under 4.x bert_score's default slow
            tokenizer drops characters Python's Unicode tables lack (new emoji) where the fast
            one gives ``[UNK]`` (docs/metric.md, "Differences").
        autocast_dtype: fast mode: run the encoder under ``torch.autocast`` in this dtype
            (``torch.bfloat16``; ``torch.float16`` on GPU). Matching and reductions stay float32.
            The scorer's own encoder then keeps its linear weights in this dtype
            (:meth:`~bsloss.scorer.encoder.ScorerEncoder.keep_linear_weights_in`); an ``encoder``
            passed in is left as it is. ``None`` (default): exact float32.
        compile: encode through ``torch.compile`` with weight freezing
            (:meth:`~bsloss.scorer.encoder.ScorerEncoder.compile_inference`): the first calls
            compile (tens of seconds on a CPU, again for a new kind of shape: a batch of one),
            later ones are faster; for a validation set or reward scored many times.
            Needs a C++ compiler on CPU.
        long_inputs: ``"truncate"`` (as bert_score, with a warning) texts longer than the
            model's maximum, or ``"window"``: encode them whole with overlapping windows
            (:func:`~bsloss.scorer.inference.embed_windows`). idf sentences (a list as
            ``idf``, ``idf_sents``, :meth:`compute_idf`) are counted as they are scored:
            truncated with a warning, or whole in window mode, as ``idf=True`` counts the
            references.
        chunk_size: pairs scored per chunk. Embeddings live only for one chunk, so memory is
            bounded by the chunk, not by the corpus; unique sentences are encoded once per chunk.
            On a GPU a call's first chunks are smaller (1,024 pairs, then twice the one
            before: :func:`chunk_slices`), so that the encoder starts after a short
            tokenisation.
        encoder: a loaded :class:`~bsloss.scorer.encoder.ScorerEncoder` to score with (shared
            with a loss, or built once for several scorers) instead of loading ``model_type``;
            used as it is (no dtype change under ``autocast_dtype``); ``model_type``, ``model``,
            ``num_layers``, ``lang`` and ``device`` beside it are refused (they would not be
            used).
        reference_cache_size: keep the embeddings of up to this many reference texts across
            :meth:`score` calls (oldest evicted first), for a validation set or an RL reward that
            scores new candidates against the same references again and again. ``0``: no cache.
        distributed: under ``torch.distributed`` (torchrun, ``accelerate launch``), split each
            :meth:`score` call's pairs over the processes and gather the results, in input
            order, on every process. Every process must then call :meth:`score` with the same
            inputs (checked); off by default because scoring on the main process only, a common
            evaluation pattern, would wait forever for the others. Without an initialised
            process group it scores locally and warns once, saying how to start one.

    The reference cache (``reference_cache_size``) is emptied by :meth:`clear_cache`.

    Raises:
        ValueError, TypeError: an argument of the wrong type or out of range (named), or
            ``model_type`` and ``model`` naming different scorers.
        OSError: the model cannot be loaded (offline and not a local folder); for a ``lang``
            default, the message says how to pass a local copy or use the embedded scorer.
        FileNotFoundError: ``rescale_with_baseline`` without a shipped or given baseline.

    >>> import bsloss
    >>> scorer = bsloss.BERTScorer()  # embedded all-MiniLM-L6-v2, layer 6
    >>> P, R, F = scorer.score(["the cat sat on the mat"], ["a cat was sitting on the mat"])
    >>> F.shape, bool(0.5 < F[0] < 1)
    (torch.Size([1]), True)
    >>> (P, R, F), code = scorer.score(["hello there"], ["hi there"], return_hash=True)
    >>> code.startswith("sentence-transformers/all-MiniLM-L6-v2_L6_no-idf_version=")
    True
    """

    def __init__(
        self,
        model_type: str | None = None,
        num_layers: int | None = None,
        batch_size: int = 64,
        nthreads: int = 4,
        all_layers: bool = False,
        idf: IdfSpec = False,
        idf_sents: Sequence[str] | None = None,
        device: str | torch.device | None = None,
        lang: str | None = None,
        rescale_with_baseline: bool = False,
        baseline_path: str | None = None,
        use_fast_tokenizer: bool = False,
        *,
        model: str | None = None,
        autocast_dtype: torch.dtype | None = None,
        chunk_size: int = 8192,
        long_inputs: str = "truncate",
        encoder: ScorerEncoder | None = None,
        reference_cache_size: int = 0,
        compile: bool = False,
        distributed: bool = False,
    ):
        if long_inputs not in ("truncate", "window"):
            raise ValueError(f"long_inputs must be 'truncate' or 'window', got {long_inputs!r}")
        self.long_inputs = long_inputs
        # a truth test would take the string "false" as true: all layers, or rescaled scores
        all_layers = check_flag(all_layers, "all_layers")
        rescale_with_baseline = check_flag(rescale_with_baseline, "rescale_with_baseline")
        use_fast_tokenizer = check_flag(use_fast_tokenizer, "use_fast_tokenizer")
        compile = check_flag(compile, "compile")
        distributed = check_flag(distributed, "distributed")
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
        if encoder is not None:
            loading = {"model_type": model_type, "model": model, "num_layers": num_layers,
                       "lang": lang, "device": device}  # fmt: skip
            given = [name for name, value in loading.items() if value is not None]
            if given:
                raise ValueError(
                    f"encoder= is the loaded scorer; {', '.join(given)} would not be used (pass "
                    "them to ScorerEncoder.from_pretrained, or drop encoder=)"
                )
        if encoder is not None and all_layers and not encoder.all_layers:
            raise ValueError(
                "all_layers=True needs an encoder that keeps every layer: "
                "ScorerEncoder.from_pretrained(..., all_layers=True)"
            )
        if encoder is not None and encoder.all_layers and not all_layers:
            # it scored every layer anyway: [layers, N] where one layer's [N] was asked for
            raise ValueError(
                "encoder keeps every layer (ScorerEncoder.from_pretrained(..., "
                "all_layers=True)): pass all_layers=True for every layer's scores, or an "
                "encoder loaded without all_layers for one layer's"
            )
        self.lang = lang
        self.nthreads = nthreads
        self.use_fast_tokenizer = use_fast_tokenizer
        self.distributed = distributed
        self._warned_no_group = False
        if encoder is None:
            name = _pick_model(model_type, model, lang)
            from_lang = model_type is None and model is None and lang is not None
            encoder = _load_encoder(name, num_layers, device, all_layers, lang, from_lang)
            if autocast_dtype is not None:
                encoder.keep_linear_weights_in(autocast_dtype)
        self.encoder = encoder
        self.all_layers = encoder.all_layers
        self.autocast_dtype = autocast_dtype
        self._references = self._embedder(reference_cache_size)
        if compile:
            self.encoder.compile_inference()
        self.batch_size = batch_size
        self.chunk_size = chunk_size
        self.rescale = rescale_with_baseline
        self.use_custom_baseline = baseline_path is not None
        self._baseline_path = baseline_path
        self.baseline: Tensor | None = None
        if rescale_with_baseline:
            layers = range(self._layer_count()) if self.all_layers else [self.encoder.num_layers]
            rows = [load_baseline(baseline_path, self.encoder.name, k) for k in layers]
            self.baseline = torch.stack(rows) if self.all_layers else rows[0]
        idf = as_idf_spec(idf)
        if idf_sents is not None:
            # checked under its own name: list() of a string counted its characters as sentences
            idf_sents = check_texts(idf_sents, "idf_sents")
            if idf is True:
                idf = idf_sents
            elif idf is not False:
                # one of them was dropped without a word (bert_score uses idf_sents' weights)
                raise ValueError(
                    "idf_sents goes with idf=True; idf is already a "
                    f"{'dict' if isinstance(idf, Mapping) else 'list'} of weights or sentences: "
                    "pass one of the two"
                )
        self.idf = idf
        # a list is counted on the texts as they are scored: whole in window mode
        self._weight_table = weight_table(
            self.encoder, idf, self.vocab_size, truncate=self.long_inputs == "truncate"
        )
        self._custom_idf = idf_sents is not None

    # ----------------------------------------------------------------- bert_score names
    @property
    def model_type(self) -> str:
        """The scorer's model name (bert_score's ``model_type``)."""
        return self.encoder.name

    @property
    def num_layers(self) -> int:
        return self.encoder.num_layers

    @property
    def rescale_with_baseline(self) -> bool:
        return self.rescale

    @property
    def device(self) -> str:
        """The scorer's device, as a string (bert_score's ``device``: ``"cpu"``, ``"cuda:0"``)."""
        return str(self.encoder.device)

    @property
    def baseline_path(self) -> str:
        """The baseline file: the one given, else the one bsloss ships for the model, which may
        not exist (bert_score's ``baseline_path``, which also names its file either way)."""
        if self._baseline_path:
            return str(self._baseline_path)
        return str(shipped_baseline_path(self.encoder.name))

    @property
    def baseline_vals(self) -> Tensor:
        """The baseline ``[3]`` (P, R, F), ``[num_hidden_layers + 1, 1, 3]`` with all_layers.

        Raises:
            ValueError: the scorer does not rescale (bert_score reads the file lazily; bsloss
                reads it when the scorer is built).
        """
        if self.baseline is None:
            raise ValueError("this scorer was built with rescale_with_baseline=False")
        if self.all_layers:
            return self.baseline[:, None, :].float()
        return self.baseline.float()

    def compute_idf(self, sents: Sequence[str]) -> None:
        """Compute idf weights from ``sents`` (as ``bert_score.BERTScorer.compute_idf``: they are
        used when the scorer was built with ``idf=True``).

        Args:
            sents: the sentences to count document frequencies in.

        Raises:
            TypeError, ValueError: ``sents`` is not a list of valid strings (``sents``, or
                ``sents[i]`` for an item, named).
        """
        # checked under its own name (weight_table would name the items idf[i])
        sents = check_texts(sents, "sents")
        if self._custom_idf:
            warnings.warn("Overwriting the previous importance weights.", stacklevel=2)
        table = weight_table(
            self.encoder, sents, self.vocab_size, truncate=self.long_inputs == "truncate"
        )
        self._custom_idf = True
        if self.idf is not False:
            self.idf = sents
            self._weight_table = table

    def plot_example(self, candidate: str, reference: str, fname: str = "") -> Figure:
        """The similarity heatmap of one pair (:func:`bsloss.plot.draw_pair`), saved to
        ``fname`` when given. Returns the matplotlib figure."""
        return draw_pair(self, candidate, reference, fname or None)

    # ----------------------------------------------------------------- weights
    def _current_weight_table(self) -> Tensor | None:
        """The importance weights, built again for a vocabulary that has grown since (tokens
        added to the tokenizer reach the next call: with a table of the old size their ids
        indexed past its end, audit h25)."""
        table = self._weight_table
        if table is not None and table.shape[0] < self.vocab_size:
            table = weight_table(
                self.encoder, self.idf, self.vocab_size, truncate=self.long_inputs == "truncate"
            )
            self._weight_table = table
        return table

    @property
    def vocab_size(self) -> int:
        return max(len(self.encoder.tokenizer), self.encoder.input_embeddings.num_embeddings)

    @property
    def hash(self) -> str:
        """Reproducibility signature in bert_score's format (``get_hash``): model, layer, idf,
        versions, rescaling; the version names bsloss and torch too, e.g.
        ``roberta-large_L17_no-idf_version=bsloss-0.1.0(hug_trans=4.57.0,torch=2.8.0)-rescaled``.
        """
        signature = get_hash(
            self.encoder.name,
            self.encoder.num_layers,
            self.idf is not False,
            self.rescale,
            self.use_custom_baseline,
            False,  # no "_fast-tokenizer": the ids are the same whatever use_fast_tokenizer says
        )
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
            transform=self._unit_norm,  # a bound method, not a lambda: the scorer pickles
            autocast_dtype=self.autocast_dtype,
            inference_mode=True,
        )

    def _unit_norm(self, hidden: Tensor) -> Tensor:
        return _unit_norm_float32(hidden, self._layer_count())

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
        progress = _check_progress(progress)
        embedded, truncated = self._references.embed(
            texts,
            window=self.long_inputs == "window",
            batch_size=self.batch_size,
            progress=progress,
        )
        if truncated:
            where = ", ".join(f"texts[{i}]" for i, t in enumerate(texts) if t in truncated)
            warn_user(
                self.encoder.tokenization.truncation_message(len(truncated), len(embedded), where)
            )
        return embedded

    def _warn_truncated(self, long_texts: set[str], cands, groups, offset: int = 0) -> None:
        where = [f"cands[{i}]" for i, c in enumerate(cands, offset) if c in long_texts]
        for i, group in enumerate(groups, offset):
            for k, ref in enumerate(group):
                if ref in long_texts:
                    where.append(f"refs[{i}]" if len(group) == 1 else f"refs[{i}][{k}]")
        shown = ", ".join(where[:10]) + (", ..." if len(where) > 10 else "")
        total = len(cands) + sum(len(g) for g in groups)
        warn_user(self.encoder.tokenization.truncation_message(len(where), total, shown))

    def _idf_from_references(self, pair_refs: list[str]) -> Tensor:
        """idf=True: weights from this call's references (as ``bert_score.score`` does),
        counted chunk by chunk."""
        frequency = torch.zeros(self.vocab_size, dtype=torch.float64)
        for start in range(0, len(pair_refs), self.chunk_size):
            ids, _ = self.encoder.tokenization.encode(
                pair_refs[start : start + self.chunk_size],
                truncate=self.long_inputs == "truncate",
            )
            frequency += document_frequency(ids, self.vocab_size)
        return idf_from_frequency(
            frequency, len(pair_refs), self.encoder.tokenization.special_token_ids
        )

    # ----------------------------------------------------------------- scoring
    def score(
        self,
        cands: Sequence[str],
        refs: Sequence[str] | Sequence[Sequence[str]],
        verbose: bool = False,
        batch_size: int | None = None,
        return_hash: bool = False,
        *,
        progress: bool | None = None,
    ) -> ScoreResult:
        """BERTScore of each candidate against its reference(s).

        Args:
            cands: candidate texts.
            refs: one reference per candidate, or a list of references per candidate (the
                maximum of P, of R and of F is taken independently, as in bert_score).
            verbose: print progress and timing as bert_score does (and show progress bars).
            batch_size: pairs per matching batch; default: the scorer's ``batch_size``.
            return_hash: also return :attr:`hash` (a bool, a numpy bool, 0 or 1).
            progress: progress bars (``None``: only on a terminal).

        Returns:
            ``(P, R, F)``: float32 CPU tensors ``[N]`` (``[num_hidden_layers + 1, N]`` with
            ``all_layers``); ``((P, R, F), hash)`` with ``return_hash``. An empty or
            whitespace-only candidate or reference makes its pair score 0, with one warning.

        Raises:
            TypeError, ValueError: input of the wrong type, lengths that differ, an empty list of
                references, a text that is not valid Unicode, ``batch_size < 1`` (all named), or
                (``distributed=True``) processes that passed different inputs.

        >>> import bsloss
        >>> scorer = bsloss.BERTScorer()
        >>> P, R, F = scorer.score(["a cat"], [["a dog", "the cat"]])  # best of two references
        >>> bool(F[0] == scorer.score(["a cat"], ["the cat"])[2][0])
        True
        """
        try:
            cands, groups = validate_pairs(cands, refs)
            return_hash = check_flag(return_hash, "return_hash")
            verbose, progress = check_flag(verbose, "verbose"), _check_progress(progress)
            if batch_size is not None:
                batch_size = check_int(batch_size, "batch_size", 1)
        except (TypeError, ValueError):
            # distributed: the others wait in the inputs' check; it tells them, then this
            # process raises its own error (they raise one naming it)
            self._process_group([], [], valid=False)
            raise
        start_time = time.perf_counter()
        if verbose:
            print("calculating scores...")
            progress = True if progress is None else progress
        table = self._current_weight_table()
        if table is None:
            # idf from all references, on every process alike
            _, all_refs, _ = flatten_groups(cands, groups)
            table = self._idf_from_references(all_refs) if all_refs else None
        world, rank = self._process_group(cands, groups)
        lo, hi = len(cands) * rank // world, len(cands) * (rank + 1) // world
        prf = self._score_groups(cands[lo:hi], groups[lo:hi], table, batch_size, progress, lo)
        if world > 1:
            prf = self._gather(prf, len(cands), world)
        # [N, 3] -> P, R, F [N]; with all layers [N, layers, 3] -> [layers, N] as bert_score
        prf = prf.movedim(0, -2) if prf.dim() == 3 else prf
        out = tuple(prf[..., k].contiguous() for k in range(3))
        if verbose:
            elapsed = time.perf_counter() - start_time
            pairs = sum(len(g) for g in groups)
            print(f"done in {elapsed:.2f} seconds, {pairs / max(elapsed, 1e-9):.2f} sentences/sec")
        return (out, self.hash) if return_hash else out

    def _process_group(
        self, cands: list[str], groups: list[list[str]], valid: bool = True
    ) -> tuple[int, int]:
        """``(world_size, rank)`` to split over: ``(1, 0)`` unless ``distributed`` and a process
        group is up. Checks that every process passed the same inputs, valid ones: a process
        whose inputs failed validation (``valid=False``, then it raises its own error) makes
        the others raise a ``ValueError`` naming it, instead of waiting for it."""
        import torch.distributed as dist

        if not self.distributed:
            return 1, 0
        if not (dist.is_available() and dist.is_initialized()):
            if not self._warned_no_group:
                self._warned_no_group = True
                warn_user(
                    "BERTScorer(distributed=True): no torch.distributed process group is "
                    "initialised, so this process scores every pair itself. Start the processes "
                    "with `torchrun --nproc_per_node N script.py` and call "
                    "torch.distributed.init_process_group() ('gloo' on CPU, 'nccl' on GPUs) "
                    "before scoring; distributed=False scores locally without this warning"
                )
            return 1, 0
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            return 1, 0
        # the digest, and a last byte: 1 where the inputs failed validation
        digest = list(_inputs_digest(cands, groups)) + [0] if valid else [0] * 16 + [1]
        mine = torch.tensor(digest, device=self._collective_device())
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        if not valid:
            return 1, 0
        invalid = [r for r, other in enumerate(everyone) if int(other[-1]) == 1]
        if invalid:
            raise ValueError(
                f"BERTScorer(distributed=True): process(es) {invalid} passed invalid cands/refs "
                "(their error says which); no pair is scored on any process"
            )
        differ = [r for r, other in enumerate(everyone) if not torch.equal(other, everyone[0])]
        if differ:
            raise ValueError(
                f"BERTScorer(distributed=True) splits one set of pairs over the processes, but "
                f"process(es) {differ} passed different cands/refs from process 0; pass the same "
                "inputs on every process, or distributed=False to score each process's own"
            )
        return world, rank

    def _collective_device(self) -> torch.device:
        import torch.distributed as dist

        # NCCL moves CUDA tensors only; gloo CPU ones
        return self.encoder.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _gather(self, local: Tensor, n: int, world: int) -> Tensor:
        """Every process's rows, in input order (process ``r`` holds rows ``n*r//W ..``)."""
        import torch.distributed as dist

        sizes = [n * (r + 1) // world - n * r // world for r in range(world)]
        device = self._collective_device()
        padded = local.new_zeros((max(sizes), *local.shape[1:])).to(device)
        padded[: len(local)] = local.to(device)
        everyone = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(everyone, padded)
        return torch.cat([rows[:size].cpu() for rows, size in zip(everyone, sizes, strict=True)])

    def _score_groups(self, cands, groups, table, batch_size, progress, offset: int) -> Tensor:
        """``[len(cands), 3]`` (``[len(cands), layers, 3]`` with all layers) P, R, F of each
        candidate's best pair; ``offset``: position of ``cands[0]`` in the caller's list."""
        pair_cands, pair_refs, owner = flatten_groups(cands, groups)
        width = self._layer_count()
        if not pair_cands:
            return torch.zeros(len(cands), *([width] if self.all_layers else []), 3)
        table = table.to(self.encoder.device, torch.float32)
        pair_scores = torch.empty(len(pair_cands), width, 3)
        long_texts: set[str] = set()
        window = self.long_inputs == "window"
        host_paced = paced_by_host(self.encoder.device)
        chunks = chunk_slices(len(pair_cands), self.chunk_size, grow=host_paced)
        # on the CPU one tokenising thread: more would take cores from the encoder's
        ahead = TokenizeAhead(
            self._references, window, len(chunks) > 1, threads=None if host_paced else 1
        )
        # texts with nothing between the special tokens (empty, whitespace, or only what the
        # tokenizer drops, such as a zero-width space) and pairs with a side of no weight
        tokenization = self.encoder.tokenization
        specials = len(tokenization.prefix_ids) + len(tokenization.suffix_ids)
        tokenless: set[str] = set()
        weightless = torch.zeros(len(pair_cands), dtype=torch.bool)
        with ahead:
            for k, chunk in enumerate(chunks):
                texts = pair_cands[chunk] + pair_refs[chunk]
                tokenized = ahead.take(texts)
                if k + 1 < len(chunks):  # the next chunk's texts while this one is encoded
                    ahead.start(pair_cands[chunks[k + 1]] + pair_refs[chunks[k + 1]])
                embeddings, truncated = self._references.embed(
                    texts,
                    cache_texts=pair_refs[chunk],
                    window=window,
                    batch_size=self.batch_size,
                    progress=progress,
                    tokenized=tokenized,
                )
                long_texts.update(truncated)
                tokenless.update(t for t, (_, ids) in embeddings.items() if len(ids) <= specials)
                pair_scores[chunk], weightless[chunk] = self._score_pairs(
                    pair_cands[chunk],
                    pair_refs[chunk],
                    embeddings,
                    table,
                    batch_size or self.batch_size,
                )
                del embeddings
        if long_texts:
            self._warn_truncated(long_texts, cands, groups, offset)
        if self.baseline is not None:
            pair_scores = rescale_with_baseline(pair_scores, self.baseline.float())
        empty = self._empty_pairs(pair_cands, pair_refs, owner, groups, offset, tokenless)
        self._warn_weightless(weightless & ~empty, owner, groups, offset, self.baseline)
        best = best_of_owned(pair_scores.flatten(1), torch.tensor(owner), len(cands), ignore=empty)
        return best.view(len(cands), width, 3) if self.all_layers else best.view(len(cands), 3)

    def _layer_count(self) -> int:
        """Layers scored: all of them (embeddings included) with all_layers, else one."""
        return num_hidden_layers(self.encoder.model) + 1 if self.all_layers else 1

    def _score_pairs(
        self, pair_cands, pair_refs, embeddings, table, batch_size
    ) -> tuple[Tensor, Tensor]:
        """``[num_pairs, layers, 3]`` raw P, R, F, in batches of pairs of similar lengths, and
        ``[num_pairs]`` whether a text of the pair has tokens of total weight 0 (its pair scores
        0: :meth:`_warn_weightless`); the host reads both once, after the last batch (no wait
        for the device per batch)."""
        tokens = {text: ids.shape[0] for text, (_, ids) in embeddings.items()}
        pair_sizes = [(tokens[c], tokens[r]) for c, r in zip(pair_cands, pair_refs, strict=True)]
        order = sorted(range(len(pair_cands)), key=lambda i: sum(pair_sizes[i]))
        layers = self._layer_count()
        sizes = [pair_sizes[i] for i in order]
        fill = paced_by_host(self.encoder.device)
        batches = []  # each batch's [layers * B, 3] on the device: one copy to the host at the end
        for start, stop in pair_budget_batches(sizes, batch_size, fill, copies=layers):
            batch = order[start:stop]
            cand_emb, cand_mask, cand_w = pad_embedded(
                [embeddings[pair_cands[i]] for i in batch], table
            )
            ref_emb, ref_mask, ref_w = pad_embedded(
                [embeddings[pair_refs[i]] for i in batch], table
            )
            if layers > 1:  # the layers side by side -> one batch row per (layer, pair)
                cand_emb, cand_mask, cand_w = _layers_as_rows(cand_emb, cand_mask, cand_w, layers)
                ref_emb, ref_mask, ref_w = _layers_as_rows(ref_emb, ref_mask, ref_w, layers)
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
            no_weight = (cand_w.sum(-1) == 0) | (ref_w.sum(-1) == 0)  # the same in every layer
            # [layers * B, 4], layer-major: P, R, F and the flag, read back together
            stacked = torch.stack([*prf, no_weight.to(prf.f1.dtype)], dim=-1).float()
            batches.append(stacked.view(layers, len(batch), 4).transpose(0, 1))
        scores = torch.empty(len(pair_cands), layers, 4)
        scores[order] = torch.cat(batches).cpu()
        return scores[..., :3], scores[:, 0, 3] > 0

    @staticmethod
    def _empty_pairs(
        pair_cands, pair_refs, owner, groups, offset: int = 0, tokenless: Set[str] = frozenset()
    ) -> Tensor:
        """The pairs with an empty text: empty or whitespace-only, or ``tokenless`` (nothing
        the tokenizer keeps, such as a zero-width space); they score 0, with one warning."""
        empty = torch.tensor(
            [
                not c.strip() or not r.strip() or c in tokenless or r in tokenless
                for c, r in zip(pair_cands, pair_refs, strict=True)
            ],
            dtype=torch.bool,
        )
        if empty.any():
            warn_user(
                f"{int(empty.sum())} empty or whitespace-only candidate/reference pair(s) "
                "(or a text with nothing the tokenizer keeps, such as a zero-width space) "
                f"score 0: candidate index {_pair_positions(empty, owner, groups, offset)}"
            )
        return empty

    @staticmethod
    def _warn_weightless(
        weightless: Tensor, owner, groups, offset: int, baseline: Tensor | None = None
    ) -> None:
        """Pairs scored 0 because a text's tokens all weigh 0 (special tokens only, or idf
        weights of 0), as bert_score scores them in F (its P or R of that text is NaN, the
        other kept). With a ``baseline`` they are rescaled like every pair, to
        ``(0 - b) / (1 - b)`` (bert_score's F there too), and the warning gives that value:
        unlike an empty text's pair, they do not score 0 then."""
        if not weightless.any():
            return
        why = (
            "because the weights of a text's tokens sum to 0 (they are all special tokens, as "
            'in the literal text "[SEP]"; or, with idf, each is in every idf sentence: '
            "idf=True over one reference weighs every token log(2/2) = 0; bert_score gives "
        )
        if baseline is None:
            score = "score 0"
            why += "F 0 there too, and NaN as that text's P or R)"
        else:
            if baseline.dim() == 1:
                p, r, f = rescale_with_baseline(torch.zeros(3), baseline.float()).tolist()
                values = f"P {p:.3f}, R {r:.3f}, F {f:.3f}"
            else:  # all_layers: one baseline per layer
                values = "with each layer's baseline b"
            score = f"score 0 before rescaling, (0 - b) / (1 - b) after it ({values}),"
            why += "the same F there, and NaN as that text's P or R)"
        warn_user(
            f"{int(weightless.sum())} candidate/reference pair(s) {score} {why}: candidate "
            f"index {_pair_positions(weightless, owner, groups, offset)}"
        )


def _pair_positions(pairs: Tensor, owner, groups, offset: int, shown: int = 20) -> str:
    """The flagged pairs as a warning names them: the candidate's index, and the reference's
    within a group of several (``"3 (reference 1)"``), the first ``shown``.

    Only those are named: a call with a million empty candidates costs a scan of ``pairs``,
    not a name (nor a scan of ``owner``) per flagged pair. ``owner`` is sorted (pairs are
    laid out group by group), so a group's first pair is a binary search away.
    """
    flagged = pairs.nonzero().flatten()
    where = []
    for pair in flagged[:shown].tolist():
        i = owner[pair]
        at = i + offset
        if len(groups[i]) == 1:
            where.append(str(at))
        else:
            where.append(f"{at} (reference {pair - bisect.bisect_left(owner, i)})")
    return ", ".join(where) + (", ..." if len(flagged) > shown else "")


FIRST_CHUNK = 1024  # pairs in the first chunk of a call: its tokens are made before any encoding


def chunk_slices(total: int, chunk_size: int, grow: bool = False) -> list[slice]:
    """The chunks of ``total`` pairs: ``chunk_size`` each, or with ``grow`` (where the host
    sets the pace: :func:`~bsloss.scorer.batching.paced_by_host`) the first of
    :data:`FIRST_CHUNK` pairs and each next one twice the one before, up to ``chunk_size``.

    Why: a chunk's texts are tokenised on a background thread while the chunk before it is
    encoded (:class:`~bsloss.scorer.reference_cache.TokenizeAhead`), all but the first's. A
    small first chunk starts the encoder after a short tokenisation (on a GPU the first chunk's
    tokens for 16,384 texts took ~1 s before the card had work: ``benchmarks/README.md``).

    >>> [(s.start, s.stop) for s in chunk_slices(5000, 8192, grow=True)]
    [(0, 1024), (1024, 3072), (3072, 5000)]
    >>> [(s.start, s.stop) for s in chunk_slices(5000, 8192)]
    [(0, 5000)]
    """
    chunks, start, size = [], 0, min(FIRST_CHUNK, chunk_size) if grow else chunk_size
    while start < total:
        chunks.append(slice(start, min(start + size, total)))
        start, size = start + size, min(2 * size, chunk_size)
    return chunks


def _unit_norm_float32(hidden: Tensor, layers: int = 1) -> Tensor:
    if layers == 1:
        return l2_normalize(hidden.float())
    # all layers side by side: each layer's vector normalised on its own
    split = hidden.float().unflatten(-1, (layers, -1))
    return l2_normalize(split).flatten(-2)


def _layers_as_rows(emb: Tensor, mask: Tensor, weights: Tensor, layers: int):
    """``[B, L, layers * d]`` -> ``[layers * B, L, d]`` (layer-major), masks and weights
    repeated, so that one matching call scores every layer."""
    batch, length, _ = emb.shape
    rows = emb.view(batch, length, layers, -1).permute(2, 0, 1, 3)
    rows = rows.reshape(layers * batch, length, -1)
    return rows, mask.repeat(layers, 1), weights.repeat(layers, 1)


def score(
    cands: Sequence[str],
    refs: Sequence[str] | Sequence[Sequence[str]],
    model_type: str | None = None,
    num_layers: int | None = None,
    verbose: bool = False,
    idf: IdfSpec = False,
    device: str | torch.device | None = None,
    batch_size: int = 64,
    nthreads: int = 4,
    all_layers: bool = False,
    lang: str | None = None,
    return_hash: bool = False,
    rescale_with_baseline: bool = False,
    baseline_path: str | None = None,
    use_fast_tokenizer: bool = False,
    *,
    model: str | None = None,
    progress: bool | None = None,
    distributed: bool = False,
) -> ScoreResult:
    """One-shot BERTScore, a drop-in for ``bert_score.score`` (same keywords and returns).

    Args:
        cands: candidate texts.
        refs: one reference per candidate, or a list of references per candidate.
        model_type, num_layers, idf, device, batch_size, nthreads, all_layers, lang,
            rescale_with_baseline, baseline_path, use_fast_tokenizer, model, distributed: as
            in :class:`BERTScorer` (``model_type=None`` and no ``lang``: the embedded
            all-MiniLM-L6-v2).
        verbose, return_hash, progress: as in :meth:`BERTScorer.score`.

    Returns:
        ``(P, R, F)``, float32 CPU tensors ``[N]`` (``[layers, N]`` with ``all_layers``), or
        ``((P, R, F), hash)`` with ``return_hash``.

    Raises:
        TypeError, ValueError: bad inputs, named by argument and position.
        OSError: the model cannot be loaded (for ``lang``: how to pass a local model instead).

    >>> import bsloss
    >>> P, R, F = bsloss.score(["The cat sat on the mat."], ["A cat sat on a mat."])
    >>> round(float(F[0]), 2) > 0.8
    True
    """
    # before a model loads: bad flags are refused at once
    verbose, progress = check_flag(verbose, "verbose"), _check_progress(progress)
    scorer = BERTScorer(
        model_type,
        num_layers,
        batch_size=batch_size,
        nthreads=nthreads,
        all_layers=all_layers,
        idf=idf,
        device=device,
        lang=lang,
        rescale_with_baseline=rescale_with_baseline,
        baseline_path=baseline_path,
        use_fast_tokenizer=use_fast_tokenizer,
        model=model,
        distributed=distributed,
    )
    return scorer.score(cands, refs, verbose=verbose, return_hash=return_hash, progress=progress)


def plot_example(
    candidate: str,
    reference: str,
    model_type: str | BERTScorer | None = None,
    num_layers: int | None = None,
    lang: str | None = None,
    rescale_with_baseline: bool = False,
    baseline_path: str | None = None,
    use_fast_tokenizer: bool = False,
    fname: str | Path | None = "",
    *,
    scorer: BERTScorer | None = None,
    temperature: float | None = None,
    ax=None,
):
    """The similarity heatmap of one pair, a drop-in for ``bert_score.plot_example``
    (drawn by :func:`bsloss.plot.draw_pair`: each token's best match marked; with
    ``temperature`` the soft matching plan shaded).

    The positional arguments are bert_score 0.3.13's, in its order. Without ``scorer``, one is
    built from ``model_type`` / ``num_layers`` / ``lang`` / ``rescale_with_baseline`` /
    ``baseline_path`` (a :class:`BERTScorer` as ``model_type`` is taken as ``scorer``);
    ``fname=""`` saves nothing. The shading is the raw cosine similarity (not rescaled).

    Args:
        candidate, reference: the pair of texts.
        model_type, num_layers, lang, rescale_with_baseline, baseline_path,
            use_fast_tokenizer: bert_score's arguments, as for :class:`BERTScorer`.
        fname: image file to save to (``.png``, ``.pdf``); ``None`` or ``""``: not saved.
        scorer: the :class:`BERTScorer` (default: built from the arguments above, the
            embedded all-MiniLM-L6-v2 without them).
        temperature: shade the soft matching plan ``softmax(s / T)`` instead of ``s``.
        ax: a matplotlib axes to draw into.

    Returns:
        The matplotlib figure (bert_score returns ``None``; a script that ignores the return
        value runs unchanged).

    Raises:
        ImportError, TypeError, ValueError: as :func:`~bsloss.plot.draw_pair` (no matplotlib,
            a bad text, ``temperature`` or image format); a scorer that cannot be built raises
            as :class:`BERTScorer`. ``TypeError``: a ``scorer`` that is not a
            :class:`BERTScorer`, or a scorer setting (``num_layers``, ``lang``,
            ``rescale_with_baseline``, ...) beside a scorer, where it would be unused.

    >>> import bsloss
    >>> figure = bsloss.plot_example("the cat sat", "a cat was sitting")
    >>> len(figure.axes) >= 1
    True
    """
    if isinstance(model_type, BERTScorer):
        if scorer is not None:
            raise TypeError("plot_example: a scorer as model_type and scorer=; pass one")
        model_type, scorer = None, model_type
    if scorer is not None:
        if not isinstance(scorer, BERTScorer):
            raise TypeError(f"scorer must be a BERTScorer, got {type(scorer).__name__}")
        # settings of the scorer: beside a built one they would be silently unused
        given = {
            "model_type": model_type,
            "num_layers": num_layers,
            "lang": lang,
            "rescale_with_baseline": rescale_with_baseline or None,
            "baseline_path": baseline_path,
            "use_fast_tokenizer": use_fast_tokenizer or None,
        }
        for name, value in given.items():
            if value is not None:
                raise TypeError(
                    f"plot_example: {name}={value!r} is a setting of the scorer; with a "
                    "scorer, set it on the BERTScorer (or leave the scorer out)"
                )
    else:
        scorer = BERTScorer(
            model_type,
            num_layers,
            lang=lang,
            rescale_with_baseline=rescale_with_baseline,
            baseline_path=baseline_path,
            use_fast_tokenizer=use_fast_tokenizer,
        )
    return draw_pair(scorer, candidate, reference, fname or None, temperature, ax)
