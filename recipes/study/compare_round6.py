"""A re-run of seed 0's `sampled` beside the mixin re-runs of `sampled` and `ce`
(recipes/results/study/mixin-seed0/): test scores and paired bootstrap differences over the
200 test verses (recipes/RESULTS.md, "Round 6's gradient").

    python recipes/study/compare_round6.py recipes/results/study/mixin-seed0/sampled-round6
    python recipes/study/compare_round6.py <re-run> [<earlier re-run> ...]   # also against those
"""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

from config import load_config  # noqa: E402
from examples import load_splits  # noqa: E402
from summarize_results import Scores, paired_difference  # noqa: E402
from tasks import get_task  # noqa: E402

METRICS = ["f_bert", "f_bert_mpnet", "bleu", "chrf"]


def cell(metric: str, value: float) -> str:
    return f"{value:+.4f}" if metric.startswith("f_") else f"{value:+.2f}"


def main(rerun: Path, *earlier: Path) -> None:
    config = load_config(ROOT / "recipes/configs/bible-es-en-gemma-stage2.yaml", [])
    references = [e.target for e in load_splits(config.data)["test"]]
    mixin = ROOT / "recipes/results/study/mixin-seed0"
    runs = {
        "the re-run": rerun,
        "mixin sampled": mixin / "sampled",
        "mixin ce": mixin / "ce",
        **{folder.name: folder for folder in earlier},
    }
    outputs = {
        name: (folder / "test_outputs.txt").read_text(encoding="utf-8").splitlines()
        for name, folder in runs.items()
    }
    scores = Scores(get_task(config.task), references)
    print("| run | " + " | ".join(METRICS) + " |")
    print("|---|" + "---:|" * len(METRICS))
    for name, answers in outputs.items():
        means = scores.all(answers)
        print(f"| {name} | " + " | ".join(f"{means[m]:.4f}" for m in METRICS) + " |")
    samples = np.random.default_rng(0).integers(0, len(references), (1000, len(references)))
    print("\n| comparison | " + " | ".join(METRICS) + " |")
    print("|---|" + "---|" * len(METRICS))
    pairs = [("the re-run", "mixin ce"), ("mixin sampled", "mixin ce"),
             ("the re-run", "mixin sampled")]  # fmt: skip
    for a, b in pairs + [("the re-run", folder.name) for folder in earlier]:
        cells = []
        for metric in METRICS:
            pair = [(outputs[a], outputs[b])]
            mean, low, high, _ = paired_difference(scores, metric, pair, samples)
            cells.append(f"{cell(metric, mean)} [{cell(metric, low)}, {cell(metric, high)}]")
        print(f"| {a} − {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:]))
