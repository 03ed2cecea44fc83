"""The recipes' tasks: what differs between summarization and translation, in one place.

A task is a small object: the plain prompt a base LM continues (:mod:`prompting`; a chat template
or ``data.prompt_format`` may replace it), and the held-out metrics reported beside F_BERT, as
corpus scores (:class:`evaluation.Evaluator`), per example (``summarize_results.py``'s paired
bootstrap) and as sacreBLEU metric objects whose sentence statistics a bootstrap resamples. The
config's ``task`` names one (:data:`TASKS`). A new task is a subclass here and an entry of
:data:`TASKS`; nothing else switches on the task's name.
"""

from __future__ import annotations


class Task:
    """A recipe task: its name, its plain prompt (with ``{source}``), its metrics."""

    name: str
    prompt_format: str
    metrics_note: str = ""  # the task's metrics, for the summary table's footer

    def per_example(self, hypotheses: list[str], references: list[str]) -> dict[str, list[float]]:
        """Metrics that are means of per-example scores (``{}``: none)."""
        return {}

    def corpus_metrics(self, lowercase: bool = False) -> dict:
        """sacreBLEU metric objects of the corpus-level scores (``{}``: none); ``lowercase``:
        an uncased generator's outputs, compared lowercased where the metric is cased."""
        return {}

    def metrics(
        self, hypotheses: list[str], references: list[str], lowercase: bool = False
    ) -> dict[str, float]:
        """Every metric of the task on a test set (``lowercase``: see :meth:`corpus_metrics`)."""
        result = {k: sum(v) / len(v) for k, v in self.per_example(hypotheses, references).items()}
        for name, metric in self.corpus_metrics(lowercase).items():
            result[name] = metric.corpus_score(hypotheses, [references]).score
        return result


class Summarization(Task):
    """One-sentence summaries of news articles (XSum): ROUGE-1/2/L."""

    name = "summarization"
    prompt_format = "Article: {source}\n\nSummary of the article in one sentence:"
    metrics_note = "rouge*: ROUGE F-measures against the reference summary"

    def per_example(self, hypotheses: list[str], references: list[str]) -> dict[str, list[float]]:
        """ROUGE-1/2/L F-measures (``rouge-score``, with stemming)."""
        from rouge_score import rouge_scorer

        rouge = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
        rows = [rouge.score(r, h) for h, r in zip(hypotheses, references, strict=True)]
        return {key: [row[key].fmeasure for row in rows] for key in ("rouge1", "rouge2", "rougeL")}


class Translation(Task):
    """Spanish -> English verses (the Bible): sacreBLEU's BLEU and chrF, corpus-level."""

    name = "translation"
    prompt_format = "Spanish: {source}\nEnglish:"
    metrics_note = "bleu, chrf: sacreBLEU's corpus BLEU and chrF against the reference"

    def corpus_metrics(self, lowercase: bool = False) -> dict:
        from sacrebleu.metrics import BLEU, CHRF

        return {"bleu": BLEU(lowercase=lowercase), "chrf": CHRF()}  # chrF: cased, as always


TASKS: dict[str, Task] = {task.name: task for task in (Summarization(), Translation())}


def get_task(name: str) -> Task:
    """The task the config's ``task`` names."""
    if name not in TASKS:
        raise ValueError(f"config task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]
