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

__all__ = [
    "TermWeight",
    "Fixed",
    "Balanced",
    "check_balance",
    "check_weight",
    "evaluate_term_weight",
    "resolve_term_weight",
]

# Balanced's floor on the term: a smaller one rounds to 0 in float32, and the ratio to inf
SMALLEST_TERM = torch.finfo(torch.float32).tiny


class TermWeight:
    """The weight :math:`w` of the BERTScore term, from this step's mean CE and mean term
    ``1 - F`` (both per completion token, as the trainer reduces them; the CE is measured
    whatever the term's ``ce_weight``).

    :class:`~bsloss.integrations.huggingface.BERTScoreTerm` treats the result as a constant:
    it passes ``ce`` and ``term`` detached and stops the gradient through the result, so a
    rule needs no ``.detach()`` of its own. It checks the result on every step: one finite
    number ``>= 0`` (a float or a one-element tensor), or a ``ValueError`` naming the rule's
    class, the value and the step's CE and term.

    >>> class Halved(TermWeight):
    ...     def __call__(self, ce, term):
    ...         return ce / 2
    >>> Halved()(torch.tensor(3.0), torch.tensor(0.5))
    tensor(1.5000)
    """

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

    It balances the term against the CE, so it needs the CE in the loss:
    :class:`~bsloss.integrations.huggingface.BERTScoreTerm` refuses it with ``ce_weight=0``.

    Args:
        weight: :math:`\\lambda \\ge 0` (EMO: 1, with the whole loss halved).
        min_term: the term's floor in the ratio, so that a near-perfect F does not blow the
            weight up; at least float32's smallest normal number (``1.1754944e-38``), below
            which it would round to 0 and a term of 0 would make the loss NaN.

    Raises:
        TypeError, ValueError: ``weight`` or ``min_term`` not a finite number ``>= 0``, or a
            ``min_term`` below float32's smallest normal number.
    """

    weight: float = 1.0
    min_term: float = 1e-3

    def __post_init__(self):
        check_weight(self.weight, "Balanced(weight)")
        check_weight(self.min_term, "Balanced(min_term)")
        if self.min_term < SMALLEST_TERM:
            raise ValueError(
                f"Balanced(min_term) must be >= {SMALLEST_TERM:.8g} (float32's smallest normal "
                f"number; the ratio is computed in float32), got {self.min_term!r}"
            )

    def __call__(self, ce: Tensor, term: Tensor) -> Tensor:
        ratio = ce.detach().float() / term.detach().float().clamp_min(self.min_term)
        return self.weight * ratio


def evaluate_term_weight(rule: TermWeight, ce: Tensor, term: Tensor) -> Tensor:
    """``rule``'s weight for this step as a constant: ``rule(ce, term)`` on detached inputs,
    its result detached (a rule written without ``.detach()`` does not send gradient through
    the weight) and checked. Checking reads the value back, a wait for a GPU at every step;
    a :class:`Fixed` weight, checked when it was made, is not read back.

    Returns:
        A 0-dim float32 tensor on ``term``'s device, without gradient.

    Raises:
        TypeError: the result is not a number or a one-element tensor.
        ValueError: the result is NaN, infinite or negative (the rule's class, the value, the
            CE and the term named).

    >>> evaluate_term_weight(Balanced(1.0), torch.tensor(2.0), torch.tensor(0.5))
    tensor(4.)
    """
    if type(rule) is Fixed:
        # checked when it was made (frozen): nothing to read back from the device, no wait
        return torch.full((), rule.weight, dtype=torch.float32, device=term.device)
    ce, term = ce.detach(), term.detach()
    name = type(rule).__name__
    value = rule(ce, term)
    try:
        value = torch.as_tensor(value, dtype=torch.float32, device=term.device).detach()
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"the term weight {name} must return a number or a one-element tensor, got "
            f"{type(value).__name__} {value!r}"
        ) from None
    if value.numel() != 1:
        raise TypeError(
            f"the term weight {name} must return one number, got a tensor of shape "
            f"{list(value.shape)}"
        )
    number = value.item()
    if not math.isfinite(number) or number < 0:
        raise ValueError(
            f"the term weight {name} returned {number!r} (ce={ce.item():.6g}, "
            f"term={term.item():.6g}): a weight must be a finite number >= 0"
        )
    return value.reshape(())


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


def check_balance(weight: TermWeight, ce_weight: float) -> None:
    """Refuse :class:`Balanced` without the CE it balances against: with ``ce_weight=0`` the
    loss's value would be the CE, which is not trained, and the term's step size would follow
    that CE as it drifts (a BERTScore-only loss takes a fixed weight)."""
    if isinstance(weight, Balanced) and ce_weight == 0:
        raise ValueError(
            f"weight={weight!r} scales the term to the cross-entropy's value, but ce_weight=0 "
            "leaves the cross-entropy out of the loss: use a number (a fixed weight) for a "
            "BERTScore-only loss, or a ce_weight > 0"
        )
