"""The tables of recipes/RESULTS.md, from the study's outputs (``recipes/run_results.sh``).

    python recipes/summarize_results.py > recipes/results/tables.md
    python recipes/summarize_results.py recipes/results/fixed-gradient  # the re-run (RESULTS.md)

For each task, every run's test outputs (``recipes/results/<task>/<run>-s<seed>/test_outputs.txt``)
and the zero-shot outputs are re-scored here, example by example, with
- the training scorer (the embedded all-MiniLM-L6-v2, hard F_BERT, as in the loss),
- an independent scorer the loss never saw (all-mpnet-base-v2, last layer, hard F_BERT),
- ROUGE-1/2/L (summarization) or sacreBLEU BLEU and chrF (translation, corpus-level).
Tables: each run's mean over seeds ± the standard deviation over seeds (one seed: its value
alone); then each run's difference from CE only, averaged over seeds, with a paired bootstrap
95% interval over test examples (the same resampled examples for both runs) and the number of
seeds whose own difference is positive.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
from tasks import Task, get_task

RECIPES = Path(__file__).resolve().parent
RESULTS = RECIPES / "results"
CONFIGS = {"xsum": "xsum-gemma.yaml", "bible-es-en": "bible-es-en-gemma.yaml"}
RUNS = ("ce", "hard", "soft")
RESAMPLES = 1000
DIGITS = {"bleu": 2, "chrf": 2, "words": 2}  # decimals shown; 4 for the scores in [0, 1]
NAMES = {
    "f_bert": "F_BERT MiniLM (training)",
    "f_bert_mpnet": "F_BERT mpnet (independent)",
    "p_bert": "P_BERT MiniLM (training)",
    "r_bert": "R_BERT MiniLM (training)",
    "p_bert_mpnet": "P_BERT mpnet (independent)",
    "r_bert_mpnet": "R_BERT mpnet (independent)",
    "rouge1": "ROUGE-1",
    "rouge2": "ROUGE-2",
    "rougeL": "ROUGE-L",
    "bleu": "BLEU",
    "chrf": "chrF",
    "words": "words",
}
# F_BERT's parts, kept per example beside it (the length check of study/summary.py) but not
# columns of the main tables
COMPONENTS = ("p_bert", "r_bert", "p_bert_mpnet", "r_bert_mpnet")


def load_runs(task: Path) -> tuple[dict[str, dict[int, list[str]]], list[str] | None]:
    """``{run: {seed: outputs}}`` and the zero-shot outputs (None when none was recorded)."""
    runs: dict[str, dict[int, list[str]]] = defaultdict(dict)
    zero_shot = None
    for folder in sorted(p for p in task.iterdir() if p.is_dir()):
        run, _, seed = folder.name.rpartition("-s")
        if not run or not seed.isdigit() or not (folder / "test_outputs.txt").exists():
            continue
        runs[run][int(seed)] = _lines(folder / "test_outputs.txt")
        if (folder / "test_outputs_before.txt").exists():
            zero_shot = _lines(folder / "test_outputs_before.txt")
    order = [r for r in RUNS if r in runs] + sorted(set(runs) - set(RUNS))
    return {run: runs[run] for run in order}, zero_shot


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


@functools.cache
def scorers(independent: bool = True) -> dict:
    """The training scorer and (``independent``) the independent one, loaded once for every
    task."""
    import bsloss

    # every list of outputs is scored against the same references: embed them once
    kept = {"device": "cpu", "reference_cache_size": 10_000}
    loaded = {"f_bert": bsloss.BERTScorer(**kept)}
    if independent:
        loaded["f_bert_mpnet"] = bsloss.BERTScorer("all-mpnet-base-v2", num_layers=12, **kept)
    return loaded


# A stored score is keyed by everything it depends on (the texts, the task, the scorers and
# bsloss's version); bump this when Scores.per_example changes what it computes.
STORE_FORMAT = 2


def default_store() -> Path:
    """Where the summaries keep per-example scores between runs (``BSLOSS_SCORES_CACHE``)."""
    return Path(os.environ.get("BSLOSS_SCORES_CACHE", Path.home() / ".cache/bsloss/scores"))


class Scores:
    """Per-example scores of output lists against one task's references; corpus BLEU and chrF
    of any subset of examples. With ``store`` (a folder), per-example scores are also kept on
    disk, so that a summary re-run as a study's runs arrive re-scores only the new outputs."""

    def __init__(
        self,
        task: Task,
        references: list[str],
        store: Path | None = None,
        independent: bool = True,
    ):
        self.task, self.references, self.store = task, references, store
        # independent=False: the training scorer alone (where all-mpnet-base-v2 is not installed)
        self.scorers = scorers(independent)
        self._cache: dict[tuple[str, ...], dict[str, np.ndarray]] = {}
        self._statistics: dict[tuple[str, ...], dict[str, np.ndarray]] = {}
        self._corpus_metrics = task.corpus_metrics()

    def per_example(self, outputs: list[str]) -> dict[str, np.ndarray]:
        if len(outputs) != len(self.references):
            raise ValueError(f"{len(outputs)} outputs for {len(self.references)} references")
        scores = {}
        for name, scorer in self.scorers.items():
            precision, recall, f = scorer.score(outputs, self.references, progress=False)
            part = name.removeprefix("f_")
            scores |= {name: f.numpy(), f"p_{part}": precision.numpy(), f"r_{part}": recall.numpy()}
        for key, values in self.task.per_example(outputs, self.references).items():
            scores[key] = np.array(values)
        scores["words"] = np.array([len(h.split()) for h in outputs], dtype=float)
        return scores

    def cached(self, outputs: list[str]) -> dict[str, np.ndarray]:
        """:meth:`per_example`, computed once per list of outputs."""
        key = tuple(outputs)
        if key not in self._cache:
            self._cache[key] = self._stored(outputs) if self.store else self.per_example(outputs)
        return self._cache[key]

    def _stored(self, outputs: list[str]) -> dict[str, np.ndarray]:
        import bsloss

        identity = [STORE_FORMAT, bsloss.__version__, self.task.name, sorted(self.scorers)]
        digest = hashlib.sha256(json.dumps([identity, outputs, self.references]).encode())
        path = self.store / f"{digest.hexdigest()}.npz"
        if path.exists():
            with np.load(path) as stored:
                return {name: stored[name] for name in stored.files}
        scores = self.per_example(outputs)
        self.store.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(partial, **scores)
        partial.replace(path)  # atomic: a killed summary leaves no half-written file
        return scores

    def all(self, outputs: list[str]) -> dict[str, float]:
        """Test-set scores: per-example means and corpus scores."""
        everything = np.arange(len(self.references))
        means = {m: float(v.mean()) for m, v in self.cached(outputs).items()}
        return means | self.corpus(outputs, everything)

    def corpus(self, outputs: list[str], subset: np.ndarray) -> dict[str, float]:
        """Corpus BLEU and chrF (sacreBLEU defaults) of the examples ``subset``, from per-sentence
        statistics summed over it (as sacreBLEU's own paired bootstrap does)."""
        if not self._corpus_metrics:
            return {}
        key = tuple(outputs)
        if key not in self._statistics:
            self._statistics[key] = {
                name: np.array(metric._extract_corpus_statistics(outputs, [self.references]))
                for name, metric in self._corpus_metrics.items()
            }
        statistics = self._statistics[key]
        return {
            name: metric._compute_score_from_stats(statistics[name][subset].sum(0).tolist()).score
            for name, metric in self._corpus_metrics.items()
        }


