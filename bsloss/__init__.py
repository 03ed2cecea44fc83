"""bsloss: BERTScore as a training signal.

Exact BERTScore for evaluation (:class:`BERTScorer`, :func:`score`), differentiable BERTScore
losses (:class:`BERTScoreLoss`), and their shared pure tensor core (:mod:`bsloss.functional`).
"""

__version__ = "0.1.0"

from bsloss.bridge import VocabularyBridge  # noqa: E402
from bsloss.loss import BERTScoreLoss  # noqa: E402
from bsloss.metric import BERTScorer, score  # noqa: E402
from bsloss.plot import plot_example  # noqa: E402
from bsloss.reward import BERTScoreReward  # noqa: E402

__all__ = [
    "BERTScorer",
    "BERTScoreLoss",
    "BERTScoreReward",
    "VocabularyBridge",
    "plot_example",
    "score",
    "__version__",
]
