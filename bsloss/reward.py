"""BERTScore as a reward for reinforcement learning.

:class:`BERTScoreReward` is a callable with the reward-function signature of Hugging Face TRL
(``GRPOTrainer(reward_funcs=...)``, also ``RLOOTrainer``)::

    reward(prompts=[...], completions=[...], **dataset_columns) -> list[float]

Completions are strings (standard format) or lists of chat messages (conversational format:
the ``content`` of the last assistant message is scored, or of the last message where none has
the role). The references come from the dataset column named
by ``reference_column``; each is one string or a list of strings (the best one counts, as in
:meth:`bsloss.BERTScorer.score`). The score is the exact, hard-matching BERTScore of
:class:`~bsloss.BERTScorer`, whose reference embeddings are cached across calls: a reward is asked
for the same references over and over. The scorer's warnings (an empty completion scores 0, a
text cut at the model's maximum, ...) are given once per kind and reward, not at every step.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

from bsloss._warnings import warn_user
from bsloss.inputs import check_int, check_reference_groups, check_text
from bsloss.metric import BERTScorer

__all__ = ["BERTScoreReward"]

_TARGETS = {"f1": 2, "precision": 0, "recall": 1}
# keyword arguments TRL passes besides the dataset columns
_TRAINER_KEYWORDS = {"completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}


def completion_text(completion: Any, index: int) -> str:
    """The text of one completion: a string, or the ``content`` (a string, or multimodal parts
    whose text parts are joined by spaces) of the last chat message from the assistant, or of
    the last message where none is: a multi-turn completion with tools may end on a tool's
    output, which is not the model's answer (audit h26: it was scored, 0.127 against a
    reference equal to the answer)."""
    if isinstance(completion, str):
        return check_text(completion, f"completions[{index}]")
    if isinstance(completion, dict) and "content" in completion:
        return _content(completion["content"], index)
    if isinstance(completion, Sequence) and completion:
        spoken = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        last = spoken[-1] if spoken else completion[-1]
        if isinstance(last, dict) and "content" in last:
            return _content(last["content"], index)
    raise TypeError(
        f"completions[{index}] must be a string or a list of chat messages "
        f"({{'role': ..., 'content': ...}}), got {type(completion).__name__}"
    )


def _content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return check_text(content, f"completions[{index}]")
    # multimodal messages: content is a list of {"type": "text", "text": ...} parts
    if isinstance(content, list):
        parts = []
        for number, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text":
                where = f"completions[{index}] content[{number}]['text']"
                if "text" not in part:  # scored as "" before: a malformed message
                    raise TypeError(f"{where} is missing: a text part holds its text there")
                parts.append(check_text(part["text"], where))
        return " ".join(parts)
    raise TypeError(
        f"completions[{index}]: message content must be a string, got {type(content).__name__}"
    )


# the scorer's keywords, deprecated here (a BERTScorer as scorer= holds them), and defaults
_SCORER_KEYWORDS = {
    "idf": False,
    "rescale_with_baseline": False,
    "baseline_path": None,
    "batch_size": 64,
    "device": None,
    "autocast_dtype": None,
}


class BERTScoreReward:
    """Hard-matching BERTScore of each completion against its reference(s), as a reward.

    Args:
        model, num_layers: the scorer's model and layer, as for :class:`~bsloss.BERTScorer` (its
            shorthand); anything more about the scorer: pass ``scorer``.
        reference_column: the dataset column that holds the reference(s).
        target: ``"f1"``, ``"precision"`` or ``"recall"``.
        reference_cache_size: reference texts whose embeddings are kept across calls.
        scorer: an existing :class:`~bsloss.BERTScorer` to use (its ``idf``,
            ``rescale_with_baseline``, ``batch_size``, ``device``... are the reward's: ``model``,
            ``num_layers`` or a scorer keyword beside it is refused, and so is ``idf=True``,
            idf from each call's references, which would score a pair by its batch). If its
            reference cache is off, the reward scores with
            :meth:`~bsloss.BERTScorer.with_reference_cache` (the same encoder and settings, its
            own cache of ``reference_cache_size``): the scorer passed in is not changed.
        deprecated: the scorer's keywords ``idf``, ``rescale_with_baseline``,
            ``baseline_path``, ``batch_size``, ``device``, ``autocast_dtype`` still work, with a
            ``DeprecationWarning``: pass ``scorer=BERTScorer(model, ..., idf=...)``.

    Returns:
        Called as TRL calls a reward function, ``reward(prompts=..., completions=...,
        **columns)``, it returns one float per completion.

    Raises:
        ValueError, TypeError: an argument of the wrong type or out of range, a scorer setting
            beside ``scorer``, or a scorer with ``idf=True`` or ``all_layers=True``, named.
        KeyError: at call time, no ``reference_column`` among the columns.

    >>> import bsloss
    >>> reward = bsloss.BERTScoreReward()
    >>> scores = reward(completions=["a cat sat", "hello"], reference=["a cat sat", "bye"])
    >>> round(scores[0], 4), scores[1] < 1
    (1.0, True)
    """

    def __init__(
        self,
        model: str | None = None,
        num_layers: int | None = None,
        *,
        reference_column: str = "reference",
        target: str = "f1",
        reference_cache_size: int = 100_000,
        scorer: BERTScorer | None = None,
        **deprecated: Any,
    ):
        for name in deprecated:
            if name not in _SCORER_KEYWORDS:
                raise TypeError(f"BERTScoreReward() got an unexpected keyword argument {name!r}")
            warn_user(
                f"BERTScoreReward({name}=...) is deprecated: pass "
                f"scorer=BERTScorer(model, num_layers, {name}=...) (see the migration table in "
                "CHANGELOG.md)",
                DeprecationWarning,
            )
        options = {**_SCORER_KEYWORDS, **deprecated}
        idf = options["idf"]
        if not isinstance(target, str) or target not in _TARGETS:
            raise ValueError(f"target must be one of {tuple(_TARGETS)}, got {target!r}")
        if not isinstance(reference_column, str) or not reference_column:
            raise TypeError(
                "reference_column must be the name of the dataset column that holds the "
                f"references (a non-empty string), got {reference_column!r}"
            )
        if idf is True:
            raise ValueError(
                "idf=True would weigh each call by its own references; pass the reference "
                "corpus as idf=[...] for a reward that is stable across calls"
            )
        reference_cache_size = check_int(reference_cache_size, "reference_cache_size", 0)
        if scorer is not None and not isinstance(scorer, BERTScorer):
            raise TypeError(f"scorer must be a BERTScorer, got {type(scorer).__name__}")
        if scorer is not None:
            # the scorer holds these; taking one besides it would leave it silently unused
            given = [
                name
                for name, value in (("model", model), ("num_layers", num_layers))
                if value is not None
            ] + list(deprecated)
            if given:
                raise ValueError(
                    f"{', '.join(given)} and scorer= given together: the scorer's settings are "
                    f"the reward's; build the scorer with them, BERTScorer(..., {given[0]}=...)"
                )
            if scorer.idf is True:
                raise ValueError(
                    "scorer has idf=True, which would weigh each call by its own references (the "
                    "same pair would score differently in another batch); build it with the "
                    "reference corpus as idf=[...], or call scorer.compute_idf(corpus) first"
                )
            if scorer.all_layers:
                raise ValueError(
                    "scorer has all_layers=True, which scores every layer ([layers, N] scores); "
                    "a reward is one float per completion: build the scorer without all_layers "
                    "(num_layers= chooses the layer)"
                )
        self.scorer = scorer or BERTScorer(
            model,
            num_layers,
            **{**options, "reference_cache_size": reference_cache_size},
        )
        if scorer is not None and not scorer.reference_cache_size and reference_cache_size:
            self.scorer = scorer.with_reference_cache(reference_cache_size)
        self.reference_column = reference_column
        self.target = target
        # trainers log each reward function under its __name__
        self.__name__ = f"bertscore_{target}"
        self._warned: set[tuple[type, str]] = set()  # the kinds of warning given already

    def __call__(
        self,
        prompts: Sequence[Any] | None = None,
        completions: Sequence[Any] | None = None,
        **columns: Any,
    ) -> list[float]:
        """The reward of each completion: a list of floats.

        Raises:
            TypeError: completions or references that are not lists (a single string is refused:
                it would be scored character by character), or an entry of the wrong type.
            KeyError: no reference column among the keyword arguments.
            ValueError: lengths that differ, an empty list of references, invalid Unicode.
        """
        if completions is None:
            raise TypeError("BERTScoreReward needs completions=[...]")
        if isinstance(completions, str) or not isinstance(completions, Sequence):
            raise TypeError(
                f"completions must be a list (of strings or of chat messages), got "
                f"{type(completions).__name__}"
            )
        if self.reference_column not in columns:
            given = sorted(k for k in columns if k not in _TRAINER_KEYWORDS)
            why = ""
            if self.reference_column in ("prompt", "completion", "prompts", "completions"):
                why = (
                    f" (TRL passes the prompt and completion columns as prompts= and "
                    f"completions=, never as {self.reference_column!r})"
                )
            raise KeyError(
                f"no reference column {self.reference_column!r} among the dataset columns "
                f"passed to the reward ({given}){why}; set reference_column= to the column that "
                "holds the references"
            )
        if isinstance(prompts, Sequence) and len(prompts) != len(completions):
            # unread here, but a batch whose prompts and completions differ in number is not
            # the batch its references were taken for
            raise ValueError(f"{len(completions)} completions but {len(prompts)} prompts")
        references = columns[self.reference_column]
        check_reference_groups(references, self.reference_column)
        if len(references) != len(completions):
            raise ValueError(
                f"{len(completions)} completions but {len(references)} references in column "
                f"{self.reference_column!r}"
            )
        texts = [completion_text(c, i) for i, c in enumerate(completions)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scores = self.scorer.score(texts, list(references), progress=False)
        self._warn_once_per_kind(caught)
        return scores[_TARGETS[self.target]].tolist()

    def _warn_once_per_kind(self, caught: list[warnings.WarningMessage]) -> None:
        """The scorer's warnings of one call, each kind once per reward: their text names the
        call's positions, so Python's own filter would repeat them at every training step."""
        for warning in caught:
            message = str(warning.message)
            kind = (warning.category, re.sub(r"\d+", "#", message.split(": candidate index")[0]))
            if kind in self._warned:
                continue
            self._warned.add(kind)
            warn_user(f"{message} (this reward gives this warning once)", warning.category)

    def clear_cache(self) -> None:
        """Forget the cached reference embeddings."""
        self.scorer.clear_cache()
