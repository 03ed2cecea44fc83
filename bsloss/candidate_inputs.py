"""The candidates a loss scores, as values: one small frozen type per source, each validating its
own type and shape once, where it is built.

- :class:`Logits` ``[B, L, V]`` and :class:`Probabilities` ``[B, L, V]``: the generator's
  distributions (a bare tensor passed as the candidates is :class:`Logits`);
- :class:`TokenIds` ``[B, L]``: token ids (decoded candidates);
- :class:`Embeddings` ``[B, L, d]``: the scorer's hidden states, with their importance weights,
  taken as they are;
- :class:`LMHeadInputs`: the LM head's input ``[B, L, d_model]`` with the head (its weight, or an
  :class:`~bsloss.integrations.lm_head.LMHead`, whose soft-cap it carries), so that the
  ``[B, L, V]`` logits are never materialised.

What needs the scorer (its device, the vocabulary size) is checked by
:class:`~bsloss.candidate_encoding.CandidateEncoder`. The keyword arguments these types replace
(``logits=``, ``probs=``, ``candidate_ids=``, ``embeddings=``, ``hidden_states=`` with
``output_embeddings=``, ``logit_softcap=`` and ``generator_temperature=``) are still accepted by
:class:`~bsloss.BERTScoreLoss`, through :func:`from_keywords`, with a ``DeprecationWarning``
naming the replacement.

This module is the loss's input (what is scored); :mod:`bsloss.integrations.candidates` is where
a trainer's candidates come from (teacher-forced or generated).

>>> import torch
>>> Logits(torch.zeros(2, 3, 5)).values.shape
torch.Size([2, 3, 5])
>>> TokenIds(torch.zeros(2, 3))
Traceback (most recent call last):
TypeError: candidate_ids must have an integer dtype, got torch.float32
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from bsloss._warnings import warn_user
from bsloss.functional.matching.base import check_temperature
from bsloss.inputs import as_token_ids, check_tensor, position_of_first

__all__ = [
    "CandidateInput",
    "Embeddings",
    "LMHeadInputs",
    "Logits",
    "Probabilities",
    "TokenIds",
    "as_candidates",
    "from_keywords",
]


@dataclass(frozen=True)
class CandidateInput:
    """A candidate source: its tensor (``tensor``), named in errors as ``name`` (the keyword it
    replaces), of ``kind`` dtype and ``shape`` (``[B, L]`` its first two dimensions)."""

    name: ClassVar[str]
    kind: ClassVar[str] = "float"
    shape: ClassVar[str] = "[B, L, V]"

    @property
    def tensor(self) -> Tensor:
        raise NotImplementedError

    def __post_init__(self) -> None:
        check_tensor(self.tensor, self.name, self.kind)
        if self.tensor.dim() != self.shape.count(",") + 1:
            raise ValueError(
                f"{self.name} must be {self.shape}, got shape {list(self.tensor.shape)}"
            )


@dataclass(frozen=True)
class _Values(CandidateInput):
    """A source whose tensor is its one field, ``values``."""

    values: Tensor

    @property
    def tensor(self) -> Tensor:
        return self.values


@dataclass(frozen=True)
class Logits(_Values):
    """The generator's logits ``[B, L, V]`` (the candidate transforms apply to them).

    >>> import torch
    >>> Logits(torch.zeros(2, 5))
    Traceback (most recent call last):
    ValueError: logits must be [B, L, V], got shape [2, 5]
    """

    name: ClassVar[str] = "logits"


@dataclass(frozen=True)
class Probabilities(_Values):
    """The generator's probabilities ``[B, L, V]`` (non-negative; renormalised per position, so
    a scored position must have mass: an all-zero row there is refused, naming it)."""

    name: ClassVar[str] = "probs"


@dataclass(frozen=True)
class TokenIds(CandidateInput):
    """Token ids ``[B, L]`` of the generator's vocabulary (special tokens among them, such as
    ``tokenizer(texts)``'s ``[CLS]``/``[SEP]``/``[PAD]``, are skipped, as for every candidate
    type: :meth:`bsloss.bridge.BridgeMode.special_tokens`)."""

    ids: Tensor
    name: ClassVar[str] = "candidate_ids"
    kind: ClassVar[str] = "integer"
    shape: ClassVar[str] = "[B, L]"

    @property
    def tensor(self) -> Tensor:
        return self.ids

    def __post_init__(self) -> None:
        super().__post_init__()
        # any integer dtype, held as int64 (the field is frozen: replaced once, here)
        object.__setattr__(self, "ids", as_token_ids(self.ids, self.name))


@dataclass(frozen=True)
class Embeddings(_Values):
    """The candidates as the scorer's hidden states ``[B, L, d]`` (its output, as
    :meth:`~bsloss.BERTScoreLoss.encode_references` returns them), taken as they are: the loss
    runs no scorer pass on them.

    Args:
        values: ``[B, L, d]`` hidden states.
        weights: ``[B, L]`` their importance weights, non-negative (``encode_references``
            returns them: 0 on ``[CLS]``/``[SEP]``, the idf elsewhere). Default: 1 at every
            position of the candidate mask, special tokens included; a loss with ``idf``
            refuses embeddings without weights (it cannot know their tokens).

    >>> import torch
    >>> Embeddings(torch.zeros(2, 3, 4), torch.ones(2, 4))
    Traceback (most recent call last):
    ValueError: weights must be [B, L] = [2, 3] (of the embeddings), got shape [2, 4]
    """

    weights: Tensor | None = None
    name: ClassVar[str] = "embeddings"
    shape: ClassVar[str] = "[B, L, d]"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights is None:
            return
        check_tensor(self.weights, "weights", "float")
        if tuple(self.weights.shape) != tuple(self.values.shape[:2]):
            raise ValueError(
                f"weights must be [B, L] = {list(self.values.shape[:2])} (of the embeddings), "
                f"got shape {list(self.weights.shape)}"
            )
        bad = ~torch.isfinite(self.weights) | (self.weights < 0)
        if bad.any():
            raise ValueError(
                f"weights must be finite and >= 0, got {self.weights[bad][0].item()} at "
                f"weights{position_of_first(bad)}"
            )


@dataclass(frozen=True)
class LMHeadInputs(CandidateInput):
    """The LM head's input ``hidden_states`` ``[B, L, d_model]`` and the ``head``: an
    :class:`~bsloss.integrations.lm_head.LMHead` (whose ``softcap`` this carries), an
    ``nn.Linear``, or its weight ``[V, d_model]``. The distributions
    ``softmax(softcap * tanh(h W^T / softcap) / temperature)`` are computed chunk by chunk over
    the vocabulary (:mod:`bsloss.functional.fused_expectation`), never materialised.

    Args:
        hidden_states: ``[B, L, d_model]``.
        head: the LM head, or its weight.
        softcap: the final logit soft-cap, a finite number > 0; ``None``: the head's own
            (``head.softcap``), or none.
        temperature: the generator's sampling temperature (default 1).

    >>> import torch
    >>> LMHeadInputs(torch.zeros(1, 2, 4), torch.zeros(9, 4), softcap=30.0).softcap
    30.0
    >>> LMHeadInputs(torch.zeros(1, 2, 4), torch.zeros(9, 4), temperature=0)
    Traceback (most recent call last):
    ValueError: LMHeadInputs(temperature) must be a finite number > 0, got 0
    """

    hidden_states: Tensor
    head: Tensor | nn.Module
    softcap: float | None = None
    temperature: float = 1.0
    name: ClassVar[str] = "hidden_states"
    shape: ClassVar[str] = "[B, L, d_model]"

    @property
    def tensor(self) -> Tensor:
        return self.hidden_states

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head is None:
            raise ValueError("hidden_states needs output_embeddings (the LM head or its weight)")
        softcap = getattr(self.head, "softcap", None) if self.softcap is None else self.softcap
        if softcap is not None:
            object.__setattr__(self, "softcap", check_temperature(softcap, "LMHeadInputs(softcap)"))
        temperature = check_temperature(self.temperature, "LMHeadInputs(temperature)")
        object.__setattr__(self, "temperature", temperature)


_TYPES = (Logits, Probabilities, TokenIds, Embeddings)
_KEYWORDS = {cls.name: cls for cls in _TYPES}
_HEAD_KEYWORDS = ("output_embeddings", "logit_softcap", "generator_temperature")
_REPLACEMENT = {
    "logits": "pass the tensor itself (or Logits(x)) as the candidates",
    "probs": "pass Probabilities(x) as the candidates",
    "candidate_ids": "pass TokenIds(x) as the candidates",
    "embeddings": "pass Embeddings(x) as the candidates",
    "hidden_states": (
        "pass LMHeadInputs(hidden_states, head, softcap=..., temperature=...) as the candidates "
        "(an LMHead's own: head.inputs(hidden_states))"
    ),
}


def as_candidates(candidates: object, name: str = "candidates") -> CandidateInput:
    """``candidates`` as a :class:`CandidateInput` (a bare tensor: :class:`Logits`).

    Raises:
        TypeError: anything else, naming ``name`` and the types it takes.
    """
    if isinstance(candidates, Tensor):
        return Logits(candidates)
    if isinstance(candidates, CandidateInput):
        return candidates
    raise TypeError(
        f"{name} must be a torch.Tensor (logits) or one of Logits, Probabilities, TokenIds, "
        f"Embeddings, LMHeadInputs (bsloss.candidate_inputs), got {type(candidates).__name__}"
    )


def from_keywords(
    candidates: object, keywords: dict[str, Any], method: str, allowed: tuple[str, ...] = ()
) -> CandidateInput:
    """The candidates of a call: ``candidates`` itself, or the one deprecated keyword among
    ``keywords`` (``logits=``, ``probs=``, ... with the LM head's options) as its type, with a
    ``DeprecationWarning`` naming the replacement. ``allowed``: other keywords ``method``
    takes (returned untouched in ``keywords``).

    Raises:
        TypeError: an unknown keyword (as Python's own error names it).
        ValueError: no candidates, or more than one source (named).
    """
    legacy = {
        k: keywords.pop(k) for k in [*_KEYWORDS, "hidden_states", *_HEAD_KEYWORDS] if k in keywords
    }
    unknown = [k for k in keywords if k not in allowed]
    if unknown:
        raise TypeError(f"{method}() got an unexpected keyword argument {unknown[0]!r}")
    given = [k for k, v in legacy.items() if v is not None and k not in _HEAD_KEYWORDS]
    if candidates is not None:
        given.insert(0, "candidates")
    if len(given) != 1:
        raise ValueError(
            "pass exactly one of logits, probs, candidate_ids, embeddings or hidden_states"
            + (f" (got {', '.join(given)})" if given else "")
        )
    head = {k: legacy[k] for k in _HEAD_KEYWORDS if legacy.get(k) is not None}
    source = given[0]
    if head and source != "hidden_states":
        raise ValueError(
            f"the fused LM-head pass's options go with hidden_states, not with {source}: got "
            f"{', '.join(head)} (apply a temperature or soft-cap to the logits before passing "
            "them)"
        )
    if source == "candidates":
        return as_candidates(candidates)
    warn_user(
        f"{method}({source}=...) is deprecated: {_REPLACEMENT[source]} "
        "(bsloss.candidate_inputs; see the migration table in CHANGELOG.md)",
        DeprecationWarning,
    )
    if source != "hidden_states":
        return _KEYWORDS[source](legacy[source])
    for keyword in ("logit_softcap", "generator_temperature"):  # named as the caller passed them
        if head.get(keyword) is not None:
            check_temperature(head[keyword], keyword)
    return LMHeadInputs(
        legacy[source],
        head.get("output_embeddings"),
        softcap=head.get("logit_softcap"),
        temperature=head.get("generator_temperature", 1.0),
    )
