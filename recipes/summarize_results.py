"""The tables of recipes/RESULTS.md, from the study's outputs (``recipes/run_results.sh``).

    python recipes/summarize_results.py > recipes/results/tables.md

For each task, every run's test outputs (``recipes/results/<task>/<run>-s<seed>/test_outputs.txt``)
and the zero-shot outputs are re-scored here, example by example, with
- the training scorer (the embedded all-MiniLM-L6-v2, hard F_BERT, as in the loss),
- an independent scorer the loss never saw (all-mpnet-base-v2, last layer, hard F_BERT),
- ROUGE-1/2/L (summarization) or sacreBLEU BLEU and chrF (translation, corpus-level).
Tables: each run's mean over seeds ± the standard deviation over seeds; then each run's
difference from CE only, averaged over seeds, with a paired bootstrap 95% interval over test
examples (the same resampled examples for both runs) and the number of seeds whose own
difference is positive.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

RECIPES = Path(__file__).resolve().parent
RESULTS = RECIPES / "results"
CONFIGS = {"xsum": "xsum-gemma.yaml", "bible-es-en": "bible-es-en-gemma.yaml"}
RUNS = ("ce", "hard", "soft")
RESAMPLES = 1000
NAMES = {
    "f_bert": "F_BERT MiniLM (training)",
    "f_bert_mpnet": "F_BERT mpnet (independent)",
    "rouge1": "ROUGE-1",
    "rouge2": "ROUGE-2",
    "rougeL": "ROUGE-L",
    "bleu": "BLEU",
    "chrf": "chrF",
    "words": "words",
}


def load_runs(task: Path) -> tuple[dict[str, dict[int, list[str]]], list[str] | None]:
    """``{run: {seed: outputs}}`` and the zero-shot outputs (None when none was recorded)."""
    runs: dict[str, dict[int, list[str]]] = defaultdict(dict)
    zero_shot = None
    for folder in sorted(p for p in task.iterdir() if p.is_dir()):
        run, _, seed = folder.name.rpartition("-s")
        if run not in RUNS or not (folder / "test_outputs.txt").exists():
            continue
        runs[run][int(seed)] = _lines(folder / "test_outputs.txt")
        if (folder / "test_outputs_before.txt").exists():
            zero_shot = _lines(folder / "test_outputs_before.txt")
    return dict(runs), zero_shot


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


class Scores:
    """Per-example scores of output lists against one task's references; corpus BLEU and chrF
    of any subset of examples."""

    def __init__(self, task: str, references: list[str]):
        import bsloss

        self.task, self.references = task, references
        self.scorers = {
            "f_bert": bsloss.BERTScorer(device="cpu"),
            "f_bert_mpnet": bsloss.BERTScorer("all-mpnet-base-v2", num_layers=12, device="cpu"),
        }

    def per_example(self, outputs: list[str]) -> dict[str, np.ndarray]:
        if len(outputs) != len(self.references):
            raise ValueError(f"{len(outputs)} outputs for {len(self.references)} references")
        scores = {
            name: scorer.score(outputs, self.references, progress=False)[2].numpy()
            for name, scorer in self.scorers.items()
        }
        if self.task == "xsum":
            from rouge_score import rouge_scorer

            rouge = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
            rows = [rouge.score(r, h) for h, r in zip(outputs, self.references, strict=True)]
            for key in ("rouge1", "rouge2", "rougeL"):
                scores[key] = np.array([row[key].fmeasure for row in rows])
        scores["words"] = np.array([len(h.split()) for h in outputs], dtype=float)
        return scores

    def corpus(self, outputs: list[str], subset: np.ndarray) -> dict[str, float]:
        if self.task == "xsum":
            return {}
        import sacrebleu

        hypotheses = [outputs[i] for i in subset]
        references = [[self.references[i] for i in subset]]
        return {
            "bleu": sacrebleu.corpus_bleu(hypotheses, references).score,
            "chrf": sacrebleu.corpus_chrf(hypotheses, references).score,
        }


def corpus_difference(scores: Scores, metric: str, pairs, everything, samples):
    """A corpus score's difference (run − ce), averaged over seeds, on all examples and on each
    bootstrap resample of them."""

    def delta(subset: np.ndarray) -> float:
        return float(
            np.mean(
                [
                    scores.corpus(run, subset)[metric] - scores.corpus(ce, subset)[metric]
                    for run, ce in pairs
                ]
            )
        )

    return delta(everything), np.array([delta(subset) for subset in samples])


def task_tables(task: Path) -> str:
    from common import load_config, load_splits

    config = load_config(RECIPES / "configs" / CONFIGS[task.name], [])
    references = [e.target for e in load_splits(config["data"])["test"]]
    runs, zero_shot = load_runs(task)
    if "ce" not in runs:
        return f"(no CE runs under {task})"
    scores = Scores(task.name, references)
    everything = np.arange(len(references))
    per_example = {
        run: {seed: scores.per_example(outputs) for seed, outputs in seeds.items()}
        for run, seeds in runs.items()
    }
    for run, seeds in runs.items():
        for seed, outputs in seeds.items():
            per_example[run][seed].update(scores.corpus(outputs, everything))
    metrics = list(next(iter(per_example["ce"].values())))

    def mean(values):  # a per-example array's mean, or a corpus score as it is
        return float(np.mean(values))

    lines = [
        f"Test examples: {len(references)}.\n",
        "| run | seeds | " + " | ".join(NAMES[m] for m in metrics) + " |",
        "|---|---:|" + "---:|" * len(metrics),
    ]
    if zero_shot is not None:
        zero = scores.per_example(zero_shot) | scores.corpus(zero_shot, everything)
        cells = [f"{mean(zero[m]):.4f}" for m in metrics]
        lines.append("| zero-shot | – | " + " | ".join(cells) + " |")
    for run in RUNS:
        if run not in per_example:
            continue
        seeds = per_example[run]
        cells = []
        for m in metrics:
            values = [mean(seeds[s][m]) for s in seeds]
            spread = np.std(values, ddof=1) if len(values) > 1 else 0.0
            cells.append(f"{np.mean(values):.4f} ± {spread:.4f}")
        lines.append(f"| {run} | {len(seeds)} | " + " | ".join(cells) + " |")

    rng = np.random.default_rng(0)
    samples = rng.integers(0, len(references), size=(RESAMPLES, len(references)))
    lines += [
        "",
        "| run − ce | metric | Δ (mean over seeds) | 95% paired bootstrap | seeds with Δ > 0 |",
        "|---|---|---:|---|---:|",
    ]
    for run in ("hard", "soft"):
        if run not in per_example:
            continue
        seeds = sorted(set(per_example[run]) & set(per_example["ce"]))
        for m in metrics:
            if m in ("bleu", "chrf"):  # corpus scores: recomputed on each resample
                pairs = [(runs[run][s], runs["ce"][s]) for s in seeds]
                full, resampled = corpus_difference(scores, m, pairs, everything, samples)
            else:
                pairs = [(per_example[run][s][m], per_example["ce"][s][m]) for s in seeds]
                difference = np.mean([a - b for a, b in pairs], axis=0)
                full, resampled = difference.mean(), difference[samples].mean(axis=1)
            per_seed = [mean(per_example[run][s][m]) - mean(per_example["ce"][s][m]) for s in seeds]
            low, high = np.percentile(resampled, [2.5, 97.5])
            lines.append(
                f"| {run} | {NAMES[m]} | {full:+.4f} | [{low:+.4f}, {high:+.4f}] "
                f"| {sum(d > 0 for d in per_seed)}/{len(seeds)} |"
            )
    return "\n".join(lines)


def main() -> None:
    for name in CONFIGS:
        task = RESULTS / name
        if task.is_dir():
            print(f"### {name} (test split)\n\n{task_tables(task)}\n")
    costs = [
        json.loads(p.read_text()).get("train_seconds") for p in RESULTS.glob("*/*/results.json")
    ]
    costs = [c for c in costs if c]
    if costs:
        print(f"Runs: {len(costs)}, {np.mean(costs) / 60:.1f} min each on average (train + test).")


if __name__ == "__main__":
    main()
