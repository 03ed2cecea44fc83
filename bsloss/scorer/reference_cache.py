"""Reference texts -> scorer token embeddings, with a bounded least-recently-used cache.

One home for the job that the metric (:class:`~bsloss.BERTScorer`), the loss
(:class:`~bsloss.BERTScoreLoss`) and the reward (:class:`~bsloss.BERTScoreReward`) share: a
validation set or an RL reward scores new candidates against the same references again and
again, so the references' embeddings are kept across calls.

The cache is
- bounded: at most ``max_size`` texts and ``max_bytes`` bytes of tensors (default
  ``DEFAULT_MAX_BYTES``, 512 MiB: long references cost ~1.5 KB a token in float32, so a count
  alone lets 10,000 of them take gigabytes), the least recently used evicted first;
- clearable: :meth:`ReferenceCache.clear`;
- keyed on what changes an embedding besides the text: the encoder's device, its weights and
  their dtype, the tokenizer's state, the autocast state and the long-input mode. When one of
  them changes, the cache starts over;
- free of autograd and inference-mode tensors: every cached tensor is a plain copy with its own
  storage (a view would keep a whole encoder batch alive; an inference tensor, made under
  ``torch.inference_mode()`` as PyTorch Lightning validates, could not be saved for backward by
  a later training call).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from bsloss.inputs import check_int
from bsloss.scorer.batching import to_device
from bsloss.scorer.encoder import ScorerEncoder
from bsloss.scorer.inference import embed_token_ids

__all__ = ["DEFAULT_MAX_BYTES", "ReferenceCache", "ReferenceEmbedder", "TokenizeAhead"]

DEFAULT_MAX_BYTES = 512 * 2**20

Embedded = tuple[Tensor, Tensor]  # token embeddings [L, d], token ids [L]
Tokenized = dict[str, tuple[list[int], bool]]  # text -> (token ids, truncated)


class ReferenceCache(Mapping[str, Embedded]):
    """A bounded LRU mapping: reference text -> (token embeddings ``[L, d]``, ids ``[L]``).

    Reading it as a mapping (``len``, iteration in eviction order, ``[text]``) does not count as
    a use; :meth:`lookup` does.

    >>> cache = ReferenceCache(max_size=1)
    >>> cache.store("a", (torch.zeros(2, 4), torch.tensor([1, 2])), False, variant=("cpu",))
    >>> cache.store("b", (torch.zeros(3, 4), torch.tensor([1, 5, 2])), False, variant=("cpu",))
    >>> list(cache)
    ['b']
    """

    def __init__(self, max_size: int = 0, max_bytes: int = DEFAULT_MAX_BYTES):
        self._entries: OrderedDict[str, Embedded] = OrderedDict()
        self._truncated: set[str] = set()
        self._variant: tuple | None = None
        self._bytes = 0
        self._max_bytes = check_int(max_bytes, "max_bytes", 0)
        self.max_size = max_size

    @property
    def max_bytes(self) -> int:
        """The most bytes the cached tensors may take (an entry larger than this is not kept)."""
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self._max_bytes = check_int(value, "max_bytes", 0)
        self._evict()

    @property
    def nbytes(self) -> int:
        """Bytes the cached tensors take now."""
        return self._bytes

    @property
    def max_size(self) -> int:
        return self._max_size

    @max_size.setter
    def max_size(self, value: int) -> None:
        self._max_size = check_int(value, "reference_cache_size", 0)
        self._evict()

    def __getitem__(self, text: str) -> Embedded:
        return self._entries[text]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def truncated(self, text: str) -> bool:
        """Whether ``text`` was truncated at the encoder's maximum length when it was cached."""
        return text in self._truncated

    def clear(self) -> None:
        self._entries.clear()
        self._truncated.clear()
        self._bytes = 0

    def lookup(self, texts: Sequence[str], variant: tuple) -> dict[str, Embedded]:
        """The cached entries among ``texts`` (each becomes the most recently used). A different
        ``variant`` than the cached entries' empties the cache first."""
        self._check_variant(variant)
        found = {}
        for text in texts:
            entry = self._entries.get(text)
            if entry is not None:
                self._entries.move_to_end(text)
                found[text] = entry
        return found

    def store(self, text: str, entry: Embedded, truncated: bool, variant: tuple) -> None:
        """Keep a plain copy of ``entry`` (its own storage, no autograd or inference tensor)."""
        if not self.max_size:
            return
        self._check_variant(variant)
        if text in self._entries:
            self._bytes -= _nbytes(self._entries.pop(text))
        if _nbytes(entry) > self._max_bytes:
            return  # it would evict everything else and still not fit
        with torch.inference_mode(False), torch.no_grad():
            copied = (entry[0].detach().clone(), entry[1].detach().clone())
        self._entries[text] = copied
        self._bytes += _nbytes(copied)
        self._entries.move_to_end(text)
        if truncated:
            self._truncated.add(text)
        else:
            self._truncated.discard(text)
        self._evict()

    def _check_variant(self, variant: tuple) -> None:
        if variant != self._variant:
            self.clear()
            self._variant = variant

    def _evict(self) -> None:
        while self._entries and (
            len(self._entries) > self._max_size or self._bytes > self._max_bytes
        ):
            oldest, entry = self._entries.popitem(last=False)
            self._bytes -= _nbytes(entry)
            self._truncated.discard(oldest)


