"""bsloss: BERTScore as a training signal.

Exact BERTScore for evaluation (:class:`BERTScorer`, :func:`score`), differentiable BERTScore
losses (:class:`BERTScoreLoss`), and their shared pure tensor core (:mod:`bsloss.functional`).
The token matchings (:class:`Hard`, :class:`Softmax`, :class:`LogSumExp`, :class:`Sinkhorn`, or
a subclass of :class:`Matching`) are passed as ``matching=`` objects or string shorthands; the
candidate-distribution transforms (:class:`TopK`, :class:`StraightThrough`, :class:`Gumbel`) as
``candidate_transforms=`` objects; the candidates as values (:class:`Logits`,
:class:`Probabilities`, :class:`TokenIds`, :class:`Embeddings`, :class:`LMHeadInputs`); a generator
vocabulary that is not the scorer's as one :class:`Bridge`.
"""

from bsloss._version import __version__
from bsloss.bridge import Bridge, VocabularyBridge
from bsloss.candidate_inputs import Embeddings, LMHeadInputs, Logits, Probabilities, TokenIds
from bsloss.candidate_transforms import CandidateTransform, Gumbel, StraightThrough, TopK
from bsloss.functional.matching import Hard, LogSumExp, Matching, Sinkhorn, Softmax
from bsloss.loss import BERTScoreLoss
from bsloss.metric import BERTScorer, plot_example, score
from bsloss.reward import BERTScoreReward

__all__ = [
    "BERTScorer",
    "BERTScoreLoss",
    "BERTScoreReward",
    "Bridge",
    "VocabularyBridge",
    "Logits",
    "Probabilities",
    "TokenIds",
    "Embeddings",
    "LMHeadInputs",
    "Matching",
    "Hard",
    "Softmax",
    "LogSumExp",
    "Sinkhorn",
    "CandidateTransform",
    "TopK",
    "StraightThrough",
    "Gumbel",
    "plot_example",
    "score",
    "__version__",
]
