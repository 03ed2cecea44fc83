"""Held-out evaluation: generation, then hard F_BERT (bsloss's exact ``BERTScorer``), the task's
metrics (:mod:`tasks`: ROUGE for summarization, sacreBLEU BLEU and chrF for translation), the
mean length in words, and teacher-forced CE.
"""

from __future__ import annotations

import torch
from config import EvalConfig
from seq2seq import Collator
from tasks import get_task

from bsloss.integrations.lm_head import IGNORE_INDEX, token_cross_entropy


class Evaluator:
    """Held-out generation and scoring: hard F_BERT (exact BERTScorer), the task's metrics,
    the mean length and teacher-forced CE."""

    def __init__(self, task: str, scorer, config: EvalConfig):
        self.task, self.scorer = get_task(task), scorer
        self.num_beams = config.num_beams
        self.max_new_tokens = config.max_new_tokens
        self.batch_size = config.batch_size

    @torch.no_grad()
    def cross_entropy(self, model, collator: Collator, examples, device) -> float:
        total, tokens = 0.0, 0
        for start in range(0, len(examples), self.batch_size):
            batch = collator(examples[start : start + self.batch_size])
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch["labels"]
            mean = token_cross_entropy(
                labels, logits=collator.teacher_forced_logits(model, batch, [labels])[0]
            )
            count = int((labels != IGNORE_INDEX).sum())
            total, tokens = total + mean.item() * count, tokens + count
        return total / max(tokens, 1)

    def metrics(self, hypotheses: list[str], references: list[str], lowercase: bool) -> dict:
        _, _, f = self.scorer.score(hypotheses, references, progress=False)
        result = {"f_bert": float(f.mean())}
        result |= self.task.metrics(hypotheses, references, lowercase)
        result["mean_length"] = sum(len(h.split()) for h in hypotheses) / len(hypotheses)
        return result

    def __call__(self, model, tokenizer, collator, examples, device) -> tuple[dict, list[str]]:
        was_training = model.training
        model.eval()
        hypotheses = generate_answers(
            model, collator, examples, device, self.max_new_tokens, self.batch_size, self.num_beams
        )
        result = self.metrics(hypotheses, [e.target for e in examples], lowercases(tokenizer))
        result["ce"] = self.cross_entropy(model, collator, examples, device)
        model.train(was_training)
        return result, hypotheses


def generate_answers(
    model, collator, examples, device, max_new_tokens: int, batch_size: int, num_beams: int = 1
) -> list[str]:
    """The model's decoded outputs for ``examples`` (greedy, or beam search), in batches."""
    outputs = []
    for start in range(0, len(examples), batch_size):
        batch = collator(examples[start : start + batch_size])
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs += collator.decode(
            collator.generate(model, batch, max_new_tokens, num_beams=num_beams)
        )
    return outputs


def lowercases(tokenizer) -> bool:
    """An uncased generator can't produce capitals: BLEU is then computed lowercased."""
    return tokenizer.decode(tokenizer("Abc", add_special_tokens=False)["input_ids"]) == "abc"
