"""The value table of the fused LM-head pass, read one vocabulary chunk at a time.

Both backends multiply each chunk's probabilities (forward) and the upstream gradient
(backward) by the chunk's rows of the ``[V, c]`` table, in the products' dtype (bfloat16 under
autocast) and, on CUDA, with rows padded by zero columns to a multiple of 8 entries, since
cuBLAS takes its fast kernels only for 16-byte aligned rows (MiniLM's ``c = 385`` ran ``p E``
and ``g E^T`` on a slow fallback: ~30 of 110 ms at Gemma 3's sizes on an H200). Making that
padded, converted table whole at every call cost two ``[V, c]`` copies (0.6 GiB at Gemma 3's
262,144 tokens, more than the pass's own chunks at 8 x 256 positions); here each chunk is
copied into one reused ``[chunk, c_padded]`` buffer instead. Zero columns change no product:
callers cut the result back to ``c``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TableChunks"]


class TableChunks:
    """Rows ``v0:v1`` of ``table`` in ``dtype``, padded with zero columns to ``width`` (a
    multiple of ``pad_to``).

    ``rows`` returns a view of one buffer that the next call overwrites: a chunk's products
    must be queued before the next chunk is read (stream order on CUDA keeps them apart). The
    buffer is as tall as the widest chunk asked for (the first, in the passes here).

    >>> table = torch.arange(6.0).view(3, 2)
    >>> chunks = TableChunks(table, torch.float32, pad_to=4)
    >>> chunks.width, chunks.rows(1, 3).tolist()
    (4, [[2.0, 3.0, 0.0, 0.0], [4.0, 5.0, 0.0, 0.0]])
    """

    def __init__(self, table: Tensor, dtype: torch.dtype, pad_to: int):
        self.table, self.dtype = table, dtype
        columns = table.shape[1]
        self.width = columns + (-columns % pad_to)
        self._buffer: Tensor | None = None

    def rows(self, v0: int, v1: int) -> Tensor:
        """``[v1 - v0, width]``: the chunk's rows, converted (and padded) in one copy."""
        part = self.table[v0:v1]
        if part.shape[1] == self.width:
            return part.to(self.dtype)  # the table itself where the dtype is already the same
        if self._buffer is None or self._buffer.shape[0] < part.shape[0]:
            # zeroed when made: the copies write only the first `columns` entries of a row
            self._buffer = part.new_zeros(part.shape[0], self.width, dtype=self.dtype)
        out = self._buffer[: part.shape[0]]
        out[:, : part.shape[1]].copy_(part)
        return out
