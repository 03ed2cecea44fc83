"""Batching token sequences for the encoder and padding embedded sentences for the matching."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "progress_bar",
    "bucket_length",
    "bucket_rows",
    "token_budget_rows",
    "token_budget_batches",
    "paced_by_host",
    "pair_budget_batches",
    "pad_embedded",
    "to_device",
]

TOKENS_PER_SEQUENCE = 128  # token budget of a batch: batch_size * this many padded tokens


def progress_bar(iterable: Iterable, total: int, enabled: bool | None, desc: str) -> Iterable:
    """A tqdm bar (tqdm comes with transformers) when ``enabled``; ``None``: only on a
    terminal."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False)


def bucket_length(length: int, max_length: int) -> int:
    """The padded length of an encoder batch whose longest sequence has ``length`` tokens:
    rounded up to a multiple of 4 (up to 32 tokens), 8 (up to 64), 16 (up to 128) or 32, at most
    ``max_length``.

    Why: every distinct batch shape makes encoder temporaries of a new size and, under oneDNN,
    a new cached kernel. Over a long run glibc's heap then fragments and the peak memory grows
    chunk after chunk (``benchmarks/memory.py``, 10k to 100k pairs: 1.36x without buckets, 1.06x
    with these, 1.16x with lengths up to 32 kept exact). With ~30 lengths the sizes repeat and
    freed blocks are reused. The extra padding is masked out of attention; it adds 9% tokens on
    STS-B, 4% on XSum and 9% on Brown sentences, and in paired runs fast mode was no slower
    than before the buckets (fewer shapes, fewer oneDNN kernels to build).
    """
    step = 4 if length <= 32 else 8 if length <= 64 else 16 if length <= 128 else 32
    return min(-(-length // step) * step, max(max_length, length))


def bucket_rows(rows: int, max_rows: int) -> int:
    """The padded row count of an encoder batch of ``rows`` sequences, when a full batch has
    ``max_rows``: a multiple of 8 (at most ``max_rows``); fewer than 8 rows stay as they are, so
    that scoring one sentence encodes one."""
    if rows < 8:
        return rows
    return min(-(-rows // 8) * 8, max(max_rows, rows))


def paced_by_host(device: torch.device) -> bool:
    """Whether the host's work (Python, launches, tokenisation) sets the pace of the scorer's
    calls on ``device``: on a GPU, yes; on the CPU, where the arithmetic does, no.

    Where it does, the metric (an H200 encoded 2,000 Brown pairs in 0.12 s of kernels inside
    0.77 s: ``benchmarks/README.md``, "Runs 4-6") spends less of it:

    * batches of short texts are filled up to their token budget (``fill`` below): the host
      pays the same per batch whatever its rows, and 2,000 Brown pairs take 17 encoder calls
      instead of 63 (``benchmarks/launches.py``);
    * a call's first chunks are small (:func:`~bsloss.metric.chunk_slices`) and the next chunk
      is tokenised on several threads while one is encoded, so the card waits little for tokens;
    * the model gets its attention mask in the form transformers would build, so that it does not
      read the mask back to the host, a wait for the card per call
      (:mod:`~bsloss.scorer.attention_masks`; the loss's candidate pass too).

    On the CPU none of this pays: the filled batches were slower (MiniLM, 4,000 Brown pairs, 2
    threads: 28.6 s -> 32.8 s; their activations fall out of the cache), and tokenisation threads
    beside the encoder's OpenMP threads only take cores from it.
    """
    return device.type != "cpu"


def token_budget_rows(length: int, batch_size: int, fill: bool = False) -> int:
    """Sequences in a full batch of padded ``length``: ``batch_size``, fewer when that would
    exceed the token budget of ``batch_size * 128`` padded tokens; with ``fill``
    (:func:`paced_by_host`), as many as the budget holds, more than ``batch_size`` for texts
    shorter than 128 tokens."""
    budget = max(1, batch_size * TOKENS_PER_SEQUENCE // length)
    return budget if fill else min(batch_size, budget)


def token_budget_batches(
    lengths: Sequence[int], batch_size: int, fill: bool = False
) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive batches of longest-first sorted ``lengths``: at most
    ``batch_size`` sequences (any number with ``fill``) and ``batch_size * 128`` padded tokens
    each, so that a batch of long texts (whose attention grows with the square of the length) is
    smaller and the peak memory does not depend on how long the longest texts of a corpus are."""
    batches, start = [], 0
    while start < len(lengths):
        stop = min(start + token_budget_rows(lengths[start], batch_size, fill), len(lengths))
        batches.append((start, stop))
        start = stop
    return batches


def pair_budget_batches(
    sizes: Sequence[tuple[int, int]], batch_size: int, fill: bool = False, copies: int = 1
) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive batches of (candidate, reference) token counts, for the
    matching: ``batch_size`` pairs each, or with ``fill`` (:func:`paced_by_host`) as many as keep
    the batch's padded similarity matrices (``copies`` of them per pair: one per layer scored)
    within those of ``batch_size`` pairs of 128 x 128 tokens; at least one pair."""
    if not fill:
        starts = range(0, len(sizes), batch_size)
        return [(start, min(start + batch_size, len(sizes))) for start in starts]
    budget = batch_size * TOKENS_PER_SEQUENCE**2
    batches, start = [], 0
    while start < len(sizes):
        stop, longest_c, longest_r = start, 0, 0
        while stop < len(sizes):
            c, r = max(longest_c, sizes[stop][0]), max(longest_r, sizes[stop][1])
            if stop > start and (stop - start + 1) * copies * c * r > budget:
                break
            stop, longest_c, longest_r = stop + 1, c, r
        batches.append((start, stop))
        start = stop
    return batches


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A fresh host ``tensor`` (ids, lengths, masks built in Python) on ``device``, without
    waiting for it: on CUDA pinned and copied asynchronously, since a copy from pageable memory
    synchronises the stream, and one such wait per batch keeps the host from preparing the next
    batch while the card works on this one (the metric's loop set the pace on an H200:
    ``benchmarks/README.md``, "On a GPU"). The caching host allocator keeps the pinned block
    until the copy has run. Under ``torch.compile`` a plain copy: Dynamo cannot trace
    ``pin_memory`` (``loss.compile()`` failed on it on an H200, run 5)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pad_embedded(
    rows: Sequence[tuple[Tensor, Tensor]], weight_table: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(embeddings [L, d], token ids [L])`` per sentence -> padded embeddings ``[B, L, d]``,
    real-token mask ``[B, L]`` and importance weights ``weight_table[ids]`` (0 on padding).

    One gather from the sentences laid end to end (and a zero row that every padding position
    reads), with its index built on the host: a handful of kernels whatever ``B``, where
    :func:`~torch.nn.utils.rnn.pad_sequence` launches a copy per sentence (on a GPU, 64 kernel
    launches per side of a metric batch, in a loop whose pace the host sets).
    """
    embeddings = [e for e, _ in rows]
    ids = [i for _, i in rows]
    sizes = [len(i) for i in ids]
    total, width = sum(sizes), max(sizes)
    lengths = torch.tensor(sizes)
    starts = lengths.cumsum(0) - lengths
    position = torch.arange(width)
    # every padding position reads the zero row appended after the last sentence
    index = torch.where(position[None, :] < lengths[:, None], starts[:, None] + position, total)
    flat = torch.cat([*embeddings, embeddings[0].new_zeros(1, embeddings[0].shape[-1])])
    flat_ids = torch.cat([*ids, ids[0].new_zeros(1)])
    index = to_device(index, flat.device)
    mask = index != total
    rows_index = index.flatten()  # index_select: on the CPU ~4x faster than flat[index]
    padded = flat.index_select(0, rows_index).view(len(ids), width, flat.shape[-1])
    padded_ids = flat_ids.index_select(0, rows_index).view(len(ids), width)
    return padded, mask, weight_table[padded_ids] * mask
