r"""How much the BERTScore term weighs against the cross-entropy, step by step.

A training loss :math:`\mathcal L = \mathrm{CE} + w \cdot (1 - F_{\mathrm{BERT}})` needs a
:math:`w`. A fixed one (:class:`Fixed`) is the usual choice; but the sentence-level term is small
next to the CE and its gradient smaller still, so a fixed :math:`w = 1` changes little (the
short-budget study of ``recipes/RESULTS.md``). :class:`Balanced` rescales the term on every step
so that its value equals the CE's, as EMO does (Ren et al., 2023, "EMO: Earth Mover Distance
Optimization for Auto-Regressive Language Modeling", their loss
:math:`\tfrac12(\mathcal L_{\mathrm{MLE}} + \operatorname{sg}(\mathcal L_{\mathrm{MLE}} /
\mathcal L_{\mathrm{EMO}})\,\mathcal L_{\mathrm{EMO}})`):

.. math::  w = \lambda\,\operatorname{sg}\!\left(\frac{\mathrm{CE}}{1 - F_{\mathrm{BERT}}}\right)

(:math:`\operatorname{sg}`: stop-gradient), so the gradient is
:math:`\nabla\mathrm{CE} + \lambda\,\frac{\mathrm{CE}}{1-F}\,\nabla(1 - F)`. A new rule is a
small subclass of :class:`TermWeight` (``__call__(ce, term) -> w``).

>>> import torch
>>> Balanced(1.0)(torch.tensor(2.0), torch.tensor(0.5))
tensor(4.)
>>> Fixed(0.3)(torch.tensor(2.0), torch.tensor(0.5))
tensor(0.3000)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TermWeight", "Fixed", "Balanced", "check_weight", "resolve_term_weight"]


class TermWeight:
    """The weight :math:`w` of the BERTScore term, from this step's mean CE and mean term
    ``1 - F`` (both per completion token, as the trainer reduces them). The result is used
    as a constant (no gradient flows through it)."""

    def __call__(self, ce: Tensor, term: Tensor) -> Tensor:
        raise NotImplementedError


def check_weight(value: object, name: str) -> float:
    """``value`` as a float; a bool, a non-number, NaN, Inf or a negative one refused, named."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Fixed(TermWeight):
    """:math:`w = \\lambda`, the same on every step.

    Args:
        weight: :math:`\\lambda \\ge 0`.

    Raises:
        TypeError, ValueError: ``weight`` not a finite number ``>= 0``.
    """

    weight: float = 1.0

    def __post_init__(self):
        check_weight(self.weight, "Fixed(weight)")

    def __call__(self, ce: Tensor, term: Tensor) -> Tensor:
        return torch.as_tensor(float(self.weight), device=term.device)


@dataclass(frozen=True)
class Balanced(TermWeight):
    """:math:`w = \\lambda\\,\\mathrm{sg}(\\mathrm{CE} / (1 - F))`: the term weighs as much as
    the CE on every step (EMO's rescaling; see the module docstring).

    Args:
        weight: :math:`\\lambda \\ge 0` (EMO: 1, with the whole loss halved).
        min_term: the term's floor in the ratio, so that a near-perfect F does not blow the
            weight up.

    Raises:
        TypeError, ValueError: ``weight`` or ``min_term`` not a finite number (``> 0`` for
            ``min_term``).
    """

    weight: float = 1.0
    min_term: float = 1e-3

    def __post_init__(self):
        check_weight(self.weight, "Balanced(weight)")
        check_weight(self.min_term, "Balanced(min_term)")
        if self.min_term == 0:
            raise ValueError("Balanced(min_term) must be > 0")

    def __call__(self, ce: Tensor, term: Tensor) -> Tensor:
        ratio = ce.detach() / term.detach().clamp_min(self.min_term)
        return self.weight * ratio


def resolve_term_weight(weight: float | TermWeight, name: str = "weight") -> TermWeight:
    """A number is :class:`Fixed`; a :class:`TermWeight` is kept."""
    if isinstance(weight, TermWeight):
        return weight
    try:
        return Fixed(weight)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"{name} must be a finite number >= 0 or a TermWeight (Fixed, Balanced), got {weight!r}"
        ) from None
