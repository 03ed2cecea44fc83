"""Gradient checkpointing over the scorer's layers (``torch.utils.checkpoint``, non-reentrant).

Hugging Face's own switch only checkpoints in training mode; the scorer stays in eval mode
(no dropout), so bsloss wraps each layer itself. A wrapped layer recomputes its forward pass in
the backward pass instead of storing its activations; it checkpoints only when gradients are being
recorded, so evaluation pays nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bsloss.scorer.layers import _find_layer_stack

__all__ = ["CheckpointedLayer", "set_gradient_checkpointing"]


class CheckpointedLayer(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        self.enabled = True

    def __getattr__(self, name: str):
        # The wrapped layer's submodules stay reachable (``layer[0].attention``), so code that
        # inspects the scorer sees the same model with checkpointing on.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)

    def forward(self, *args, **kwargs):
        if self.enabled and torch.is_grad_enabled():
            return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)
        return self.layer(*args, **kwargs)


def set_gradient_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn checkpointing of every layer of ``model``'s layer stack on or off."""
    found = _find_layer_stack(model)
    if found is None:
        if enabled:
            raise ValueError(f"cannot checkpoint {type(model).__name__}: no layer stack found")
        return
    owner, leaf = found
    stack = getattr(owner, leaf)
    if enabled and not all(isinstance(layer, CheckpointedLayer) for layer in stack):
        setattr(
            owner,
            leaf,
            nn.ModuleList(
                layer if isinstance(layer, CheckpointedLayer) else CheckpointedLayer(layer)
                for layer in stack
            ),
        )
    for layer in getattr(owner, leaf):
        if isinstance(layer, CheckpointedLayer):
            layer.enabled = enabled
