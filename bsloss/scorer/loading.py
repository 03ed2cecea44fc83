"""Loading a scorer: a hub name, a local folder or the embedded default -> a frozen Hugging Face
encoder cut at ``num_layers``, with its tokenizer, on a device.

The model is cut the way bert_score cuts it: the layers above ``num_layers`` are dropped, so
compute stops there. An encoder-decoder contributes its encoder.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from bsloss.inputs import check_int
from bsloss.pretrained import hub_name, resolve_model
from bsloss.scorer.default import (
    DEFAULT_MODEL_NAME,
    embedded_model_installed,
    embedded_model_path,
)
from bsloss.scorer.identity import recognise, same_architecture
from bsloss.scorer.layers import default_num_layers, num_hidden_layers, truncate_layers
from bsloss.scorer.tokenization import is_byte_level

__all__ = ["load_scorer", "locate_scorer", "process_gpu", "resolve_device"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device`` (``None``: this process's GPU when CUDA is available,
    :func:`process_gpu`, else the CPU; ``"cuda"``: this process's GPU).

    Raises:
        ValueError: not a device name, or a CUDA device on a machine without CUDA.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", process_gpu())
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a torch device ({error})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available on this machine")
        if resolved.index is None:  # "cuda": this process's GPU, as for None
            return torch.device("cuda", process_gpu())
        if resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return resolved


def process_gpu() -> int:
    """The CUDA device this process works on: the current one once set (``torch.cuda.set_device``,
    as accelerate and torchrun scripts do), else, under a launcher, the one of its ``LOCAL_RANK``.
    A scorer built before the trainer set the device (a TRL reward made at the top of a script)
    would otherwise sit on GPU 0 in every process."""
    current = torch.cuda.current_device()
    local_rank = os.environ.get("LOCAL_RANK", "")
    if current == 0 and local_rank.isdigit() and int(local_rank) < torch.cuda.device_count():
        return int(local_rank)
    return current


@contextmanager
def _explained(name_or_path: str) -> Iterator[None]:
    """transformers' ``OSError`` for a name that is not a local folder (offline: "We couldn't
    connect", a mistyped folder: "Repo id must use alphanumeric chars") as what it means here."""
    try:
        yield
    except OSError as error:
        if Path(name_or_path).exists():
            raise
        raise OSError(
            f"could not load scorer model {name_or_path!r}: it is not a local folder and the "
            "Hugging Face hub is unreachable from here (offline, or HF_HUB_OFFLINE=1). Download "
            "the model on a machine with internet (e.g. `hf download NAME --local-dir DIR`) and "
            "pass its folder: model='/path/to/DIR' and num_layers=N. model=None uses the embedded "
            "all-MiniLM-L6-v2."
        ) from error


def load_tokenizer(name_or_path: str):
    """The scorer's tokenizer as the scorer loads it (a byte-level BPE one with
    ``add_prefix_space``, as bert_score's), with :func:`_explained`'s error."""
    from transformers import AutoTokenizer

    with _explained(name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        if is_byte_level(tokenizer):
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, add_prefix_space=True)
    return tokenizer


def _load(name_or_path: str):
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer(name_or_path)
    with _explained(name_or_path):
        model = AutoModel.from_pretrained(name_or_path)
    return tokenizer, model


def locate_scorer(model: str | Path | None) -> tuple[str, str]:
    """The hub name of ``model`` and the folder or name to load it from.

    ``None`` and all-MiniLM-L6-v2's hub name give the embedded copy (when installed); offline
    short names such as ``"all-mpnet-base-v2"`` give their converted folder and keep the hub
    name, which keys the layer table and the shipped baselines (:mod:`bsloss.pretrained`).

    >>> locate_scorer(None)[0]
    'sentence-transformers/all-MiniLM-L6-v2'
    """
    name = DEFAULT_MODEL_NAME if model is None else hub_name(str(model))
    if model is None or (name == DEFAULT_MODEL_NAME and embedded_model_installed()):
        return name, embedded_model_path()
    return name, resolve_model(str(model))


def load_scorer(
    model: str | Path | None = None, num_layers: int | None = None, all_layers: bool = False
) -> tuple[nn.Module, object, str, int]:
    """The Hugging Face encoder and tokenizer of ``model``, its name and its layer.

    Args:
        model: a hub name or a local folder; ``None``: the embedded all-MiniLM-L6-v2 (see
            :func:`locate_scorer`).
        num_layers: the layer whose hidden states are the embeddings (``None``: bert_score's
            default for the model).
        all_layers: keep every layer (bert_score's ``all_layers``) instead of cutting the model.

    Returns:
        ``(model, tokenizer, name, num_layers)``; ``name`` is the hub name, which keys the layer
        table and the shipped baselines: a local folder that holds a known model (the embedded
        one's folder, a converted offline model, a copy) gets that model's hub name
        (:mod:`bsloss.scorer.identity`).

    Raises:
        TypeError: ``model`` is neither a name nor a folder.
        ValueError: ``num_layers`` is not between 0 and the model's layer count.
        OSError: the model cannot be loaded (offline and not a local folder).
    """
    if model is not None and not isinstance(model, str | Path):
        hint = (
            "; pass a loaded scorer as encoder=" if type(model).__name__ == "ScorerEncoder" else ""
        )
        raise TypeError(f"model must be a name or a folder, got {type(model).__name__}{hint}")
    if num_layers is not None:
        num_layers = check_int(num_layers, "num_layers", 0)
    name, path = locate_scorer(model)
    tokenizer, hf_model = _load(path)
    if getattr(hf_model.config, "is_encoder_decoder", False):
        hf_model = hf_model.get_encoder()
    if Path(path).is_dir():  # a folder: the model it holds, whatever the folder's name
        name = recognise(hf_model) or name
    if num_layers is None:
        num_layers = default_num_layers(name, same_architecture(hf_model))
    if num_layers > num_hidden_layers(hf_model) or num_layers < 0:
        raise ValueError(
            f"num_layers must be between 0 and {num_hidden_layers(hf_model)} for {name!r}, "
            f"got {num_layers}"
        )
    if not all_layers:
        truncate_layers(hf_model, num_layers)
    return hf_model, tokenizer, name, num_layers
