"""Attention masks that the scorer's model takes without reading them back on the host.

Given a ``[B, L]`` padding mask, transformers (5.x, through ``create_bidirectional_mask``) asks
whether every entry is set, to drop an all-ones mask and let SDPA pick its fastest kernel. On a
GPU that question is a copy to the host and a wait for the card, once per encoder call: the host
cannot queue the next batch while the card works on this one. :func:`prepared_attention_mask`
gives the model the mask transformers would have built, made here without the question, in the
4D form the model takes as it is (``ScorerEncoder`` calls it where the host sets the pace). A
batch built on the host passes no mask when nothing is padded, which is what transformers would
have chosen (:func:`~bsloss.scorer.inference.embed_token_ids`).

Transformers 4.x (its last release, 4.57, is frozen) has no such builder: BERT, RoBERTa,
XLM-R, CamemBERT and XLM-R XL expand a ``[B, L]`` mask for SDPA with
``_prepare_4d_attention_mask_for_sdpa``, which asks the same question. A ``[B, L, L]`` mask,
which their forward documents as an input, goes through ``get_extended_attention_mask``
instead: the same additive mask, no read. Those five get it as a view of the padding mask;
other 4.x models get the ``[B, L]`` mask (DistilBERT's SDPA path still reads it back).
"""

from __future__ import annotations

import inspect
import sys
from functools import cache

import torch
from torch import Tensor, nn

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


# transformers 4.x's encoders whose forward expands a [B, L] mask with
# _prepare_4d_attention_mask_for_sdpa (a read) and a [B, L, L] one with
# get_extended_attention_mask (none): in 4.57 the five modelling files that do both
_TAKE_A_3D_MASK_IN_4X = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "xlm-roberta-xl"})


def _takes_a_3d_mask_unread(model: nn.Module) -> bool:
    """Whether ``model`` is one of transformers 4.x's encoders that read a ``[B, L]`` mask back
    and take a ``[B, L, L]`` one as it is."""
    if getattr(model.config, "is_decoder", False):
        return False
    module = sys.modules.get(type(model).__module__)
    return getattr(model.config, "model_type", None) in _TAKE_A_3D_MASK_IN_4X and hasattr(
        module, "_prepare_4d_attention_mask_for_sdpa"
    )


def _builds_its_masks_with(model: nn.Module, builder) -> bool:
    """Whether ``model``'s modelling module builds its masks with ``builder`` (and so takes a
    4D mask as it is); models that build theirs another way get the 2D mask."""
    if builder is None or getattr(model.config, "is_decoder", False):  # a decoder's is causal
        return False
    module = sys.modules.get(type(model).__module__)
    return getattr(module, builder.__name__, None) is builder


def prepared_attention_mask(model: nn.Module, mask: Tensor) -> Tensor:
    """The attention mask to give ``model`` for a ``[B, L]`` padding ``mask`` (nonzero where a
    token is attended), such that the model does not read it back on the host: for a model whose
    masks transformers builds with ``create_bidirectional_mask``, that mask for the model's
    attention implementation (a 4D boolean for SDPA, an additive float for eager); under
    transformers 4.x, for the BERT family, ``mask`` broadcast over the queries (``[B, L, L]``, a
    view); for any other model ``mask`` as it is.

    For SDPA and eager attention the ``[B, 1, L, L]`` mask is the padding mask broadcast over the
    queries, made here as a view of ``mask`` (SDPA: no kernel for a boolean ``mask``; eager: a
    ``where`` and a cast), where transformers' builder launches a dozen small kernels per call
    (a GPU pays each launch on the host); the values are the builder's
    (``tests/test_attention_masks.py``). Other implementations (flex attention's block mask,
    flash attention's 2D mask) get the builder's own."""
    builder = _mask_builder()
    if builder is None and _takes_a_3d_mask_unread(model):  # transformers 4.x (module docstring)
        batch, length = mask.shape
        return mask[:, None, :].expand(batch, length, length)
    if not _builds_its_masks_with(model, builder):
        return mask
    embeddings = model.get_input_embeddings()
    dtype = embeddings.weight.dtype if embeddings is not None else torch.float32
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation in ("sdpa", "eager"):
        batch, length = mask.shape
        attended = mask if mask.dtype == torch.bool else mask != 0
        if implementation == "eager":  # additive: 0 where attended, the dtype's lowest elsewhere
            # (Python numbers: a tensor made from one would be a copy to the device, a wait)
            attended = torch.where(attended, 0.0, torch.finfo(dtype).min).to(dtype)
        return attended[:, None, None, :].expand(batch, 1, length, length)
    # the mask takes the batch size, dtype and device from the embeddings: an empty stand-in
    like = torch.empty((*mask.shape, 0), dtype=dtype, device=mask.device)
    return builder(
        config=model.config,
        inputs_embeds=like,
        attention_mask=mask,
        allow_is_bidirectional_skip=False,  # the question this module answers without the read
    )
