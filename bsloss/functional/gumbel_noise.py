r"""Gumbel noise addressed by position and token id, so that a chunked pass can draw it.

Gumbel-softmax (Jang et al., 2017, Eq. 1) perturbs every logit of every position,

.. math::  y_{iv} = \mathrm{softmax}_v\big((s_{iv} + g_{iv}) / \tau\big), \qquad
    g_{iv} = -\log(-\log u_{iv}), \quad u_{iv} \sim \mathcal U(0, 1).

The chunked LM-head pass (:mod:`bsloss.functional.fused_expectation`) never holds a row's
:math:`V` logits at once and recomputes each chunk in its backward pass, so it cannot draw
:math:`g` from a stateful generator: it needs :math:`g_{iv}` as a *function* of the position
:math:`i`, the token :math:`v` and a per-call seed. Here :math:`u_{iv}` comes from a counter-based
hash (SplitMix64's finaliser, Steele et al., 2014) of ``(seed, i, v)``, mapped to the centre of
one of :math:`2^{23}` equal bins. The dense path (:func:`bsloss.distributions.token_distribution`)
draws the same function, so both paths see the same noise for the same seed and positions.

The seed is drawn from torch's default generator once per loss call (:func:`draw_seed`):
``torch.manual_seed`` makes runs reproducible and successive steps get fresh noise.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "check_seed",
    "draw_seed",
    "draw_seed_tensor",
    "gumbel_noise",
    "gumbel_perturbed",
    "gumbel_scores",
]

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_BITS = 23  # (bin + 0.5) / 2^23 < 1 - 2^-24: exact in float32, never rounded to 1


def draw_seed() -> int:
    """A 62-bit seed from torch's default (CPU) generator."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


@torch.compiler.disable
def draw_seed_tensor(device: torch.device | str) -> Tensor:
    """:func:`draw_seed` as a 0-d int64 tensor on ``device`` (the same draw). A compiled loss
    takes it as an input of its graph: a Python int there is a constant, guarded on, so every
    call's new seed compiled a new graph."""
    return torch.tensor(draw_seed(), dtype=torch.int64).to(device, non_blocking=True)


def check_seed(seed: object, name: str = "gumbel_seed") -> int | Tensor:
    """``seed`` as an int64 value (an int, or a 0-d integer tensor as
    :func:`draw_seed_tensor` gives), or a ``TypeError`` / ``ValueError`` naming ``name`` (a
    float would be truncated, and ints past int64 fail inside torch).

    >>> check_seed(2**63)
    Traceback (most recent call last):
    ValueError: gumbel_seed must be in [-2**63, 2**63), got 9223372036854775808
    """
    if isinstance(seed, Tensor):
        if seed.dim() != 0 or seed.dtype not in (torch.long, torch.int):
            raise TypeError(
                f"{name} must be an int or a 0-d int64 tensor, got a {seed.dtype} tensor of "
                f"shape {list(seed.shape)}"
            )
        return seed.long()
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(seed).__name__}")
    if not -(2**63) <= int(seed) < 2**63:
        raise ValueError(f"{name} must be in [-2**63, 2**63), got {seed}")
    return int(seed)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: Tensor) -> Tensor:
    """SplitMix64's finaliser; int64 products wrap modulo 2^64 as the unsigned ones do."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def gumbel_noise(seed: int | Tensor, rows: Tensor, tokens: Tensor, dtype: torch.dtype) -> Tensor:
    """Standard Gumbel noise ``g[rows, tokens]`` for ``seed``, broadcast over ``rows`` and
    ``tokens`` (e.g. ``[n, 1]`` positions against ``[1, chunk]`` or ``[n, k]`` token ids).

    Args:
        seed: the call's seed (:func:`draw_seed`).
        rows: int64 position ids (a flat index of the ``[B, L]`` candidate grid).
        tokens: int64 token ids.
        dtype: the result's floating dtype.

    Returns:
        ``-log(-log u)`` with ``u`` in ``(0, 1)``, in ``dtype``, of the broadcast shape.

    >>> import torch
    >>> g = gumbel_noise(7, torch.arange(3)[:, None], torch.arange(5)[None], torch.float32)
    >>> g.shape, torch.equal(g, gumbel_noise(7, torch.arange(3)[:, None],
    ...                                      torch.arange(5)[None], torch.float32))
    (torch.Size([3, 5]), True)
    """
    args = (torch.as_tensor(seed, dtype=torch.long), rows.long(), tokens.long(), dtype)
    # compiled, one opaque operator: inductor's C++ code for the wrapping int64 products over
    # positions it made itself (torch.arange in the graph) gave other numbers, and at 30k
    # tokens a heap corruption, under torch 2.13 (audit h18): signed overflow is undefined in
    # C++. Eager, the same ops without the operator's dispatch (~50 us a call on the CPU).
    if torch.compiler.is_compiling():
        return _opaque_noise(*args)
    return _hashed_noise(*args)


def _hashed_noise(seed: Tensor, rows: Tensor, tokens: Tensor, dtype: torch.dtype) -> Tensor:
    key = _mix(rows * _GOLDEN + _mix(seed))
    key = _mix(key ^ (tokens * _MIX1))
    bins = _shift_right(key, 64 - _BITS).to(torch.float32)  # < 2^23: exact
    u = (bins + 0.5) / (1 << _BITS)
    return (-torch.log(-torch.log(u))).to(dtype)


_opaque_noise = torch.library.custom_op("bsloss::gumbel_noise", _hashed_noise, mutates_args=())


@_opaque_noise.register_fake
def _(seed: Tensor, rows: Tensor, tokens: Tensor, dtype: torch.dtype) -> Tensor:
    shape = torch.broadcast_shapes(rows.shape, tokens.shape)
    return rows.new_empty(shape, dtype=dtype)


def gumbel_perturbed(scores: Tensor, seed: int | Tensor, rows: Tensor, tokens: Tensor) -> Tensor:
    """``scores + g``, ``g`` the noise of ``rows`` x ``tokens`` (broadcast to ``scores``): the one
    place the dense path, the fused chunks and the fused top-k recomputation perturb their
    scores. Not yet over the temperature: see :func:`gumbel_scores`."""
    return scores + gumbel_noise(seed, rows, tokens, scores.dtype)


def gumbel_scores(
    scores: Tensor, temperature: float, seed: int | Tensor, rows: Tensor, tokens: Tensor
) -> Tensor:
    """``(scores + g - max) / temperature``: Gumbel-softmax's scores over whole rows (the last
    dimension), shifted by each row's maximum before the division (the softmax is the same).

    Why the shift: ``(s + g) / tau`` overflows to inf below tau ~1e-37 (NaN after the softmax);
    ``s + g - max`` is at most 0, so over any tau > 0 it is at most 0 too (-inf at worst, a weight
    of 0). The maximum is a constant of the gradient (detached): the derivative is ``1 / tau``
    as without it. The chunked pass, which never holds a whole row, shifts by its running
    maximum instead (:mod:`bsloss.functional.fused_expectation`)."""
    perturbed = gumbel_perturbed(scores, seed, rows, tokens)
    return perturbed.sub_(perturbed.detach().amax(dim=-1, keepdim=True)).div_(temperature)
