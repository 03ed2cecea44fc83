"""The documents of a packed (padding-free) causal batch, as rows of their own.

TRL's ``SFTConfig(packing=True)`` and ``padding_free=True`` (transformers'
``DataCollatorWithFlattening`` too) put several examples into one row and tell the model where
each starts by ``position_ids`` that restart at 0. The model's forward runs on the packed row;
the BERTScore term must not: one packed row scored as one text matched tokens across unrelated
examples against all their completions joined. :class:`PackedDocuments` cuts the term's inputs
(the forward's logits or LM-head inputs, the labels) into one padded row per document, so that
each example is scored against its own reference, as in an unpacked batch.

>>> import torch
>>> labels = torch.tensor([[-100, 6, 7, -100, 9]])
>>> documents = PackedDocuments.of(torch.tensor([[0, 1, 2, 0, 1]]), labels)
>>> documents.split(labels, fill=-100).tolist()
[[-100, 6, 7], [-100, 9, -100]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bsloss.functional.fused_expectation import IGNORE_INDEX

__all__ = ["PackedDocuments"]


@dataclass(frozen=True)
class PackedDocuments:
    """Where each document of a packed batch sits: ``index`` ``[D, W]`` flat positions into
    the batch's ``[B, T]`` grid (document ``d``'s tokens in order, padded), ``valid`` ``[D, W]``
    which of them are the document's, ``width`` the grid's ``T``."""

    index: Tensor
    valid: Tensor
    width: int

    @classmethod
    def of(cls, position_ids: Tensor | None, labels: Tensor) -> PackedDocuments | None:
        """The documents of a batch whose ``position_ids`` ``[B, T]`` restart within a row (a
        document starts wherever the position does not grow) that have a label (``labels``
        ``[B, T]``, ``-100`` elsewhere: a padding run is no document); ``None`` for a batch of
        one document a row (no ``position_ids``, none restarting, or only the first document of
        each row labelled, as in a right-padded batch), which needs no cutting.
        Two reads of the device (where the documents start, which have labels)."""
        if not isinstance(position_ids, Tensor) or position_ids.shape != labels.shape:
            return None
        batch, width = position_ids.shape
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
        flat_starts = starts.flatten().nonzero().squeeze(1).tolist()
        if len(flat_starts) <= batch:
            return None
        document = starts.flatten().cumsum(0) - 1  # each position's document
        labelled = torch.zeros(len(flat_starts), dtype=torch.long, device=labels.device)
        labelled.index_add_(0, document, (labels.flatten() != IGNORE_INDEX).long())
        keep = labelled.bool().tolist()
        ends = flat_starts[1:] + [batch * width]
        spans = [
            (start, end - start)
            for start, end, kept in zip(flat_starts, ends, keep, strict=True)
            if kept
        ]
        rows = [start // width for start, _ in spans]
        if not spans or (
            len(set(rows)) == len(rows) and all(start % width == 0 for start, _ in spans)
        ):
            # no document, or each row's only one with labels starts the row (a right-padded
            # batch given position_ids: its padding restarts them): as unpacked rows
            return None
        first = torch.tensor([start for start, _ in spans])[:, None]
        lengths = torch.tensor([length for _, length in spans])[:, None]
        offsets = torch.arange(int(lengths.max()))[None]
        valid = offsets < lengths
        index = torch.where(valid, first + offsets, first)
        return cls(index.to(labels.device), valid.to(labels.device), width)

    def place(self, document: int, position: int) -> tuple[int, int]:
        """``(b, t)``: where ``position`` of ``document`` (a place in :meth:`split`'s rows) sits
        in the packed batch, so that an error names it where the caller put it. One read of
        the device."""
        return divmod(int(self.index[document, position]), self.width)

    def split(self, values: Tensor, fill: float | int | None = None) -> Tensor:
        """``values`` ``[B, T, ...]`` as ``[D, W, ...]``, one document a row; after each
        document's end ``fill``, or (``None``) a copy of its first position, for values that
        the labels' ``-100`` there keep out of every sum (no second ``[D, W, V]`` copy)."""
        rows = values.flatten(0, 1)[self.index]
        if fill is None:
            return rows
        shape = self.valid.shape + (1,) * (rows.dim() - 2)
        return torch.where(self.valid.reshape(shape), rows, torch.as_tensor(fill, dtype=rows.dtype))
