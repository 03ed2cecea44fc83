r"""Hard greedy matching: the original BERTScore (Zhang et al., 2020, Eq. 3).

.. math::  p_i = \max_{j} s_{ij} \quad (\text{candidate token } i), \qquad
           r_j = \max_{i} s_{ij} \quad (\text{reference token } j).

The gradient of a max flows to the cell that attains it (one cell per token; ties go to the
first). Padded cells are excluded from the max; a token with no real partner scores 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bsloss.functional.masking import pair_mask
from bsloss.functional.matching.base import Matching

__all__ = ["Hard", "hard_match"]


def _masked_max(sim: Tensor, valid: Tensor, dim: int) -> Tensor:
    has_partner = valid.any(dim=dim)
    if sim.shape[dim] == 0:
        # no partner at all (a zero-length side): torch refuses a max over nothing; the score
        # is the documented 0 of a token without a real partner, as the tempered matchings give
        return sim.sum(dim=dim)
    best = sim.masked_fill(~valid, float("-inf")).max(dim=dim).values
    return torch.where(has_partner, best, torch.zeros_like(best))


def hard_match(
    sim: Tensor, candidate_mask: Tensor, reference_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-token greedy scores ``([B, Lc], [B, Lr])`` from similarities ``[B, Lc, Lr]``."""
    valid = pair_mask(candidate_mask, reference_mask)
    return _masked_max(sim, valid, dim=2), _masked_max(sim, valid, dim=1)


class Hard(Matching):
    """The original greedy BERTScore matching (:func:`hard_match`); no parameters.

    >>> Hard()
    Hard()
    """

    name = "hard"
    kernel = staticmethod(hard_match)
    is_hard = True

    def __call__(
        self, sim: Tensor, candidate_mask: Tensor, reference_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        return hard_match(sim, candidate_mask, reference_mask)
