"""Batching token sequences for the encoder and padding embedded sentences for the matching."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

__all__ = ["progress_bar", "token_budget_batches", "pad_embedded"]

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


def token_budget_batches(lengths: Sequence[int], batch_size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive batches of longest-first sorted ``lengths``: at most
    ``batch_size`` sequences and ``batch_size * 128`` padded tokens each, so that a batch of long
    texts (whose attention grows with the square of the length) is smaller and the peak memory
    does not depend on how long the longest texts of a corpus are."""
    budget = batch_size * TOKENS_PER_SEQUENCE
    batches, start = [], 0
    while start < len(lengths):
        stop = start + 1
        while (
            stop < len(lengths)
            and stop - start < batch_size
            and (stop - start + 1) * lengths[start] <= budget
        ):
            stop += 1
        batches.append((start, stop))
        start = stop
    return batches


def pad_embedded(
    rows: Sequence[tuple[Tensor, Tensor]], weight_table: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(embeddings [L, d], token ids [L])`` per sentence -> padded embeddings ``[B, L, d]``,
    real-token mask ``[B, L]`` and importance weights ``weight_table[ids]`` (0 on padding)."""
    embeddings = pad_sequence([e for e, _ in rows], batch_first=True)
    ids = pad_sequence([i for _, i in rows], batch_first=True)
    lengths = torch.tensor([len(i) for _, i in rows], device=embeddings.device)
    mask = torch.arange(embeddings.shape[1], device=embeddings.device)[None, :] < lengths[:, None]
    return embeddings, mask, weight_table[ids] * mask
