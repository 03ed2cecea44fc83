"""Attention masks that the scorer's model takes without reading them back on the host.

Given a ``[B, L]`` padding mask, transformers (5.x, through ``create_bidirectional_mask``) asks
whether every entry is set, to drop an all-ones mask and let SDPA pick its fastest kernel. On a
GPU that question is a copy to the host and a wait for the card, once per encoder call: the host
cannot queue the next batch while the card works on this one. A batch built on the host knows
the answer already, so :func:`prepared_attention_mask` gives the model either no mask (no
padding: what transformers would have chosen) or the mask transformers would have built, made
here, in the 4D form the model takes as it is.
"""

from __future__ import annotations

import inspect
import sys
from functools import cache

import torch
from torch import Tensor, nn

from bsloss.scorer.batching import to_device

__all__ = ["prepared_attention_mask"]


@cache
def _mask_builder():
    """transformers' ``create_bidirectional_mask`` (5.x) where it can be told not to drop an
    all-ones mask, or ``None``."""
    try:
        from transformers.masking_utils import create_bidirectional_mask
    except ImportError:
        return None
    if "allow_is_bidirectional_skip" not in inspect.signature(create_bidirectional_mask).parameters:
        return None
    return create_bidirectional_mask


def _builds_its_masks_with(model: nn.Module, builder) -> bool:
    """Whether ``model``'s modelling module builds its masks with ``builder`` (and so takes a
    4D mask as it is); models that build theirs another way get the 2D mask."""
    if builder is None or getattr(model.config, "is_decoder", False):  # a decoder's is causal
        return False
    module = sys.modules.get(type(model).__module__)
    return getattr(module, builder.__name__, None) is builder


def prepared_attention_mask(
    model: nn.Module, attended: Tensor, device: torch.device
) -> Tensor | None:
    """The attention mask for ``model`` of the host-built ``[B, L]`` boolean mask ``attended``,
    on ``device``.

    ``None`` when nothing is padded; else, for a model whose masks transformers builds with
    ``create_bidirectional_mask``, that mask for the model's attention implementation (a 4D
    boolean for SDPA, an additive float for eager), built here without the host read; for any
    other model the 2D mask as it is.
    """
    if attended.device.type != "cpu":
        raise ValueError(f"attended must be built on the host, got a tensor on {attended.device}")
    if bool(attended.all()):
        return None
    mask = to_device(attended, device)
    builder = _mask_builder()
    if not _builds_its_masks_with(model, builder):
        return mask
    embeddings = model.get_input_embeddings()
    dtype = embeddings.weight.dtype if embeddings is not None else torch.float32
    # the mask takes the batch size, dtype and device from the embeddings: an empty stand-in
    like = torch.empty((*attended.shape, 0), dtype=dtype, device=device)
    return builder(
        config=model.config,
        inputs_embeds=like,
        attention_mask=mask,
        allow_is_bidirectional_skip=False,  # the question this module answers on the host
    )
