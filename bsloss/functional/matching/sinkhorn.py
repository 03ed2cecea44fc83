r"""Sinkhorn matching: the tempered Word Mover Distance ("TWMD", Chen et al., 2020, Eq. 5-6).

The entropy-regularised transport problem between the candidate tokens (uniform mass
:math:`1/m` on each real token) and the reference tokens (:math:`1/n` each),

.. math::  \max_{\Pi \ge 0,\ \Pi 1 = 1/m,\ \Pi^\top 1 = 1/n}
           \sum_{ij} \Pi_{ij} s_{ij} - T \sum_{ij} \Pi_{ij} \log \Pi_{ij},

is solved approximately by ``iterations`` Sinkhorn steps from the Gibbs kernel
:math:`\log \Pi^{(0)} = s / T`, all in the log domain. One step (the paper's default) alternates
one normalisation of the other side's marginal and one of the side being scored, so the scored
side's marginal holds exactly. The per-token score is the plan's conditional expectation of the
similarity,

.. math::  p_i = \sum_j \frac{\Pi^{P}_{ij}}{\sum_{j'} \Pi^{P}_{ij'}} s_{ij}, \qquad
           r_j = \sum_i \frac{\Pi^{R}_{ij}}{\sum_{i'} \Pi^{R}_{i'j}} s_{ij},

so that with uniform token weights :math:`P = \sum_{ij} \Pi^P_{ij} s_{ij}` as in the paper. With
importance (idf) weights the transport marginals stay uniform over real tokens (so CLS/SEP remain
matchable) and the weights enter the final average only.

Unlike the other matchings this does *not* tend to the hard max as :math:`T \to 0`: one step
first normalises each reference column, so :math:`p_i \to s_{ij^*}` with
:math:`j^* = \arg\max_j (s_{ij} - \max_{i'} s_{i'j})`, the partner for which :math:`i` is the
best candidate token (many steps tend to exact optimal transport, the WMD). Both coincide with
the hard max when best matches are mutual, e.g. for a sentence against itself.

The paper then divides by the self-similarities,
:math:`\mathrm{Sim}(x, y) = C(x, y) / \sqrt{C(x, x)\, C(y, y)}` (Eq. 6): see
:func:`bsloss.functional.bertscore.bert_score` with ``matching="sinkhorn"``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bsloss.functional.masking import masked_logits, pair_mask, where_partnered
from bsloss.functional.matching.base import (
    DEFAULT_TEMPERATURE,
    SMALLEST_TEMPERATURE,
    Tempered,
    check_iterations,
    check_temperature,
    tempered_inputs,
)

__all__ = ["Sinkhorn", "sinkhorn_match", "sinkhorn_log_plan"]


def _normalise(log_plan: Tensor, log_marginal: Tensor, dim: int) -> Tensor:
    """Rescale ``log_plan`` so that its sums along ``dim`` equal ``exp(log_marginal)``."""
    return log_plan - torch.logsumexp(log_plan, dim=dim, keepdim=True) + log_marginal


def _log_uniform(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``log(1/n)`` on each sentence's ``n`` real tokens (padded slots: any finite value)."""
    counts = mask.sum(dim=-1, keepdim=True).clamp_min(1).to(dtype)
    return (-torch.log(counts)).expand(mask.shape)


