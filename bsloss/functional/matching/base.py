"""The :class:`Matching` base class, the registry of string shorthands, and parameter checks.

A matching object holds its parameters (validated once, in ``__init__``) and maps similarities
``[B, Lc, Lr]`` and the two masks to per-token scores ``(candidate [B, Lc], reference [B, Lr])``.
A subclass that sets ``name`` in its body becomes a string shorthand (``matching="softmax"``);
everything else about it (its parameters, whether it is hard or self-normalises) is read from
the object, never from the name.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from bsloss.functional.similarity import math_dtype

__all__ = [
    "Matching",
    "Tempered",
    "SHORTHANDS",
    "SMALLEST_TEMPERATURE",
    "check_temperature",
    "check_iterations",
    "tempered_inputs",
]

DEFAULT_TEMPERATURE = 0.05
"""The one default temperature of every tempered matching (``Softmax()``, ``LogSumExp()``,
``Sinkhorn()``) and of their string shorthands in ``bert_score`` and ``BERTScoreLoss``."""

SMALLEST_TEMPERATURE = torch.finfo(torch.float32).tiny
"""The smallest temperature a matching takes, float32's smallest normal number (1.2e-38): the
similarities (cosines, at most 1 in size) divided by a smaller one overflow float32 (1 / T would
pass 3.4e38), and the scores would come out NaN."""

SHORTHANDS: dict[str, type[Matching]] = {}
"""String shorthand -> matching class, filled by the subclasses that set ``name``."""


def check_temperature(
    temperature: float, name: str = "temperature", smallest: float = 0.0
) -> float:
    """A temperature must be a finite number > 0 (not a bool, not a string: ``"0.1"`` is a
    config value that was never parsed), and at least ``smallest`` (a matching's:
    :data:`SMALLEST_TEMPERATURE`).

    >>> check_temperature(1e-39, smallest=SMALLEST_TEMPERATURE)
    Traceback (most recent call last):
    ValueError: temperature must be at least 1.18e-38 (float32's smallest normal ...), got 1e-39
    """
    if isinstance(temperature, (str, bytes)):
        raise TypeError(f"{name} must be a number, got the string {temperature!r}")
    try:
        value = float(temperature)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {temperature!r}") from None
    if isinstance(temperature, bool):
        raise TypeError(f"{name} must be a number, got {temperature!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {temperature!r}")
    if value < smallest:
        raise ValueError(
            f"{name} must be at least {smallest:.3g} (float32's smallest normal number: "
            f"scores divided by a smaller one overflow), got {temperature!r}"
        )
    return value


def check_iterations(iterations: int, name: str = "iterations") -> int:
    """A number of steps must be an integer (not a bool, not a float) >= 1."""
    if isinstance(iterations, bool) or not isinstance(iterations, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer, got {type(iterations).__name__} {iterations!r}"
        )
    if iterations < 1:
        raise ValueError(f"{name} must be >= 1, got {iterations}")
    return int(iterations)


class Matching(ABC):
    """A token matching: similarities ``[B, Lc, Lr]`` -> per-token scores in both directions.

    Subclass it and implement :meth:`__call__`; the object then works wherever ``matching=`` is
    taken (:func:`bsloss.functional.bert_score`, :class:`bsloss.BERTScoreLoss`). Override
    :meth:`parameters` so that ``repr`` and ``==`` show them, and :meth:`from_shorthand` if the
    class sets ``name`` and has parameters.

    Class attributes:
        name: the string shorthand (``None``: none; setting it in the class body registers it).
        self_normalizes: :func:`~bsloss.functional.bert_score` divides by the self-similarities
            by default (Chen et al., 2020, Eq. 6).
        is_hard: the gradient flows through the argmax cells only.
    """

    name: ClassVar[str | None] = None
    self_normalizes: ClassVar[bool] = False
    is_hard: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is None:
            return
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__qualname__}.name must be a non-empty string, got {name!r}")
        known = SHORTHANDS.get(name)
        same = known is not None and (known.__module__, known.__qualname__) == (
            cls.__module__,
            cls.__qualname__,
        )
        if known is not None and not same:
            raise ValueError(
                f"the matching shorthand {name!r} is taken by {known.__module__}."
                f"{known.__qualname__}"
            )
        SHORTHANDS[name] = cls

    @abstractmethod
    def __call__(
        self, sim: Tensor, candidate_mask: Tensor, reference_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Per-token scores ``(candidate [B, Lc], reference [B, Lr])`` from ``sim``
        ``[B, Lc, Lr]`` and the bool masks ``[B, Lc]``, ``[B, Lr]`` (true on real tokens)."""

    @classmethod
    def from_shorthand(
        cls, *, temperature: float | None = None, iterations: int | None = None
    ) -> Matching:
        """The object a string shorthand names, from the legacy keywords of ``bert_score`` and
        ``BERTScoreLoss`` (``None``: the class default). Keywords it has no use for are
        ignored, as they always were for ``"hard"``."""
        return cls()

    def parameters(self) -> dict[str, object]:
        """The parameters, by ``__init__`` keyword (shown by ``repr``, compared by ``==``)."""
        return {}

    def __repr__(self) -> str:
        shown = ", ".join(f"{key}={value!r}" for key, value in self.parameters().items())
        return f"{type(self).__name__}({shown})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.parameters() == other.parameters()

    def __hash__(self) -> int:
        return hash((type(self), tuple(self.parameters().items())))


def tempered_inputs(sim: Tensor, temperature: float) -> tuple[Tensor, float]:
    """A tempered kernel's similarities, in the matching's math dtype, and its temperature,
    checked. The kernels are public and called without the objects' checks: ``T = 0`` gave NaN
    scores and ``T < 0`` a soft minimum; and float16 ends at 65504, so ``sim / T`` overflowed
    it from ``T`` of about 1.5e-5, NaN scores too (audit h28; ``bert_score`` casts before, a
    direct call did not)."""
    return sim.to(math_dtype(sim)), check_temperature(temperature, smallest=SMALLEST_TEMPERATURE)


class Tempered(Matching):
    """A matching with one temperature ``T``: its ``kernel`` (a function of the similarities,
    the masks and ``temperature=``) at the validated ``T``. A subclass sets ``kernel`` (and
    ``name`` for a shorthand); it needs nothing else.

    Args:
        temperature: ``T``, a finite number > 0 (smaller: closer to the hard max).

    Raises:
        TypeError, ValueError: a ``temperature`` that is not a finite number > 0.
    """

    kernel: ClassVar[Callable[..., tuple[Tensor, Tensor]]]

    def __init__(self, temperature: float = DEFAULT_TEMPERATURE):
        if not hasattr(type(self), "kernel"):  # it failed at its first call
            raise TypeError(f"{type(self).__name__} sets no kernel: subclass it with one")
        self.temperature = check_temperature(temperature, smallest=SMALLEST_TEMPERATURE)

    @classmethod
    def from_shorthand(
        cls, *, temperature: float | None = None, iterations: int | None = None
    ) -> Matching:
        return cls() if temperature is None else cls(temperature)

    def parameters(self) -> dict[str, object]:
        return {"temperature": self.temperature}

    def __setattr__(self, name: str, value: object) -> None:
        # the parameters are checked once, when the object is built: a temperature set to 0 later
        # gave NaN, a negative one a soft minimum, and the hash changed under a dict (audit h28)
        if name in self.__dict__ and name in self.parameters():
            raise AttributeError(
                f"{type(self).__name__}.{name} is fixed when it is built (and checked then); "
                f"make a new one, {type(self).__name__}({name}=...)"
            )
        super().__setattr__(name, value)

    def __call__(
        self, sim: Tensor, candidate_mask: Tensor, reference_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        return self.kernel(sim, candidate_mask, reference_mask, temperature=self.temperature)