def _nbytes(entry: Embedded) -> int:
    return sum(t.numel() * t.element_size() for t in entry)


class ReferenceEmbedder:
    """Texts -> token embeddings through a :class:`ScorerEncoder`, the references cached.

    Args:
        encoder: the scorer encoder.
        cache_size: reference texts kept across calls (``0``: none).
        transform: applied to each encoder batch's hidden states ``[B, L, d]`` (e.g. a float32
            unit normalisation); it must not change with the call.
        autocast_dtype: run the encoder under ``torch.autocast`` in this dtype, or, with
            ``None``, with autocast off. ``"ambient"``: whatever autocast the caller runs under.
        inference_mode: encode under ``torch.inference_mode()`` (the metric; its embeddings never
            meet autograd) instead of ``torch.no_grad()`` (the loss; its reference embeddings are
            matched against candidates that carry a gradient).
    """

    def __init__(
        self,
        encoder: ScorerEncoder,
        cache_size: int = 0,
        *,
        transform: Callable[[Tensor], Tensor] | None = None,
        autocast_dtype: torch.dtype | str | None = None,
        inference_mode: bool = False,
    ):
        self.encoder = encoder
        self.cache = ReferenceCache(cache_size)
        self.transform = transform
        self.autocast_dtype = autocast_dtype
        self.inference_mode = inference_mode

    def _context(self) -> ExitStack:
        stack = ExitStack()
        stack.enter_context(torch.inference_mode() if self.inference_mode else torch.no_grad())
        if self.autocast_dtype != "ambient":
            stack.enter_context(
                torch.autocast(
                    self.encoder.device.type,
                    dtype=self.autocast_dtype or torch.bfloat16,
                    enabled=self.autocast_dtype is not None,
                )
            )
        return stack

    def _variant(self, window: bool) -> tuple:
        """What an embedding depends on besides its text (read inside :meth:`_context`)."""
        device = self.encoder.device
        autocast = (
            torch.get_autocast_dtype(device.type)
            if torch.is_autocast_enabled(device.type)
            else None
        )
        weight_dtype = self.encoder.input_embeddings.weight.dtype
        return (
            str(device),
            weight_dtype,
            self.encoder.linear_weight_dtype,
            autocast,
            window,
            self.encoder.weights_key(),
            # tokens added since (docs/metric.md: they reach the next call): a cached text would
            # keep its old pieces (audit h25)
            self.encoder.tokenization.state(),
        )

    def tokenize(
        self, texts: Sequence[str], window: bool = False, threads: int | None = None
    ) -> Tokenized:
        """Each unique text's token ids and whether it was truncated: what :meth:`embed` would
        tokenise, done ahead (e.g. on another thread while the encoder works on other texts);
        ``threads``: as :meth:`~bsloss.scorer.tokenization.ScorerTokenizer.encode`."""
        unique = list(dict.fromkeys(texts))
        tokens = self.encoder.tokenization
        token_ids, too_long = tokens.encode(unique, truncate=not window, threads=threads)
        long = set(too_long) if not window else set()
        return {
            text: (ids, i in long)
            for i, (text, ids) in enumerate(zip(unique, token_ids, strict=True))
        }

    def embed(
        self,
        texts: Sequence[str],
        *,
        cache_texts: Sequence[str] = (),
        window: bool = False,
        batch_size: int = 64,
        progress: bool | None = None,
        tokenized: Tokenized | None = None,
    ) -> tuple[dict[str, Embedded], set[str]]:
        """Each unique text's ``(embeddings [L, d], ids [L])``, and the texts that were
        truncated at the encoder's maximum length (none with ``window=True``: those are encoded
        whole with overlapping windows). Cached texts are not encoded again; the texts of
        ``cache_texts`` (the references among ``texts``) are cached. ``tokenized``: the texts'
        :meth:`tokenize` (same ``window``), when it was done ahead.

        The texts must have been validated (:func:`bsloss.inputs.check_texts`).
        """
        unique = list(dict.fromkeys(texts))
        with self._context():
            variant = self._variant(window)
            embedded = self.cache.lookup(unique, variant)
            truncated = {text for text in embedded if self.cache.truncated(text)}
            missing = [text for text in unique if text not in embedded]
            if not missing:
                return embedded, truncated
            if tokenized is None:
                tokenized = self.tokenize(missing, window)
            token_ids = [tokenized[text][0] for text in missing]
            truncated.update(text for text in missing if tokenized[text][1])
            hidden = embed_token_ids(self.encoder, token_ids, batch_size, progress, self.transform)
            device = self.encoder.device
            lengths = [len(row) for row in token_ids]
            flat = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=sum(lengths))
            ids = to_device(torch.from_numpy(flat), device).split(lengths)
        new = dict(zip(missing, zip(hidden, ids, strict=True), strict=True))
        embedded.update(new)
        for text in dict.fromkeys(cache_texts):
            if text in new:
                self.cache.store(text, new[text], text in truncated, variant)
        return embedded, truncated


