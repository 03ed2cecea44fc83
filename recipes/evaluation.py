"""Held-out evaluation: generation, then hard F_BERT (bsloss's exact ``BERTScorer``), the task's
metrics (:mod:`tasks`: ROUGE for summarization, sacreBLEU BLEU and chrF for translation), the
mean length in words, and teacher-forced CE. Each of them shows a tqdm bar on stderr (as
transformers' and TRL's loops do) when stderr is a terminal, nothing otherwise.
"""

from __future__ import annotations

import time

import torch
from config import EvalConfig
from seq2seq import Collator
from tasks import get_task
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from bsloss.integrations.lm_head import IGNORE_INDEX, token_cross_entropy


def progress_bar(total: int, desc: str, show: bool | None = None, unit: str = "example") -> tqdm:
    """A bar over ``total`` examples on stderr; ``show=None`` (tqdm's ``disable=None``): only
    when stderr is a terminal, so a log file gets the run's phase lines and no bar fragments.
    It is cleared when done: the phase's closing line says how long it took."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        leave=False,
        disable=None if show is None else not show,
    )


class TokenProgress(BaseStreamer):
    """``model.generate``'s streamer: the decoding step of the batch in the bar's postfix
    (``token 17/40``), so a batch that decodes for a minute on a CPU shows it advancing.
    ``label`` names the phase, ``after`` is shown once the batch is decoded (``None``: left
    as it is); a subclass may find its bar late (:meth:`current_bar`, ``None``: nothing shown)."""

    def __init__(
        self,
        bar: tqdm | None,
        max_new_tokens: int | None,
        label: str = "token",
        after: str | None = None,
    ):
        self.bar, self.label, self.after = bar, label, after
        self.of = "" if max_new_tokens is None else f"/{max_new_tokens}"
        self.steps, self.shown = -1, 0.0

    def current_bar(self) -> tqdm | None:
        return self.bar

    def _show(self, bar: tqdm, text: str) -> None:
        bar.set_postfix_str(text)
        self.shown = time.monotonic()

    def put(self, value) -> None:
        # generate's first put is the prompt, each later one a decoding step's new tokens
        self.steps += 1
        bar = self.current_bar()
        if self.steps and bar is not None and time.monotonic() - self.shown >= bar.mininterval:
            self._show(bar, f"{self.label} {self.steps}{self.of}")  # at tqdm's refresh rate

    def end(self) -> None:
        self.steps = -1
        bar = self.current_bar()
        if self.after is not None and bar is not None:
            self._show(bar, self.after)


class Evaluator:
    """Held-out generation and scoring: hard F_BERT (exact BERTScorer), the task's metrics,
    the mean length and teacher-forced CE."""

    def __init__(self, task: str, scorer, config: EvalConfig, progress: bool | None = None):
        self.task, self.scorer = get_task(task), scorer
        self.num_beams = config.num_beams
        self.max_new_tokens = config.max_new_tokens
        self.batch_size = config.batch_size
        self.progress = progress  # bars: None on a terminal only, True always, False never

    @torch.no_grad()
    def cross_entropy(self, model, collator: Collator, examples, device) -> float:
        total, tokens = 0.0, 0
        bar = progress_bar(len(examples), "teacher-forced CE", self.progress)
        for start in range(0, len(examples), self.batch_size):
            batch = collator(examples[start : start + self.batch_size])
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch["labels"]
            mean = token_cross_entropy(
                labels, logits=collator.teacher_forced_logits(model, batch, [labels])[0]
            )
            count = int((labels != IGNORE_INDEX).sum())
            total, tokens = total + mean.item() * count, tokens + count
            bar.update(len(labels))
        bar.close()
        return total / max(tokens, 1)

    def metrics(self, hypotheses: list[str], references: list[str], lowercase: bool) -> dict:
        _, _, f = self.scorer.score(hypotheses, references, progress=self.progress)
        result = {"f_bert": float(f.mean())}
        result |= self.task.metrics(hypotheses, references, lowercase)
        result["mean_length"] = sum(len(h.split()) for h in hypotheses) / len(hypotheses)
        return result

    def __call__(self, model, tokenizer, collator, examples, device) -> tuple[dict, list[str]]:
        was_training = model.training
        model.eval()
        hypotheses = generate_answers(
            model, collator, examples, device, self.max_new_tokens, self.batch_size,
            self.num_beams, progress=self.progress,
        )  # fmt: skip
        result = self.metrics(hypotheses, [e.target for e in examples], lowercases(tokenizer))
        result["ce"] = self.cross_entropy(model, collator, examples, device)
        model.train(was_training)
        return result, hypotheses


def generate_answers(
    model,
    collator,
    examples,
    device,
    max_new_tokens: int,
    batch_size: int,
    num_beams: int = 1,
    progress: bool | None = None,
) -> list[str]:
    """The model's decoded outputs for ``examples`` (greedy, or beam search), in batches; a bar
    over the examples (``progress``: see :func:`progress_bar`) with the decoding step of the
    current batch (transformers refuses a streamer with beam search: the bar alone then)."""
    outputs = []
    bar = progress_bar(len(examples), "generating", progress)
    streamer = {}
    if not bar.disable and num_beams == 1:
        streamer["streamer"] = TokenProgress(bar, max_new_tokens)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = {k: v.to(device) for k, v in collator(chunk).items()}
        outputs += collator.decode(
            collator.generate(model, batch, max_new_tokens, num_beams=num_beams, **streamer)
        )
        bar.update(len(chunk))
    bar.close()
    return outputs


def lowercases(tokenizer) -> bool:
    """An uncased generator can't produce capitals: BLEU is then computed lowercased."""
    return tokenizer.decode(tokenizer("Abc", add_special_tokens=False)["input_ids"]) == "abc"
