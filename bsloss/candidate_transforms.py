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
:class:`~bsloss.BERTScoreLoss` were their shorthand (deprecated: pass the objects).

The order and the checks are written here once, for every kernel: :meth:`CandidateOptions.check`
validates the options against a vocabulary, and :func:`candidate_weights` applies them, in order,
to one block of scores (or probabilities). Each kernel passes its own primitive, the Gumbel noise
of its positions and token ids (:mod:`bsloss.functional.gumbel_noise`: a function of seed,
position and token id, so that the chunked pass draws, chunk by chunk, the noise the dense path
draws): the dense :func:`~bsloss.distributions.token_distribution` over the whole vocabulary, the
chunked :func:`~bsloss.functional.fused_expectation.fused_expected_inputs` over the k tokens its
running top-k kept. The chunked pass without a cut keeps the softmax implicit in its streaming
expectation and applies the one-hot to the expected row instead
(:mod:`bsloss.functional.straight_through`). Every transform works on both paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from bsloss.functional.matching import check_temperature
from bsloss.functional.matching.base import SMALLEST_TEMPERATURE
from bsloss.functional.straight_through import one_hot_straight_through
from bsloss.inputs import check_int

__all__ = [
    "CandidateOptions",
    "CandidateTransform",
    "Gumbel",
    "StraightThrough",
    "TopK",
    "candidate_weights",
    "resolve_candidate_transforms",
]


