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
model; its gradient arrives in the same backward pass). It does not work under FSDP, whose
sharded head weight is gathered only inside the head module's own forward: use the dense path
there (``BERTScoreTrainerMixin(bertscore_fused=False)``).

:func:`token_cross_entropy` is the package's one cross-entropy of target tokens, from dense
logits or chunked from :math:`h` and the head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from bsloss.functional.fused_expectation import IGNORE_INDEX, fused_token_log_likelihood

__all__ = ["IGNORE_INDEX", "LMHead", "lm_head_inputs", "token_cross_entropy"]


class LMHead(nn.Module):
    """The LM head's weight ``[V, d]`` and bias (references to the model's parameters, not
    copies) and the model's final logit soft-cap (``None`` for most models), as
    :class:`~bsloss.BERTScoreLoss` takes them (``output_embeddings=head,
    logit_softcap=head.softcap``)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, softcap: float | None):
        super().__init__()
        self.weight, self.bias, self.softcap = weight, bias, softcap


class _PassThrough(nn.Module):
    def forward(self, hidden: Tensor) -> Tensor:
        return hidden


def _refuse_fsdp(model: nn.Module) -> None:
    for module in model.modules():
        if type(module).__name__ in ("FullyShardedDataParallel", "FSDPModule") or any(
            cls.__name__ == "FSDPModule" for cls in type(module).__mro__
        ):
            raise ValueError(
                "lm_head_inputs: the model is sharded with FSDP, whose LM-head weight is gathered "
                "only inside the head's own forward; use the dense path (bertscore_fused=False)"
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
        ValueError: the model has no output embedding, or is sharded with FSDP.

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
    _refuse_fsdp(model)
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
    setattr(parent, name, _PassThrough())
    try:
        yield LMHead(head.weight, bias, softcap)
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
        ValueError: not exactly one of ``logits`` / ``hidden_states``, a missing ``head``, or an
            unknown ``reduction``.

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
