r"""Candidate-distribution transforms: how a generator's logits become the token weights
:math:`p_t(v)` whose expected embedding :math:`e_t = \sum_v p_t(v) E[v]` the scorer reads
(:mod:`bsloss.distributions`), as small objects that validate themselves.

- :class:`Gumbel` ``(temperature)``: Gumbel-softmax samples, :math:`\mathrm{softmax}((s + g) /
  \tau)` with :math:`g \sim \mathrm{Gumbel}(0, 1)` (Jang et al., 2017, Eq. 1);
- :class:`TopK` ``(k)``: keep the :math:`k` most probable tokens, renormalised;
- :class:`StraightThrough` ``()``: the argmax one-hot forward, the gradient of the
  probabilities backward (Bengio et al., 2013).

They apply in that order whatever the order given (noise, then the cut, then the one-hot), each
at most once. The keywords ``top_k=``, ``straight_through=`` and ``gumbel_temperature=`` of
:class:`~bsloss.BERTScoreLoss` were their shorthand (deprecated: pass the objects). The kernels
(the dense :func:`~bsloss.distributions.token_distribution` and the chunked
:func:`~bsloss.functional.fused_expectation.fused_expected_inputs`) read the resolved
:class:`CandidateOptions` and call the same per-block functions: the Gumbel noise of
:mod:`bsloss.functional.gumbel_noise` (a function of seed, position and token id, so that the
fused pass draws, chunk by chunk, the noise the dense path draws: both paths give the same
candidates for the same seed) and :mod:`bsloss.functional.straight_through`. Every transform
works on both paths.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from bsloss.functional.matching import check_temperature
from bsloss.inputs import check_int

__all__ = [
    "CandidateOptions",
    "CandidateTransform",
    "Gumbel",
    "StraightThrough",
    "TopK",
    "resolve_candidate_transforms",
]


@dataclass(frozen=True)
class CandidateOptions:
    """The resolved transforms, as the kernels take them (``dataclasses.asdict``: their
    keywords)."""

    top_k: int | None = None
    straight_through: bool = False
    gumbel_temperature: float | None = None


class CandidateTransform:
    """A change to the candidate token weights. A subclass sets the option it stands for in
    :meth:`configure`, refusing a second one."""

    def configure(self, options: CandidateOptions) -> CandidateOptions:
        raise NotImplementedError

    def _refuse_twice(self, options: CandidateOptions, field: str) -> None:
        if getattr(options, field) != getattr(CandidateOptions(), field):
            raise ValueError(f"{type(self).__name__} is given twice (or with its keyword {field})")


@dataclass(frozen=True)
class TopK(CandidateTransform):
    """Keep the ``k`` most probable tokens of each position, renormalised.

    >>> TopK(32)
    TopK(k=32)
    """

    k: int

    def __post_init__(self) -> None:
        check_int(self.k, "top_k", 1)

    def configure(self, options: CandidateOptions) -> CandidateOptions:
        self._refuse_twice(options, "top_k")
        return replace(options, top_k=int(self.k))


@dataclass(frozen=True)
class StraightThrough(CandidateTransform):
    """The argmax one-hot in the forward pass (the loss is the BERTScore of the decoded
    tokens), the gradient of the probabilities in the backward pass."""

    def configure(self, options: CandidateOptions) -> CandidateOptions:
        self._refuse_twice(options, "straight_through")
        return replace(options, straight_through=True)


@dataclass(frozen=True)
class Gumbel(CandidateTransform):
    """Gumbel-softmax samples at ``temperature`` instead of the probabilities (needs logits).

    >>> Gumbel(0.5)
    Gumbel(temperature=0.5)
    """

    temperature: float

    def __post_init__(self) -> None:
        check_temperature(self.temperature, "gumbel_temperature")

    def configure(self, options: CandidateOptions) -> CandidateOptions:
        self._refuse_twice(options, "gumbel_temperature")
        return replace(options, gumbel_temperature=float(self.temperature))


def resolve_candidate_transforms(
    transforms: CandidateTransform | Iterable[CandidateTransform] | None = None,
    *,
    top_k: int | None = None,
    straight_through: bool = False,
    gumbel_temperature: float | None = None,
) -> CandidateOptions:
    """The options of ``transforms`` (one object or several) or of their keyword shorthands.

    Args:
        transforms: :class:`CandidateTransform` objects, or ``None``.
        top_k, straight_through, gumbel_temperature: the shorthands of :class:`TopK`,
            :class:`StraightThrough` and :class:`Gumbel`.

    Returns:
        The :class:`CandidateOptions` the kernels take.

    Raises:
        TypeError: an item that is not a :class:`CandidateTransform` (named by position; a
            transform's class, such as ``TopK`` for ``TopK(k)``, is named as one), or a
            ``straight_through`` that is not a bool.
        ValueError: a transform given twice, or an invalid parameter (named).

    >>> resolve_candidate_transforms([StraightThrough(), TopK(8)])
    CandidateOptions(top_k=8, straight_through=True, gumbel_temperature=None)
    >>> resolve_candidate_transforms(top_k=8, straight_through=True)
    CandidateOptions(top_k=8, straight_through=True, gumbel_temperature=None)
    """
    if not isinstance(straight_through, bool):
        raise TypeError(f"straight_through must be a bool, got {straight_through!r}")
    if isinstance(transforms, CandidateTransform):
        transforms = [transforms]
    if _is_transform_class(transforms):
        raise TypeError(f"candidate_transforms={_class_hint(transforms)}")
    if transforms is not None and not isinstance(transforms, Iterable):
        raise TypeError(
            f"candidate_transforms must be a CandidateTransform (TopK(k), StraightThrough(), "
            f"Gumbel(temperature)) or a list of them, got {type(transforms).__name__} "
            f"{transforms!r}"
        )
    given = list(transforms or ())
    shorthand: list[CandidateTransform] = []
    if gumbel_temperature is not None:
        shorthand.append(Gumbel(gumbel_temperature))
    if top_k is not None:
        shorthand.append(TopK(top_k))
    if straight_through:
        shorthand.append(StraightThrough())
    options = CandidateOptions()
    for position, transform in enumerate(given):
        if _is_transform_class(transform):
            raise TypeError(f"candidate_transforms[{position}]={_class_hint(transform)}")
        if not isinstance(transform, CandidateTransform):
            raise TypeError(
                f"candidate_transforms[{position}] must be a CandidateTransform (TopK, "
                f"StraightThrough, Gumbel), got {type(transform).__name__} {transform!r}"
            )
        options = transform.configure(options)
    for transform in shorthand:
        options = transform.configure(options)
    return options


def _is_transform_class(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, CandidateTransform)


def _class_hint(transform: type) -> str:
    """What to say of a transform's class given where an instance belongs."""
    example = {"TopK": "TopK(k)", "Gumbel": "Gumbel(temperature)"}.get(
        transform.__name__, f"{transform.__name__}()"
    )
    return f"{transform.__name__} is the class: pass {example}, an instance"