@dataclass(frozen=True)
class CandidateOptions:
    """The resolved transforms, as the kernels take them (:meth:`keywords`)."""

    top_k: int | None = None
    straight_through: bool = False
    gumbel_temperature: float | None = None

    def keywords(self) -> dict[str, Any]:
        """The options as the kernels' keywords. Not ``dataclasses.asdict``, which deep-copies
        each value: torch 2.11's Dynamo cannot trace ``copy.deepcopy`` and broke a compiled
        loss's graph there (twice a call); 2.13's can.

        >>> CandidateOptions(top_k=8).keywords()
        {'top_k': 8, 'straight_through': False, 'gumbel_temperature': None}
        """
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def check(self, vocab: int, *, from_logits: bool = True) -> None:
        """The checks every kernel makes, against a vocabulary of ``vocab`` tokens (``from_logits``:
        whether the kernel has scores to add noise to, not probabilities).

        >>> CandidateOptions(top_k=8).check(5)
        Traceback (most recent call last):
        ...
        ValueError: top_k must be in [1, 5], got 8
        """
        if self.top_k is not None:
            check_int(self.top_k, "top_k", 1)
            if self.top_k > vocab:
                raise ValueError(f"top_k must be in [1, {vocab}], got {self.top_k}")
        if not isinstance(self.straight_through, bool):
            raise TypeError(f"straight_through must be a bool, got {self.straight_through!r}")
        if self.gumbel_temperature is not None:
            if not from_logits:
                raise ValueError(
                    "Gumbel(...) (gumbel_temperature) samples from logits, not probabilities: "
                    "pass the candidates as Logits, or drop the Gumbel transform"
                )
            check_temperature(self.gumbel_temperature, "gumbel_temperature", SMALLEST_TEMPERATURE)

    @property
    def forms_weights(self) -> bool:
        """Whether the weights must be formed (a cut or a one-hot); else a kernel may keep the
        softmax implicit in its expectation."""
        return self.top_k is not None or self.straight_through


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
    """Keep the ``k`` most probable tokens of each position, renormalised; ``k >= 2`` (the
    renormalised top-1 weight is always 1: its gradient would be exactly zero).

    >>> TopK(32)
    TopK(k=32)
    >>> TopK(1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: top_k=1 gives an exactly zero gradient ...
    """

    k: int

    def __post_init__(self) -> None:
        # stored as a Python int (a numpy or tensor integer would show in the repr and hash)
        object.__setattr__(self, "k", check_int(self.k, "top_k", 1))
        if self.k == 1:
            raise ValueError(
                "top_k=1 gives an exactly zero gradient (the renormalised top-1 weight is "
                "always 1); use top_k >= 2, or TokenIds to score decoded tokens"
            )

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
    Any ``temperature`` down to float32's smallest normal number (1.2e-38; below it ``1 /
    temperature`` overflows): the scores are shifted by their maximum before the division
    (:func:`~bsloss.functional.gumbel_noise.gumbel_scores`), so a tiny one samples the
    perturbed argmax rather than overflowing.

    >>> Gumbel(0.5)
    Gumbel(temperature=0.5)
    """

    temperature: float

    def __post_init__(self) -> None:
        # below float32's smallest normal number 1 / tau overflows: the gradient is not finite;
        # stored as a Python float (a tensor would show in the repr and hash as a tensor)
        checked = check_temperature(self.temperature, "gumbel_temperature", SMALLEST_TEMPERATURE)
        object.__setattr__(self, "temperature", checked)

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
        TypeError: a string (or bytes) or another non-list as ``candidate_transforms``, an
            item that is not a :class:`CandidateTransform` (named by position; a transform's
            class, such as ``TopK`` for ``TopK(k)``, is named as one), or a
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
    # a string is iterable: it was read character by character ("" as no transforms)
    if transforms is not None and (
        isinstance(transforms, (str, bytes, bytearray)) or not isinstance(transforms, Iterable)
    ):
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


def candidate_weights(
    values: Tensor,
    options: CandidateOptions,
    *,
    perturb: Callable[[Tensor], Tensor] | None = None,
    probabilities: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The transforms, in their one order, over the last dimension of one block of ``values``:

    1. Gumbel noise, ``perturb(scores)``: the calling kernel's noise for the block's positions
       and token ids (needed with :class:`Gumbel`; scores only);
    2. the :class:`TopK` cut (skipped where the block holds ``k`` columns or fewer: the
       chunked pass hands over the ``k`` it already kept);
    3. normalisation: the softmax of scores, or probabilities renormalised;
    4. the :class:`StraightThrough` one-hot.

    Args:
        values: scores (logits over the generator temperature) or, with ``probabilities``,
            non-negative probabilities; float32 or float64.
        options: the resolved transforms (:meth:`CandidateOptions.check` already passed).
        perturb: the noise of the calling kernel (its primitive).
        probabilities: whether ``values`` are probabilities.

    Returns:
        ``(weights, indices)``: the weights over the kept columns and the columns' indices
        within the block (``None`` without a cut).

    >>> import torch
    >>> w, kept = candidate_weights(torch.tensor([[2.0, 0.0, 1.0]]), CandidateOptions(top_k=2))
    >>> kept
    tensor([[0, 2]])
    >>> w.sum().item()
    1.0
    """
    if options.gumbel_temperature is not None:
        if perturb is None or probabilities:
            raise ValueError("Gumbel noise needs scores and the kernel's noise (perturb)")
        values = perturb(values)
    indices = None
    if options.top_k is not None and values.shape[-1] > options.top_k:
        values, indices = values.topk(options.top_k, dim=-1)
        # in token order: top-k lists tied values in no set order, and the one-hot's argmax
        # must pick the smallest tied id, as argmax over the whole vocabulary does
        indices, order = indices.sort(dim=-1)
        values = values.gather(-1, order)
    if probabilities:
        tiny = torch.finfo(values.dtype).tiny
        weights = values / values.sum(dim=-1, keepdim=True).clamp_min(tiny)
    else:
        weights = torch.softmax(values, dim=-1)
    if options.straight_through:
        weights = one_hot_straight_through(weights)
    return weights, indices


def _is_transform_class(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, CandidateTransform)


def _class_hint(transform: type) -> str:
    """What to say of a transform's class given where an instance belongs."""
    example = {"TopK": "TopK(k)", "Gumbel": "Gumbel(temperature)"}.get(
        transform.__name__, f"{transform.__name__}()"
    )
    return f"{transform.__name__} is the class: pass {example}, an instance"
