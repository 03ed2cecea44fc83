"""Which layer of a scorer to use, and how to drop the layers above it.

Defaults follow bert_score's ``model2layers`` table (the layer that correlated best with WMT16
human judgments in Zhang et al., 2020, Appendix); all-MiniLM-L6-v2 uses its last layer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__ = ["DEFAULT_LAYERS", "default_num_layers", "truncate_layers", "num_hidden_layers"]

DEFAULT_LAYERS: dict[str, int] = {
    "roberta-large": 17,
    "roberta-base": 10,
    "bert-base-uncased": 9,
    "bert-large-uncased": 18,
    "bert-base-multilingual-cased": 9,
    "bert-base-chinese": 8,
    "dbmdz/bert-base-turkish-cased": 10,
    "allenai/scibert_scivocab_uncased": 8,
    "distilbert-base-uncased": 5,
    "distilroberta-base": 5,
    "xlm-roberta-base": 9,
    "xlm-roberta-large": 17,
    "microsoft/deberta-xlarge-mnli": 40,
    "microsoft/deberta-large-mnli": 18,
    "facebook/bart-base": 6,
    "facebook/bart-large": 10,
    "t5-small": 6,
    "t5-base": 11,
    "microsoft/mpnet-base": 8,
    "sentence-transformers/all-MiniLM-L6-v2": 6,
    "all-MiniLM-L6-v2": 6,
    # sentence-transformers models are trained on their last layer's output
    "sentence-transformers/all-mpnet-base-v2": 12,
    "all-mpnet-base-v2": 12,
}


def default_num_layers(model_name: str, architecture_of: str | None = None) -> int:
    """The table's layer for ``model_name`` (a hub name, or a folder named like one).

    Args:
        model_name: the hub name or folder.
        architecture_of: the known model whose architecture an unrecognised folder has (a
            fine-tuned copy), named in the error as a hint.

    Raises:
        ValueError: ``model_name`` is not in the table (the message says to pass num_layers).
    """
    for key in (model_name, model_name.rstrip("/").split("/")[-1], Path(model_name).name):
        if key in DEFAULT_LAYERS:
            return DEFAULT_LAYERS[key]
    hint = ""
    if architecture_of is not None:
        hint = (
            f" The folder has the architecture of {architecture_of} (which uses layer "
            f"{DEFAULT_LAYERS[architecture_of]}) but other weights (fine-tuned?), so bsloss does "
            "not take it for that model."
        )
    raise ValueError(
        f"num_layers is required for model {model_name!r}: it is not in bsloss's default-layer "
        f"table ({', '.join(sorted(DEFAULT_LAYERS))}).{hint} Pass num_layers=N (0 = embedding "
        "output)."
    )


# Where each architecture keeps its stack of layers, as attribute paths from the base model.
_LAYER_STACKS = (
    "encoder.layer",
    "encoder.layers",
    "encoder.block",
    "layers",
    "block",
    "transformer.layer",
    "layer",
)


def _find_layer_stack(model: nn.Module) -> tuple[nn.Module, str] | None:
    for path in _LAYER_STACKS:
        owner: nn.Module | None = model
        *parents, leaf = path.split(".")
        for name in parents:
            owner = getattr(owner, name, None)
        stack = getattr(owner, leaf, None) if owner is not None else None
        if isinstance(stack, nn.ModuleList):
            return owner, leaf
    return None


def num_hidden_layers(model: nn.Module) -> int:
    found = _find_layer_stack(model)
    if found is None:
        return int(model.config.num_hidden_layers)
    owner, leaf = found
    return len(getattr(owner, leaf))


def truncate_layers(model: nn.Module, num_layers: int) -> nn.Module:
    """Drop the layers above ``num_layers`` in place, so that compute stops there.

    ``num_layers=0`` leaves the embedding output. ALBERT shares one layer group, so only its
    layer count is changed.
    """
    total = num_hidden_layers(model)
    if not 0 <= num_layers <= total:
        raise ValueError(
            f"num_layers must be between 0 and {total} for this model, got {num_layers}"
        )
    if hasattr(getattr(model, "encoder", None), "albert_layer_groups"):
        model.config.num_hidden_layers = num_layers
        return model
    found = _find_layer_stack(model)
    if found is None:
        raise ValueError(f"bsloss does not know where {type(model).__name__} keeps its layers")
    owner, leaf = found
    setattr(owner, leaf, nn.ModuleList(list(getattr(owner, leaf))[:num_layers]))
    if hasattr(model.config, "num_hidden_layers"):
        model.config.num_hidden_layers = num_layers
    return model


@torch.no_grad()
def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no parameter requires grad: the scorer is a fixed measuring instrument."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model
