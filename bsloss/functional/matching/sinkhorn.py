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
matchable) and the weights enter the final average only. As :math:`T \to 0` one step tends to the
hard max. The paper then divides by the self-similarities,
:math:`\mathrm{Sim}(x, y) = C(x, y) / \sqrt{C(x, x)\, C(y, y)}` (Eq. 6): see
:func:`bsloss.functional.bertscore.bert_score` with ``matching="sinkhorn"``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bsloss.functional.masking import pair_mask

__all__ = ["sinkhorn_match", "sinkhorn_log_plan"]


def _normalise(log_plan: Tensor, log_marginal: Tensor, dim: int) -> Tensor:
    """Rescale ``log_plan`` so that its sums along ``dim`` equal ``exp(log_marginal)``."""
    total = torch.logsumexp(log_plan, dim=dim, keepdim=True)
    total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    return log_plan - total + log_marginal


def _log_uniform(mask: Tensor) -> Tensor:
    """``log(1/n)`` on the real tokens of each sentence; ``-inf`` on padding."""
    counts = mask.sum(dim=-1, keepdim=True).clamp_min(1).to(torch.float64)
    log_mass = (-torch.log(counts)).expand_as(mask).clone()
    return log_mass.masked_fill(~mask, -math.inf)


def sinkhorn_log_plan(
    sim: Tensor,
    candidate_mask: Tensor,
    reference_mask: Tensor,
    temperature: float,
    iterations: int,
    scored_side: str,
) -> Tensor:
    """Log transport plan ``[B, Lc, Lr]`` after ``iterations`` steps; the last step normalises
    the ``scored_side`` ("candidate" rows or "reference" columns). Padded cells are ``-inf``."""
    valid = pair_mask(candidate_mask, reference_mask)
    log_a = _log_uniform(candidate_mask.bool()).to(sim.dtype)[:, :, None]  # row masses
    log_b = _log_uniform(reference_mask.bool()).to(sim.dtype)[:, None, :]  # column masses
    log_plan = (sim / temperature).masked_fill(~valid, float("-inf"))
    for _ in range(iterations):
        if scored_side == "candidate":
            log_plan = _normalise(log_plan, log_b, dim=1)
            log_plan = _normalise(log_plan, log_a, dim=2)
        else:
            log_plan = _normalise(log_plan, log_a, dim=2)
            log_plan = _normalise(log_plan, log_b, dim=1)
    return log_plan.masked_fill(~valid, float("-inf"))


def _conditional_expectation(sim: Tensor, log_plan: Tensor, valid: Tensor, dim: int) -> Tensor:
    has_partner = valid.any(dim=dim, keepdim=True)
    logits = log_plan.masked_fill(~has_partner, 0.0)
    weights = torch.softmax(logits, dim=dim)
    score = (weights * sim.masked_fill(~valid, 0.0)).sum(dim=dim)
    return torch.where(has_partner.squeeze(dim), score, torch.zeros_like(score))


def sinkhorn_match(
    sim: Tensor,
    candidate_mask: Tensor,
    reference_mask: Tensor,
    *,
    temperature: float,
    sinkhorn_iterations: int = 1,
    **_: object,
) -> tuple[Tensor, Tensor]:
    """Per-token transport scores ``([B, Lc], [B, Lr])`` from ``[B, Lc, Lr]``."""
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