def paired_difference(
    scores: Scores, metric: str, pairs: list[tuple[list[str], list[str]]], samples: np.ndarray
) -> tuple[float, float, float, int]:
    """``metric`` of outputs A minus outputs B, for pairs (A, B) run from the same seed: the mean
    over pairs, its paired bootstrap 95% interval (the same resampled test examples for A and B)
    and the number of pairs whose own difference is positive. Corpus scores (BLEU, chrF) are
    recomputed on each resample; the others are means of per-example scores."""
    everything = np.arange(samples.shape[1])
    if metric in ("bleu", "chrf"):

        def delta(subset: np.ndarray) -> list[float]:
            return [
                scores.corpus(a, subset)[metric] - scores.corpus(b, subset)[metric]
                for a, b in pairs
            ]

        per_pair = delta(everything)
        resampled = np.array([np.mean(delta(subset)) for subset in samples])
    else:
        differences = np.array(
            [scores.cached(a)[metric] - scores.cached(b)[metric] for a, b in pairs]
        )
        per_pair = list(differences.mean(axis=1))
        resampled = differences.mean(axis=0)[samples].mean(axis=1)
    low, high = np.percentile(resampled, [2.5, 97.5])
    return float(np.mean(per_pair)), low, high, sum(d > 0 for d in per_pair)


