r"""A model's forward pass that stops before its LM head, and the one token cross-entropy.

A language model's last step, :math:`z = \kappa \tanh\big((h W^\top + b) / \kappa\big)`, makes
``[B, L, V]`` logits: 4 GB in float32 for a batch of 16 x 256 tokens of Gemma 3's 262,144-token
vocabulary. Training needs them only inside two sums over the vocabulary, the cross-entropy's
normaliser and the BERTScore loss's expected embedding, which
:mod:`bsloss.functional.fused_expectation` computes chunk by chunk from :math:`h` and :math:`W`.

:func:`lm_head_inputs` is the model's own forward with the head taken out: inside the block the
output-embedding module is a pass-through (so ``outputs.logits`` are the head's input
:math:`h`), a soft-cap (Gemma 2's ``final_logit_softcapping``) and BART's ``final_logits_bias``
are off, and the block yields the head (:class:`LMHead`: weight, bias, soft-cap) to give
:class:`~bsloss.BERTScoreLoss` as ``output_embeddings=``. It works for causal and
encoder-decoder models, tied or untied heads, under DDP (the head's weight is a parameter of the
model; its gradient arrives in the same backward pass) and under FSDP 2 (``fully_shard``): there
the head's weight is sharded outside its unit's forward, so the chunked computation runs through
:meth:`LMHead.run`, which calls it as a forward method of that unit
(``torch.distributed.fsdp.register_fsdp_forward_method``): FSDP gathers the weight before,
re-shards it after, gathers it again for the backward pass and reduce-scatters its gradient.
The first FSDP (the ``FullyShardedDataParallel`` wrapper) is refused, named: it gathers only
inside its wrapper's ``forward``; use ``fully_shard`` or the dense path
(``BERTScoreTrainerMixin(bertscore_fused=False)``).

:func:`token_cross_entropy` is the package's one cross-entropy of target tokens, from dense
logits or chunked from :math:`h` and the head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from bsloss.functional.fused_expectation import IGNORE_INDEX, fused_token_log_likelihood
from bsloss.inputs import check_targets_shape

__all__ = ["IGNORE_INDEX", "LMHead", "lm_head_inputs", "token_cross_entropy"]


class LMHead(nn.Module):
    """The LM head's weight ``[V, d]`` and bias (references to the model's parameters, not
    copies) and the model's final logit soft-cap (``None`` for most models), as
    :class:`~bsloss.BERTScoreLoss` takes them (``output_embeddings=head,
    logit_softcap=head.softcap``).

    Under FSDP 2 the weight is usable only inside :meth:`run`; elsewhere it is a shard."""

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        softcap: float | None,
        *,
        module: nn.Module | None = None,
        extra_bias: Tensor | None = None,
        owner: nn.Module | None = None,
    ):
        super().__init__()
        self.weight, self.bias, self.softcap = weight, bias, softcap
        # FSDP 2: the head module (its weight read afresh inside the owner's forward), BART's
        # final_logits_bias, and the fully_shard unit whose forward gathers the weight
        self._module, self._extra_bias, self._owner = module, extra_bias, owner

    def run(self, compute: Callable[..., Any], *args: Any) -> Any:
        """``compute(head, *args)``: the chunked computation over the head's weight. Under FSDP 2
        it runs as a forward method of the unit that owns the weight (gathered for it, and for
        its backward pass); ``compute``'s output must be a tensor or a tuple / list / dict of
        tensors (FSDP hooks the backward pass on them)."""
        if self._owner is None:
            return compute(self, *args)
        return self._owner._bsloss_head_forward(self._gathered_call, compute, *args)

    def _gathered_call(self, compute: Callable[..., Any], *args: Any) -> Any:
        module = self._module
        bias = module.bias
        if self._extra_bias is not None:
            bias = self._extra_bias[0] if bias is None else bias + self._extra_bias[0]
        return compute(LMHead(module.weight, bias, self.softcap), *args)


def _head_forward(call: Callable[..., Any], *args: Any) -> Any:
    return call(*args)


def _fsdp2_owner(model: nn.Module, head: nn.Module) -> nn.Module | None:
    """The ``fully_shard`` unit that manages the head's weight (the head itself or its nearest
    sharded ancestor), prepared for :meth:`LMHead.run`; None when nothing is sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    except ImportError:  # a torch without FSDP 2
        return None
    path = next(name for name, module in model.named_modules() if module is head).split(".")
    chain = [model.get_submodule(".".join(path[:depth])) for depth in range(len(path) + 1)]
    owner = next((m for m in reversed(chain) if isinstance(m, FSDPModule)), None)
    if owner is not None and not hasattr(owner, "_bsloss_head_forward"):
        owner._bsloss_head_forward = _head_forward
        register_fsdp_forward_method(owner, "_bsloss_head_forward")
    return owner


class _PassThrough(nn.Module):
    def forward(self, hidden: Tensor) -> Tensor:
        return hidden


