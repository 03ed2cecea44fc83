"""Estimating a rescaling baseline: the mean raw P, R and F of random, unrelated sentence pairs,
layer by layer.

Zhang et al. (2020, Sec. 3) average BERTScore over 1M random Common Crawl pairs; rescaling then
maps that mean to 0 (:func:`~bsloss.functional.rescale_with_baseline`). The result is written in
bert_score's file format by :func:`~bsloss.baseline.write_baseline` (``bsloss baseline`` on the
command line).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from bsloss.inputs import check_int, check_texts
from bsloss.metric import BERTScorer

__all__ = ["compute_baseline", "random_pairs"]


def random_pairs(
    sentences: Sequence[str], num_pairs: int, seed: int
) -> tuple[list[str], list[str]]:
    """``num_pairs`` pairs of distinct, randomly chosen non-empty sentences: a line is never
    paired with itself nor with a copy of itself (a repeated line would score F = 1 against
    its copy and pull the baseline up; the draw is redone, so a corpus without repeats draws
    exactly as before).

    Raises:
        TypeError: ``seed`` or ``num_pairs`` not an integer.
        ValueError: ``num_pairs`` < 1, a negative ``seed``, or fewer than two distinct
            non-empty sentences.

    >>> random_pairs(["a", "b", " "], 2, seed=0)
    (['b', 'a'], ['a', 'b'])
    """
    num_pairs = check_int(num_pairs, "num_pairs", 1)
    # an integer: random.Random takes any hashable, and seed="0" or None drew other pairs
    # (None: different ones at every call), silently
    rng = random.Random(check_int(seed, "seed", 0))
    pool = [s for s in sentences if s.strip()]
    if len({s.strip() for s in pool}) < 2:
        raise ValueError("a baseline needs a corpus of at least two distinct non-empty sentences")
    cands, refs = [], []
    for _ in range(num_pairs):
        i, j = rng.sample(range(len(pool)), 2)
        while pool[i].strip() == pool[j].strip():
            i, j = rng.sample(range(len(pool)), 2)
        cands.append(pool[i])
        refs.append(pool[j])
    return cands, refs


def compute_baseline(
    sentences: Sequence[str],
    model: str | None = None,
    num_pairs: int = 10_000,
    seed: int = 0,
    batch_size: int = 64,
    device: str | None = None,
    progress: bool | None = None,
) -> torch.Tensor:
    """Mean raw P, R, F of random sentence pairs, for every layer ``0..L`` of ``model``.

    Args:
        sentences: the corpus the pairs are drawn from.
        model: the scorer (as for :class:`~bsloss.BERTScorer`; ``None``: the embedded one).
        num_pairs, seed: how many pairs, drawn how (:func:`random_pairs`).
        batch_size, device, progress: as for :class:`~bsloss.BERTScorer`.

    Returns:
        ``[L + 1, 3]`` float64: one row (P, R, F) per layer, the embedding output first, from
        one pass of a scorer that keeps every layer (``all_layers``): equal to one scorer per
        layer, whose passes cost 1 + 2 + ... + L layers instead of L.

    Raises:
        ValueError: see :func:`random_pairs`; a model that cannot be loaded raises as
            :class:`~bsloss.BERTScorer` does.
    """
    sentences = check_texts(sentences, "sentences")
    cands, refs = random_pairs(sentences, num_pairs, seed)
    # num_layers=0: every layer is kept anyway, and a model outside the layer table needs no
    # default layer
    scorer = BERTScorer(
        model=model, num_layers=0, all_layers=True, batch_size=batch_size, device=device
    )
    p, r, f = scorer.score(cands, refs, progress=progress)  # each [L + 1, N]
    return torch.stack([p.double().mean(1), r.double().mean(1), f.double().mean(1)], dim=1)
