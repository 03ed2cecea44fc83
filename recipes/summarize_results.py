"""Markdown tables of recipes/results/<task>/<run>/: test metrics after each run, and paired
bootstrap 95% intervals of each run's difference from the CE-only run (same test examples).

    python recipes/summarize_results.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {"xsum": "xsum-bert2bert.yaml", "bible-es-en": "bible-es-en-bert2bert.yaml"}
METRICS = ("f_bert", "rouge1", "rouge2", "rougeL", "bleu", "chrf", "ce", "mean_length")
RESAMPLES = 1000


def table(task: Path) -> str:
    runs = {
        p.name: json.loads((p / "results.json").read_text())
        for p in sorted(task.iterdir())
        if (p / "results.json").exists()
    }
    keys = [k for k in METRICS if any(k in r.get("after", {}) for r in runs.values())]
    lines = [
        "| run | steps | train s | " + " | ".join(keys) + " |",
        "|---|---:|---:|" + "---:|" * len(keys),
    ]
    for name, result in runs.items():
        after = result.get("after", {})
        cells = [f"{after[k]:.4f}" if k in after else "–" for k in keys]
        lines.append(
            f"| {name} | {result.get('steps', '–')} | {result.get('train_seconds', 0):.0f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def per_example(task: Path, outputs: dict[str, list[str]], references: list[str]) -> dict:
    """Per-example F_BERT and ROUGE-L (summarization) of each run's test outputs."""
    import bsloss

    scorer = bsloss.BERTScorer(device="cpu")
    scores = {}
    for name, hypotheses in outputs.items():
        scores[name] = {"f_bert": scorer.score(hypotheses, references, progress=False)[2].numpy()}
        if task.name == "xsum":
            from rouge_score import rouge_scorer

            rouge = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
            scores[name]["rougeL"] = np.array(
                [
                    rouge.score(r, h)["rougeL"].fmeasure
                    for h, r in zip(hypotheses, references, strict=True)
                ]
            )
    return scores


def bootstrap(task: Path) -> str:
    from common import load_config, load_splits

    config = load_config(Path(__file__).resolve().parent / "configs" / CONFIGS[task.name], [])
    references = [e.target for e in load_splits(config["data"])["test"]]
    outputs = {
        p.name: (p / "test_outputs.txt").read_text(encoding="utf-8").splitlines()
        for p in sorted(task.iterdir())
        if (p / "test_outputs.txt").exists() and p.name != "ce-stage"
    }
    if "ce" not in outputs:
        return ""
    scores = per_example(task, outputs, references)
    rng = np.random.default_rng(0)
    samples = rng.integers(0, len(references), size=(RESAMPLES, len(references)))
    lines = [
        "| run − ce | metric | Δ (test) | 95% bootstrap interval |",
        "|---|---|---:|---|",
    ]
    for name in outputs:
        if name == "ce":
            continue
        for metric, values in scores[name].items():
            delta = values - scores["ce"][metric]
            means = delta[samples].mean(axis=1)
            low, high = np.percentile(means, [2.5, 97.5])
            lines.append(f"| {name} | {metric} | {delta.mean():+.4f} | [{low:+.4f}, {high:+.4f}] |")
        if task.name != "xsum":
            import sacrebleu

            def bleu(hyps, idx):
                return sacrebleu.corpus_bleu(
                    [hyps[i] for i in idx], [[references[i] for i in idx]], lowercase=True
                ).score

            deltas = np.array(
                [bleu(outputs[name], s) - bleu(outputs["ce"], s) for s in samples[:300]]
            )
            full = bleu(outputs[name], range(len(references))) - bleu(
                outputs["ce"], range(len(references))
            )
            low, high = np.percentile(deltas, [2.5, 97.5])
            lines.append(
                f"| {name} | bleu (lowercased) | {full:+.2f} | [{low:+.2f}, {high:+.2f}] |"
            )
    return "\n".join(lines)


def main() -> None:
    for task in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        print(f"### {task.name} (test split)\n\n{table(task)}\n")
        print(f"{bootstrap(task)}\n")


if __name__ == "__main__":
    main()
