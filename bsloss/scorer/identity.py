"""Which known model a loaded scorer is, whatever folder it came from.

A scorer loaded from a local folder (the embedded model's own folder, a converted offline model,
a copy made with ``hf download``) is recognised by what it holds, not by its path: its
architecture (the config's shape) and a fingerprint over every weight tensor it uses. A
recognised folder gets the model's hub name, so the layer table and the shipped baselines apply to
it. A fine-tuned copy has the same shape but other weights: it is not taken for the original (its
baseline would differ), and the message for a missing ``num_layers`` says so.
"""

from __future__ import annotations

import hashlib

from torch import nn

__all__ = ["KNOWN_MODELS", "recognise", "weights_fingerprint", "same_architecture"]

# hub name -> (the config's shape, :func:`weights_fingerprint`). The shapes and fingerprints are
# checked against the installed models in tests/test_identity.py.
KNOWN_MODELS: dict[str, tuple[tuple, str]] = {
    "sentence-transformers/all-MiniLM-L6-v2": (
        ("bert", 6, 384, 12, 1536, 30522),
        "1685a2df8c6344af",
    ),
    "sentence-transformers/all-mpnet-base-v2": (
        ("mpnet", 12, 768, 12, 3072, 30527),
        "5aae7210d77f2c84",
    ),
}


def _shape(config) -> tuple:
    return tuple(
        getattr(config, key, None)
        for key in (
            "model_type",
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
    )


# Elements sampled from each tensor, at an even stride (all of a smaller one): fine-tuning moves
# nearly every element of every tensor it trains, so a sample of each tensor tells a fine-tuned
# copy from the original at a fraction of a full hash's cost (MiniLM: 0.07 s against 0.24 s).
_SAMPLES_PER_TENSOR = 16_384


def weights_fingerprint(model: nn.Module) -> str:
    """sha256 prefix over every tensor of ``model``'s state dict but the pooler's: each one's
    name, shape and a strided sample of its elements (at most 16,384), as float32.

    The pooler is left out because no scorer reads it, and a folder saved without one gets a
    random one at load. (The first rows of the embedding table, the fingerprint before, are
    BERT's ``[PAD]``/``[unused*]`` rows, which training never changes.)
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name.split(".")[0] == "pooler":
            continue
        flat = tensor.detach().reshape(-1)
        stride = -(-flat.numel() // _SAMPLES_PER_TENSOR) or 1  # ceil; 1 for an empty tensor
        sample = flat[::stride].float().cpu().contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def same_architecture(model: nn.Module) -> str | None:
    """The known model whose config ``model``'s has the shape of, weights aside."""
    shape = _shape(model.config)
    return next((name for name, (known, _) in KNOWN_MODELS.items() if known == shape), None)


def recognise(model: nn.Module) -> str | None:
    """The hub name of the known model that ``model`` is (same architecture and the same
    weights, :func:`weights_fingerprint`), ``None`` for any other.

    >>> from transformers import AutoModel
    >>> from bsloss.scorer.default import embedded_model_path
    >>> recognise(AutoModel.from_pretrained(embedded_model_path()))
    'sentence-transformers/all-MiniLM-L6-v2'
    """
    name = same_architecture(model)
    if name is None or weights_fingerprint(model) != KNOWN_MODELS[name][1]:
        return None
    return name