def _refuse_fsdp1(model: nn.Module) -> None:
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            raise ValueError(
                "lm_head_inputs: the model is wrapped in FullyShardedDataParallel (FSDP 1), whose "
                "LM-head weight is gathered only inside the wrapper's forward; shard it with "
                "fully_shard (FSDP 2) or use the dense path (bertscore_fused=False)"
            )


@contextlib.contextmanager
def lm_head_inputs(model: nn.Module) -> Iterator[LMHead]:
    """Within the block ``model(...)`` returns the LM head's input ``[B, L, d]`` as its
    ``.logits``; yields the :class:`LMHead` to score them with.

    Args:
        model: a transformers model with an output embedding (``get_output_embeddings()``),
            not wrapped (pass ``accelerator.unwrap_model(model)``; a DDP wrapper around it may
            run the forward).

    Raises:
        ValueError: the model has no output embedding, or is wrapped in FSDP 1's
            ``FullyShardedDataParallel``.

    >>> import torch, transformers
    >>> config = transformers.GPT2Config(
    ...     vocab_size=50, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    ... )
    >>> model = transformers.GPT2LMHeadModel(config).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> with lm_head_inputs(model) as head:
    ...     hidden = model(input_ids=ids).logits
    >>> hidden.shape, torch.allclose(hidden @ head.weight.T, model(input_ids=ids).logits)
    (torch.Size([1, 3, 8]), True)
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), Tensor):
        raise ValueError(
            f"lm_head_inputs: {type(model).__name__} has no output embedding (LM head) with a "
            "weight; pass the model itself, not a wrapper (accelerator.unwrap_model(model))"
        )
    _refuse_fsdp1(model)
    parent, name = next(
        (module, child_name)
        for module in model.modules()
        for child_name, child in module.named_children()
        if child is head
    )
    bias = head.bias
    extra = getattr(model, "final_logits_bias", None)  # BART adds it after the head
    if isinstance(extra, Tensor):
        bias = extra[0] if bias is None else bias + extra[0]
        model.final_logits_bias = torch.zeros_like(extra[:, :1])
    # A soft-capping model applies its cap after the head: off here, given to the loss instead.
    config = getattr(model, "config", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None:
        config.final_logit_softcapping = None
    owner = _fsdp2_owner(model, head)
    setattr(parent, name, _PassThrough())
    try:
        yield LMHead(
            head.weight,
            bias,
            softcap,
            module=head,
            extra_bias=extra if isinstance(extra, Tensor) else None,
            owner=owner,
        )
    finally:
        setattr(parent, name, head)
        if softcap is not None:
            config.final_logit_softcapping = softcap
        if isinstance(extra, Tensor):
            model.final_logits_bias = extra


def token_cross_entropy(
    labels: Tensor,
    *,
    logits: Tensor | None = None,
    hidden_states: Tensor | None = None,
    head: LMHead | Tensor | nn.Module | None = None,
    reduction: str = "mean",
) -> Tensor:
    """``-log q(labels)`` per target token (``-100`` ignored), from ``[..., V]`` logits or, without
    them, chunked from the head's input ``hidden_states`` ``[..., d]`` and ``head`` (an
    :class:`LMHead`, whose soft-cap applies, or a weight / module).

    Args:
        labels: integer targets, the shape of the logits' leading dimensions.
        logits, hidden_states: exactly one.
        head: with ``hidden_states``.
        reduction: ``"mean"`` over the target tokens (0 when there are none), ``"sum"``, or
            ``"none"`` (the shape of ``labels``, 0 at ignored positions).

    Raises:
        ValueError: not exactly one of ``logits`` / ``hidden_states``, a missing ``head``, an
            unknown ``reduction``, or ``labels`` of another shape than their leading dimensions
            (both named).

    >>> import torch
    >>> logits, labels = torch.randn(2, 3, 10), torch.tensor([[1, 2, -100], [3, 4, 5]])
    >>> ce = token_cross_entropy(labels, logits=logits)
    >>> torch.allclose(ce, torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels))
    True
    """
    if (logits is None) == (hidden_states is None):
        raise ValueError("token_cross_entropy: pass exactly one of logits or hidden_states")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    inputs, name = (hidden_states, "hidden_states") if logits is None else (logits, "logits")
    check_targets_shape(labels, "labels", inputs, name)
    flat_labels = labels.reshape(-1)
    if logits is not None:
        per_token = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            flat_labels,
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
    else:
        if head is None:
            raise ValueError("token_cross_entropy: hidden_states needs head (the LM head)")
        per_token = -fused_token_log_likelihood(
            hidden_states.reshape(-1, hidden_states.shape[-1]),
            head,
            flat_labels,
            softcap=getattr(head, "softcap", None),
        )
    if reduction == "none":
        return per_token.reshape(labels.shape)
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / (flat_labels != IGNORE_INDEX).sum().clamp_min(1)