DIFFERENCE_HEADER = [
    "| comparison | metric | Δ (mean over seeds) | 95% paired bootstrap | seeds with Δ > 0 |",
    "|---|---|---:|---|---:|",
]


def difference_rows(scores: Scores, label: str, pairs, metrics, samples) -> list[str]:
    rows = []
    for metric in metrics:
        full, low, high, positive = paired_difference(scores, metric, pairs, samples)
        d = DIGITS.get(metric, 4)
        rows.append(
            f"| {label} | {NAMES[metric]} | {full:+.{d}f} | [{low:+.{d}f}, {high:+.{d}f}] "
            f"| {positive}/{len(pairs)} |"
        )
    return rows


def over_seeds(values: list[float], metric: str) -> str:
    """A table cell: the mean over seeds ± their standard deviation, or one seed's value alone
    (the spread of a single run is unknown, not 0)."""
    d = DIGITS.get(metric, 4)
    if len(values) == 1:
        return f"{values[0]:.{d}f}"
    return f"{np.mean(values):.{d}f} ± {np.std(values, ddof=1):.{d}f}"


def column_order(metrics) -> list[str]:
    """The scores first, the output length last (F_BERT's precision and recall left out)."""
    return [m for m in metrics if m not in ("words", *COMPONENTS)] + ["words"]


def held_out(name: str) -> tuple[Task, list[str]]:
    """The task and the test references of the config behind ``results/<name>/``."""
    return config_test_split(RECIPES / "configs" / CONFIGS[name])


def config_test_split(config: Path, overrides: list[str] | None = None) -> tuple[Task, list[str]]:
    """The task and the test references of a recipe config with its ``--set`` ``overrides``."""
    from config import load_config
    from examples import load_splits

    loaded = load_config(config, overrides or [])
    return get_task(loaded.task), [e.target for e in load_splits(loaded.data)["test"]]


def config_task(config: Path) -> Task:
    """The task a recipe config names (its ``task``)."""
    from config import load_config

    return get_task(load_config(config, []).task)


def task_of(folder: Path) -> Task:
    """The task of ``results/<name>/`` or of a GRPO run's ``results/grpo-<name>/``: the
    config's ``task`` (nothing here switches on a dataset's name)."""
    name = folder.name.removeprefix("grpo-")
    if name not in CONFIGS:
        raise ValueError(f"{folder}: no config known for {name!r} (CONFIGS: {sorted(CONFIGS)})")
    return config_task(RECIPES / "configs" / CONFIGS[name])


def task_tables(task: Path, store: Path | None = None) -> str:
    kind, references = held_out(task.name)
    runs, zero_shot = load_runs(task)
    if "ce" not in runs:
        return f"(no CE runs under {task})"
    scores = Scores(kind, references, store)
    metrics = column_order(scores.all(runs["ce"][min(runs["ce"])]))
    lines = [
        f"Test examples: {len(references)}.\n",
        "| run | seeds | " + " | ".join(NAMES[m] for m in metrics) + " |",
        "|---|---:|" + "---:|" * len(metrics),
    ]
    if zero_shot is not None:
        cells = [f"{scores.all(zero_shot)[m]:.{DIGITS.get(m, 4)}f}" for m in metrics]
        lines.append("| zero-shot | – | " + " | ".join(cells) + " |")
    for run in runs:
        cells = []
        for m in metrics:
            cells.append(over_seeds([scores.all(outputs)[m] for outputs in runs[run].values()], m))
        lines.append(f"| {run} | {len(runs[run])} | " + " | ".join(cells) + " |")

    samples = np.random.default_rng(0).integers(
        0, len(references), size=(RESAMPLES, len(references))
    )
    lines += ["", *DIFFERENCE_HEADER]
    for run in (r for r in runs if r != "ce"):
        seeds = sorted(set(runs[run]) & set(runs["ce"]))
        pairs = [(runs[run][s], runs["ce"][s]) for s in seeds]
        if pairs:
            lines += difference_rows(scores, f"{run} − ce", pairs, metrics, samples)
    if zero_shot is not None:
        pairs = [(outputs, zero_shot) for outputs in runs["ce"].values()]
        lines += difference_rows(scores, "ce − zero-shot", pairs, metrics, samples)
    return "\n".join(lines)


