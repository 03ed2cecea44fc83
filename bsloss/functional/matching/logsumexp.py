r"""Log-sum-exp matching: the tempered relaxed WMD ("TRWMD", Chen et al., 2020, Eq. 7).

Relaxing one marginal constraint of the entropy-regularised transport problem gives, token by
token, a smooth maximum:

.. math::  p_i = T \log \sum_j \exp(s_{ij}/T), \qquad r_j = T \log \sum_i \exp(s_{ij}/T).

:math:`\max_j s_{ij} \le p_i \le \max_j s_{ij} + T \log L_r`, so it tends to the hard score as
:math:`T \to 0`; its gradient with respect to :math:`s_{ij}` is :math:`\operatorname{softmax}_j
(s_{ij}/T)`, spread over every real partner. The sum runs over real cells only (``torch.logsumexp``
shifts by the max, so small ``T`` is stable).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bsloss._warnings import warn_user
from bsloss.functional.masking import masked_logits, pair_mask, where_partnered
from bsloss.functional.matching.base import DEFAULT_TEMPERATURE, Tempered, tempered_inputs

__all__ = ["LogSumExp", "logsumexp_match", "LARGEST_TEMPERATURE"]

LARGEST_TEMPERATURE = 1e6
"""The largest temperature :class:`LogSumExp` takes. Its scores pass the hard ones by up to
``T log Lr``, so the loss falls without bound as ``T`` grows: about -1.8e6 at ``T = 1e6`` for a
short reference, and F overflows float32 (a loss of -inf, then NaN) from about ``T = 1e19``."""


def _smooth_max(sim: Tensor, valid: Tensor, temperature: float, dim: int) -> Tensor:
    logits, has_partner = masked_logits(sim / temperature, valid, dim)
    return where_partnered(temperature * torch.logsumexp(logits, dim=dim), has_partner, dim)


def logsumexp_match(
    sim: Tensor, candidate_mask: Tensor, reference_mask: Tensor, *, temperature: float
) -> tuple[Tensor, Tensor]:
    """Per-token smooth-max scores ``([B, Lc], [B, Lr])`` from ``[B, Lc, Lr]``."""
    sim, temperature = tempered_inputs(sim, temperature)
    valid = pair_mask(candidate_mask, reference_mask)
    return (
        _smooth_max(sim, valid, temperature, dim=2),
        _smooth_max(sim, valid, temperature, dim=1),
    )


class LogSumExp(Tempered):
    """Log-sum-exp matching (:func:`logsumexp_match`): the smooth maximum at temperature ``T``.

    Args:
        temperature: ``T``, a finite number > 0 (smaller: closer to the hard max); default
            0.05.

    Raises:
        TypeError, ValueError: a ``temperature`` that is not a finite number > 0, or above
            :data:`LARGEST_TEMPERATURE`.

    Warns:
        UserWarning: for ``T > 1``: the scores then pass 1 by up to ``T log Lr`` (F > 1, a
            negative loss); the useful range is ``T`` of 0.01 to 0.2 (docs/choosing-matching.md).

    >>> LogSumExp(temperature=0.1)
    LogSumExp(temperature=0.1)
    """

    name = "logsumexp"
    kernel = staticmethod(logsumexp_match)

    def __init__(self, temperature: float = DEFAULT_TEMPERATURE):
        super().__init__(temperature)
        if self.temperature > LARGEST_TEMPERATURE:
            raise ValueError(
                f"LogSumExp's temperature must be at most {LARGEST_TEMPERATURE:g}, got "
                f"{temperature!r}: its scores pass the hard ones by up to T log Lr, so the loss "
                "falls without bound as T grows (and overflows float32 near T = 1e19)"
            )
        if self.temperature > 1:
            warn_user(
                f"LogSumExp(temperature={temperature!r}): above T = 1 its scores pass 1 by up to "
                "T log Lr (the number of reference tokens), so F exceeds 1 and the loss goes "
                "below 0; the useful temperatures are about 0.01 to 0.2"
            )
