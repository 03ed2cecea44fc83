"""Gradient checkpointing over the scorer's layers (``torch.utils.checkpoint``, non-reentrant).

Hugging Face's own switch only checkpoints in training mode; the scorer stays in eval mode
(no dropout), so bsloss wraps each layer itself. A wrapped layer recomputes its forward pass in
the backward pass instead of storing its activations; it checkpoints only when gradients are being
recorded, so evaluation pays nothing.

Checkpointing trades one more forward pass of the scorer (on a GPU, the loss's time went 1.54x
at B = 32, L = 64 with MiniLM) for the activations it does not store. That pays only when those
activations are large: with MiniLM and those 2,048 tokens they are ~0.4 GB and the ``[B, L, V]``
logits beside them dominate the peak, so checkpointing saved nothing there. ``"auto"`` (the
loss's default) therefore checkpoints a call only when the activations the scorer's layers would
store for it are estimated (:func:`stored_activation_bytes`) above :data:`AUTO_BUDGET_BYTES`: a
24-layer, 1024-wide scorer (roberta-large's shape) reaches it at ~400 tokens of length 256,
MiniLM at ~5,500 tokens of length 64.

The mode belongs to the caller, not to the scorer: a scorer is shared (several losses, a loss
and a metric), so :class:`~bsloss.BERTScoreLoss` wraps the layers once
(:func:`prepare_checkpointing`) and applies its own mode only for the duration of its own calls
(:func:`checkpointing_mode`). Outside such a block, layers it wrapped do not checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bsloss.scorer.layers import _find_layer_stack

__all__ = [
    "AUTO_BUDGET_BYTES",
    "CheckpointedLayer",
    "Checkpointing",
    "check_checkpointing",
    "checkpointing_mode",
    "prepare_checkpointing",
    "set_gradient_checkpointing",
    "stored_activation_bytes",
]

Checkpointing = bool | Literal["auto"]
AUTO_BUDGET_BYTES = 1 << 30  # 1 GiB of stored layer activations per call
# Tensors a transformer layer keeps for its backward pass, in units of its [B, L, d] input: the
# q, k, v and attention-output projections and their inputs (~5), two layer norms (~2), the
# 4d-wide MLP's input, pre-activation and activation (~12) — ~19 in BERT-style layers; the
# [B, heads, L, L] attention scores and probabilities come on top (two of them, heads = d / 64).
_STORED_PER_HIDDEN = 19
_HEAD_WIDTH = 64


def stored_activation_bytes(hidden: torch.Tensor, layers: int) -> int:
    """Estimated bytes the ``layers`` layers of a stack store for the backward pass of an input
    ``hidden`` ``[B, L, d]`` (the first layer's input)."""
    if hidden.dim() != 3:
        return 0
    batch, length, width = hidden.shape
    heads = max(1, width // _HEAD_WIDTH)
    per_layer = _STORED_PER_HIDDEN * batch * length * width + 2 * batch * heads * length * length
    return per_layer * layers * hidden.element_size()


def check_checkpointing(value: object) -> Checkpointing:
    """``True``, ``False`` or ``"auto"``, else a ``ValueError`` naming
    ``gradient_checkpointing``."""
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"gradient_checkpointing must be True, False or 'auto', got {value!r}")


_WRAPPED = "layer."  # the wrapped layer's keys inside the wrapper's


def _unwrapped_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict post hook: the wrapped layer's keys without the wrapper's ``layer.``."""
    inside = prefix + _WRAPPED
    # the wrapper's keys come last when its hook runs: renamed in their order, they stay there
    for key in [key for key in state_dict if key.startswith(inside)]:
        state_dict[prefix + key[len(inside) :]] = state_dict.pop(key)


def _wrapped_keys(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre hook: the wrapper's keys as its state dict gives them (the wrapped
    layer's own) go to the wrapped layer."""
    for key in [key for key in state_dict if key.startswith(prefix)]:
        state_dict[prefix + _WRAPPED + key[len(prefix) :]] = state_dict.pop(key)


class CheckpointedLayer(nn.Module):
    """A layer of the scorer's stack that can checkpoint (:attr:`enabled`). Invisible to state
    dicts, as torch's ``checkpoint_wrapper`` is: the scorer's ``state_dict()`` keys,
    ``load_state_dict`` of a plain Hugging Face state and ``save_pretrained`` are those of the
    model as it was loaded (``encoder.layer.0.attention...``, not ``encoder.layer.0.layer.``)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        self.enabled: Checkpointing = True
        self.stack_depth = 1  # layers in the stack: what "auto" estimates the call's cost over
        self.register_state_dict_post_hook(_unwrapped_keys)
        self.register_load_state_dict_pre_hook(_wrapped_keys)

    def __getattr__(self, name: str):
        # The wrapped layer's submodules stay reachable (``layer[0].attention``), so code that
        # inspects the scorer sees the same model with checkpointing on.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)

    def _checkpoints(self, args: tuple) -> bool:
        if not torch.is_grad_enabled() or self.enabled is False:
            return False
        if self.enabled is True:
            return True
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if hidden is None:
            return True  # nothing to estimate from: the safe side for memory
        return stored_activation_bytes(hidden, self.stack_depth) > AUTO_BUDGET_BYTES

    def forward(self, *args, **kwargs):
        if self._checkpoints(args):
            return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)
        return self.layer(*args, **kwargs)


def set_gradient_checkpointing(model: nn.Module, enabled: Checkpointing) -> None:
    """Checkpointing of every layer of ``model``'s layer stack: on, off, or ``"auto"`` (on for
    the calls whose stored activations would exceed :data:`AUTO_BUDGET_BYTES`), for every call
    of the model outside a :func:`checkpointing_mode` block (a loss's own calls use its mode)."""
    enabled = prepare_checkpointing(model, enabled)
    found = _find_layer_stack(model)
    if found is None:
        return
    owner, leaf = found
    for layer in getattr(owner, leaf):
        if isinstance(layer, CheckpointedLayer):
            layer.enabled = enabled


def _wrap_layers(model: nn.Module, enabled: Checkpointing) -> list[CheckpointedLayer]:
    """The layers of ``model``'s stack, each wrapped in a :class:`CheckpointedLayer` (once);
    a layer wrapped here starts with ``enabled``, one wrapped before keeps its own mode."""
    found = _find_layer_stack(model)
    if found is None:
        return []
    owner, leaf = found
    stack = getattr(owner, leaf)
    if not all(isinstance(layer, CheckpointedLayer) for layer in stack):
        wrapped = []
        for layer in stack:
            if not isinstance(layer, CheckpointedLayer):
                layer = CheckpointedLayer(layer)
                layer.enabled = enabled
            wrapped.append(layer)
        setattr(owner, leaf, nn.ModuleList(wrapped))
    layers = list(getattr(owner, leaf))
    for layer in layers:
        layer.stack_depth = len(layers)
    return layers


def prepare_checkpointing(model: nn.Module, enabled: Checkpointing) -> Checkpointing:
    """Check ``enabled`` for ``model`` and, when it may checkpoint, wrap the layers of its stack
    so that :func:`checkpointing_mode` can switch them. The mode of every layer already wrapped
    is left as it is (another user of the scorer owns it), and a layer wrapped here does not
    checkpoint outside a :func:`checkpointing_mode` block.

    Returns:
        ``enabled``, checked.

    Raises:
        ValueError: ``enabled`` is not ``True``, ``False`` or ``"auto"``, or ``True`` for a
            model with no layer stack (named).
    """
    enabled = check_checkpointing(enabled)
    if _find_layer_stack(model) is None:
        if enabled is True:
            raise ValueError(f"cannot checkpoint {type(model).__name__}: no layer stack found")
        return enabled
    if enabled is not False:
        _wrap_layers(model, False)
    return enabled


@contextmanager
def checkpointing_mode(model: nn.Module, enabled: Checkpointing) -> Iterator[None]:
    """``model``'s wrapped layers checkpoint as ``enabled`` says inside the block, and go back
    to their modes after it (also on an error): a loss applies its own mode to its own calls
    only, whoever else shares the scorer. With ``enabled`` ``False`` and no wrapped layer there
    is nothing to switch (no wrapper's cost). Layers not yet wrapped (the stack replaced after
    :func:`prepare_checkpointing`) are wrapped for a mode that may checkpoint.

    >>> import torch
    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...                              intermediate_size=16))
    >>> _ = prepare_checkpointing(model, True)
    >>> with checkpointing_mode(model, True):
    ...     [layer.enabled for layer in model.encoder.layer]
    [True, True]
    >>> [layer.enabled for layer in model.encoder.layer]
    [False, False]
    """
    found = _find_layer_stack(model)
    if found is None:
        yield
        return
    owner, leaf = found
    stack = getattr(owner, leaf)
    wrapped = [layer for layer in stack if isinstance(layer, CheckpointedLayer)]
    if enabled is not False and len(wrapped) < len(stack):
        wrapped = _wrap_layers(model, False)
    # every loss call passes here: switch (and restore) only the layers whose mode differs
    # (a layer's attribute set goes through nn.Module.__setattr__)
    switched = [(layer, layer.enabled) for layer in wrapped if layer.enabled != enabled]
    for layer, _ in switched:
        layer.enabled = enabled
    try:
        yield
    finally:
        for layer, mode in switched:
            layer.enabled = mode