def run_test_split(folder: Path) -> tuple[Task, list[str]]:
    """The task and the test references of the recipe run in ``folder``: its config and
    ``--set`` options, read from the command its ``results.json`` records (a relative config
    path is the repository's)."""
    import shlex

    words = shlex.split(json.loads((folder / "results.json").read_text())["command"])
    options = {"--config": [], "--set": []}
    for flag, value in zip(words, words[1:], strict=False):
        if flag in options:
            options[flag].append(value)
    if len(options["--config"]) != 1:
        raise ValueError(f"{folder}/results.json: its command names no single --config")
    config = Path(options["--config"][0])
    if not config.is_absolute() and not config.exists():
        config = RECIPES.parent / config
    return config_test_split(config, options["--set"])


def grpo_table(folder: Path, store: Path | None = None) -> str:
    """Held-out answers before and after a GRPO run, re-scored: ``grpo.py``'s
    ``test_outputs_before.txt`` and ``test_outputs.txt`` against the test split of the run's
    command (:func:`run_test_split`), or the first ``grpo.py``'s ``test_outputs.jsonl`` (each
    line's ``before``, ``after`` and ``reference``)."""
    legacy = folder / "test_outputs.jsonl"
    if legacy.exists():
        rows = [json.loads(line) for line in legacy.read_text().splitlines()]
        task, references = task_of(folder), [r["reference"] for r in rows]
        before, after = [r["before"] for r in rows], [r["after"] for r in rows]
    else:
        task, references = run_test_split(folder)
        before = _lines(folder / "test_outputs_before.txt")
        after = _lines(folder / "test_outputs.txt")
    scores = Scores(task, references, store)
    metrics = column_order(scores.all(after))
    count = len(references)
    samples = np.random.default_rng(0).integers(0, count, size=(RESAMPLES, count))
    lines = [
        f"Held-out prompts: {count}.\n",
        "| | " + " | ".join(NAMES[m] for m in metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    for name, outputs in (("before", before), ("after", after)):
        lines.append(
            f"| {name} | "
            + " | ".join(f"{scores.all(outputs)[m]:.{DIGITS.get(m, 4)}f}" for m in metrics)
            + " |"
        )
    lines += ["", *DIFFERENCE_HEADER]
    lines += difference_rows(scores, "after − before", [(after, before)], metrics, samples)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """The tables of the runs under the folder ``argv`` names (default ``recipes/results``; the
    re-run with the fixed training signal: ``recipes/results/fixed-gradient``), one folder a
    task, printed as Markdown."""
    parser = argparse.ArgumentParser(prog="summarize_results", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results",
        nargs="?",
        type=Path,
        default=RESULTS,
        help="the study's outputs, one folder a task (default: recipes/results)",
    )
    results = parser.parse_args(argv).results
    if not results.is_dir():
        parser.error(f"no folder {results}")
    for name in CONFIGS:
        task = results / name
        if task.is_dir():
            print(f"### {name} (test split)\n\n{task_tables(task, default_store())}\n")
    for folder in sorted(results.glob("grpo-*")):
        print(f"### {folder.name}\n\n{grpo_table(folder, default_store())}\n")
    costs = [
        json.loads(p.read_text()).get("train_seconds")
        for name in CONFIGS
        for p in results.glob(f"{name}/*/results.json")
    ]
    costs = [c for c in costs if c]
    if costs:
        print(f"Runs: {len(costs)}, {np.mean(costs) / 60:.1f} min each on average (train + test).")


if __name__ == "__main__":
    main()
