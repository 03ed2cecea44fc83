"""How much of the vocabulary one chunk of the fused LM-head pass takes, for both backends.

The dense path holds about four ``[N, V]`` float32 tensors (the logits, the softmax, their
gradients); a chunked pass holds a few ``[N, chunk]`` temporaries at once. Keeping each of them
at most 1/32 of the ``[N, V]`` logits keeps the pass a small share of the dense path's memory at
every number of positions, not only at the largest (at Gemma 3's 8 x 256 positions, 256 MiB
chunks made the PyTorch pass 0.22x the dense path on an H200; ``benchmarks/README.md``). Each
backend bounds the share above and below by its own sizes (GEMMs wide enough to run at speed,
few enough chunks for the host to launch).
"""

from __future__ import annotations

__all__ = ["logits_share"]

LOGITS_SHARE = 32


def logits_share(n: int, vocab: int) -> int:
    """Elements one chunk temporary may hold: 1/32 of the ``[n, vocab]`` logits.

    >>> logits_share(2048, 262_144) == 2048 * 8192
    True
    """
    return n * vocab // LOGITS_SHARE