class TokenizeAhead:
    """Tokenise the next texts on a background thread while the caller's thread encodes others.

    A fast tokenizer's batch call leaves Python's lock while its Rust code runs, so on a GPU,
    where the caller's thread spends the time launching the encoder's kernels, the next chunk's
    tokens come at little cost. ``take`` returns the tokens of the texts last given to ``start``
    (waiting for them), or, with nothing started, tokenises ``texts`` on the caller's thread: one
    thread at a time uses the tokenizer (a fast tokenizer refuses concurrent calls that change
    its settings). Disabled (``enabled=False``): ``take`` returns ``None`` and the embedder
    tokenises as it embeds, only the texts it has not cached.
    """

    def __init__(
        self,
        embedder: ReferenceEmbedder,
        window: bool,
        enabled: bool = True,
        threads: int | None = None,
    ):
        self.embedder = embedder
        self.window = window
        self.threads = threads  # of the tokenizer's calls on the background thread
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="bsloss-tokenize")
            if enabled
            else None
        )
        self._pending: Future[Tokenized] | None = None

    def start(self, texts: Sequence[str]) -> None:
        if self._pool is not None:
            self._pending = self._pool.submit(
                self.embedder.tokenize, list(texts), self.window, self.threads
            )

    def take(self, texts: Sequence[str]) -> Tokenized | None:
        if self._pool is None:
            return None
        if self._pending is None:
            return self.embedder.tokenize(texts, self.window)
        pending, self._pending = self._pending, None
        return pending.result()

    def __enter__(self) -> TokenizeAhead:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
