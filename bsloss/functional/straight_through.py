r"""The straight-through estimator of a one-hot choice (Bengio et al., 2013).

.. math::  \tilde p = \mathrm{onehot}(\arg\max_v p_v) + \big(p - \mathrm{sg}(p)\big)

is exactly the one-hot in the forward pass (the loss is the BERTScore of the chosen tokens) and
has the gradient of :math:`p` in the backward pass. The dense path
(:func:`bsloss.distributions.token_distribution`) and the fused top-k recomputation
(:mod:`bsloss.functional.fused_expectation`) both call it; the fused pass without top-k applies
the same rule to the expected row (the argmax row forward, the expectation's gradient back).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["one_hot_straight_through"]


def one_hot_straight_through(p: Tensor) -> Tensor:
    """``onehot(argmax p) + (p - sg(p))`` over the last dimension.

    >>> import torch
    >>> p = torch.tensor([[0.2, 0.5, 0.3]], requires_grad=True)
    >>> one_hot_straight_through(p)
    tensor([[0., 1., 0.]], grad_fn=<AddBackward0>)
    """
    hard = torch.zeros_like(p).scatter_(-1, p.argmax(dim=-1, keepdim=True), 1.0)
    return hard + (p - p.detach())
