"""Which known model a loaded scorer is, whatever folder it came from.

A scorer loaded from a local folder (the embedded model's own folder, a converted offline model,
a copy made with ``hf download``) is recognised by what it holds, not by its path: its
architecture (the config's shape) and a fingerprint of its token-embedding table. A recognised
folder gets the model's hub name, so the layer table and the shipped baselines apply to it. A
fine-tuned copy has the same shape but other weights: it is not taken for the original (its
baseline would differ), and the message for a missing ``num_layers`` says so.
"""

from __future__ import annotations

import hashlib

from torch import nn

__all__ = ["KNOWN_MODELS", "recognise", "embedding_fingerprint", "same_architecture"]

# hub name -> (the config's shape, sha256 prefix of the first 16 rows of the float32 input
# embeddings). The shapes and fingerprints are checked against the installed models in
# tests/test_identity.py.
KNOWN_MODELS: dict[str, tuple[tuple, str]] = {
    "sentence-transformers/all-MiniLM-L6-v2": (
        ("bert", 6, 384, 12, 1536, 30522),
        "de4abfc4733d5baa",
    ),
    "sentence-transformers/all-mpnet-base-v2": (
        ("mpnet", 12, 768, 12, 3072, 30527),
        "843bcf7bb92b2cc5",
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


def embedding_fingerprint(model: nn.Module) -> str:
    """sha256 prefix of the first 16 rows of ``model``'s input embeddings, as float32."""
    rows = model.get_input_embeddings().weight[:16].detach().float().cpu().contiguous()
    return hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]


def same_architecture(model: nn.Module) -> str | None:
    """The known model whose config ``model``'s has the shape of, weights aside."""
    shape = _shape(model.config)
    return next((name for name, (known, _) in KNOWN_MODELS.items() if known == shape), None)


def recognise(model: nn.Module) -> str | None:
    """The hub name of the known model that ``model`` is (same architecture and the same
    embedding weights), ``None`` for any other.

    >>> from transformers import AutoModel
    >>> from bsloss.scorer.default import embedded_model_path
    >>> recognise(AutoModel.from_pretrained(embedded_model_path()))
    'sentence-transformers/all-MiniLM-L6-v2'
    """
    name = same_architecture(model)
    if name is None or embedding_fingerprint(model) != KNOWN_MODELS[name][1]:
        return None
    return name