def sinkhorn_log_plan(
    sim: Tensor,
    candidate_mask: Tensor,
    reference_mask: Tensor,
    temperature: float,
    iterations: int,
    scored_side: str,
) -> Tensor:
    """Log transport plan ``[B, Lc, Lr]`` after ``iterations`` steps; the last step normalises
    the ``scored_side`` ("candidate" rows or "reference" columns). Padded cells hold a large
    negative finite number (re-imposed after every step, so no padded mass leaks in and no
    ``-inf - -inf`` appears in the backward pass)."""
    valid = pair_mask(candidate_mask, reference_mask)
    floor = torch.finfo(sim.dtype).min / 4
    log_a = _log_uniform(candidate_mask.bool(), sim.dtype)[:, :, None]  # row masses
    log_b = _log_uniform(reference_mask.bool(), sim.dtype)[:, None, :]  # column masses
    log_plan = torch.where(valid, sim / temperature, floor)
    steps = [(log_b, 1), (log_a, 2)] if scored_side == "candidate" else [(log_a, 2), (log_b, 1)]
    for _ in range(iterations):
        for log_marginal, dim in steps:
            log_plan = torch.where(valid, _normalise(log_plan, log_marginal, dim), floor)
    return log_plan


def _conditional_expectation(sim: Tensor, log_plan: Tensor, valid: Tensor, dim: int) -> Tensor:
    logits, has_partner = masked_logits(log_plan, valid, dim)
    weights = torch.softmax(logits, dim=dim)
    score = (weights * sim.masked_fill(~valid, 0.0)).sum(dim=dim)
    return where_partnered(score, has_partner, dim)


def sinkhorn_match(
    sim: Tensor,
    candidate_mask: Tensor,
    reference_mask: Tensor,
    *,
    temperature: float,
    sinkhorn_iterations: int = 1,
) -> tuple[Tensor, Tensor]:
    """Per-token transport scores ``([B, Lc], [B, Lr])`` from ``[B, Lc, Lr]``."""
    sim, temperature = tempered_inputs(sim, temperature)
    sinkhorn_iterations = check_iterations(sinkhorn_iterations, "sinkhorn_iterations")
    valid = pair_mask(candidate_mask, reference_mask)
    plan_p = sinkhorn_log_plan(
        sim, candidate_mask, reference_mask, temperature, sinkhorn_iterations, "candidate"
    )
    plan_r = sinkhorn_log_plan(
        sim, candidate_mask, reference_mask, temperature, sinkhorn_iterations, "reference"
    )
    return (
        _conditional_expectation(sim, plan_p, valid, dim=2),
        _conditional_expectation(sim, plan_r, valid, dim=1),
    )


class Sinkhorn(Tempered):
    """Sinkhorn matching (:func:`sinkhorn_match`): ``iterations`` log-domain Sinkhorn steps at
    temperature ``T``. It self-normalises: :func:`~bsloss.functional.bert_score` divides by the
    self-similarities by default (Chen et al., 2020, Eq. 6).

    Args:
        temperature: ``T``, a finite number > 0.
        iterations: Sinkhorn steps, an integer >= 1 (1 as in Chen et al.; many steps tend to
            exact optimal transport).

    Raises:
        TypeError, ValueError: a ``temperature`` that is not a finite number > 0, or
            ``iterations`` that is not an integer >= 1.

    >>> Sinkhorn(temperature=0.1, iterations=2)
    Sinkhorn(temperature=0.1, iterations=2)
    """

    name = "sinkhorn"
    kernel = staticmethod(sinkhorn_match)
    self_normalizes = True

    def __init__(self, temperature: float = DEFAULT_TEMPERATURE, iterations: int = 1):
        self.temperature = check_temperature(temperature, smallest=SMALLEST_TEMPERATURE)
        self.iterations = check_iterations(iterations)

    @classmethod
    def from_shorthand(
        cls, *, temperature: float | None = None, iterations: int | None = None
    ) -> Sinkhorn:
        options: dict[str, float | int] = {}
        if temperature is not None:
            options["temperature"] = temperature
        if iterations is not None:
            options["iterations"] = iterations
        return cls(**options)

    def parameters(self) -> dict[str, object]:
        return {"temperature": self.temperature, "iterations": self.iterations}

    def __call__(
        self, sim: Tensor, candidate_mask: Tensor, reference_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        return sinkhorn_match(
            sim,
            candidate_mask,
            reference_mask,
            temperature=self.temperature,
            sinkhorn_iterations=self.iterations,
        )
