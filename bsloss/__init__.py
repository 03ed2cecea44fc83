"""bsloss: BERTScore as a training signal.

Exact BERTScore for evaluation (:class:`BERTScorer`, :func:`score`) and its pure tensor core
(:mod:`bsloss.functional`).
"""

__version__ = "0.1.0"

from bsloss.metric import BERTScorer, score  # noqa: E402

__all__ = ["BERTScorer", "score", "__version__"]
