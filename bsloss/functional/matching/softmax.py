r"""Soft greedy matching: a softmax-weighted average instead of the max.

.. math::  p_i = \sum_j \operatorname{softmax}_j(s_{ij}/T)\, s_{ij}, \qquad
           r_j = \sum_i \operatorname{softmax}_i(s_{ij}/T)\, s_{ij}.

As :math:`T \to 0` the weights concentrate on the argmax and :math:`p_i \to \max_j s_{ij}`; for
any :math:`T` the score lies between the mean and the max of the row, and every real partner gets
a gradient. The softmax runs over real cells only, in the log domain (logits ``s/T`` are shifted by
their max inside ``torch.softmax``), so ``T = 1e-4`` is finite.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bsloss.functional.masking import masked_logits, pair_mask, where_partnered
from bsloss.functional.matching.base import Tempered, tempered_inputs

__all__ = ["Softmax", "softmax_match"]


def _soft_average(logits: Tensor, real_sim: Tensor, valid: Tensor, dim: int) -> Tensor:
    """Softmax over ``dim`` of ``logits`` (``sim / T``) weighting ``real_sim`` (``sim``, 0 on
    padded cells)."""
    logits, has_partner = masked_logits(logits, valid, dim)
    weights = torch.softmax(logits, dim=dim)
    return where_partnered((weights * real_sim).sum(dim=dim), has_partner, dim)


def softmax_match(
    sim: Tensor, candidate_mask: Tensor, reference_mask: Tensor, *, temperature: float
) -> tuple[Tensor, Tensor]:
    """Per-token softmax-weighted scores ``([B, Lc], [B, Lr])`` from ``[B, Lc, Lr]``."""
    sim, temperature = tempered_inputs(sim, temperature)
    valid = pair_mask(candidate_mask, reference_mask)
    # shared by both directions: computed once
    logits, real_sim = sim / temperature, torch.where(valid, sim, 0.0)
    return (
        _soft_average(logits, real_sim, valid, dim=2),
        _soft_average(logits, real_sim, valid, dim=1),
    )


class Softmax(Tempered):
    """Soft greedy matching (:func:`softmax_match`): the softmax-weighted average at
    temperature ``T``.

    Args:
        temperature: ``T``, a finite number > 0 (smaller: closer to the hard max); default
            0.05.

    Raises:
        TypeError, ValueError: a ``temperature`` that is not a finite number > 0.

    >>> Softmax(temperature=0.1)
    Softmax(temperature=0.1)
    """

    name = "softmax"
    kernel = staticmethod(softmax_match)
