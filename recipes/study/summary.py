"""The efficacy study's tables and curves (issue 25), from its synced outputs: the tables of
``python recipes/study/harness.py summary STUDY`` (:func:`tables`), a study of
``recipes/study/manifest.yaml`` naming its arms, its hard/soft pairs and its runs of other
lengths; its stage-2 config gives the task (the metrics beside F_BERT) and the references.

Reads ``stage1-seed<N>/`` (the converged start, scored on the test split with its ``best/``) and
``stage2-seed<N>/<arm>/`` (``test_outputs.txt``, ``log.jsonl``, ``dev_outputs/step_<K>.txt``), as
``harness.py sync`` copies them. Every output is re-scored here, example by example
(:class:`summarize_results.Scores`): hard F_BERT under the training scorer (MiniLM) and under the
independent all-mpnet-base-v2 (never trained against), the task's own metrics (corpus BLEU
and chrF for translation, ROUGE-1/2/L for summarization), and length in words. Writes, to stdout:

- each arm's mean ± standard deviation over seeds, the stage-1 start as the first row;
- each arm minus ``ce`` (continued CE, same start, seed, examples and steps): the mean over
  seeds, a paired bootstrap 95% interval over the test examples and the seeds with a positive
  difference (:func:`summarize_results.paired_difference`);
- hard minus soft matching (the manifest's ``matching_pairs``: the same candidates and
  weight), likewise;
- the length check: each arm minus ``ce`` in the independent scorer's precision and recall
  and in words, likewise. Dropping an answer's weakest tokens raises precision and can only
  lower recall (a reference token's best match is taken over fewer candidate tokens; up to
  the context's change of the embeddings), so a gain in recall with shorter answers is better
  content, not length alone;
- the runs of other lengths (``equal-compute/<run>-seed<N>/``, the manifest's
  ``other_lengths``: ``ce`` continued for about an arm's core-seconds, an arm stopped early
  to fit a compute budget) against ``ce`` and against the arm they are measured by,
  likewise, with both sides' core-hours;
- each arm's cost: CPU-seconds per training step (the median step, evaluations excluded), its
  training core-hours and its core-hours in all (evaluations included), and the study's total;
- the issue's goal, checked for each arm and each run of another length that is not CE alone
  (the task's own metrics not significantly lower: BLEU and chrF, or ROUGE),
  from those numbers (compute: training core-seconds, so that how often a run was evaluated
  does not count as its method's cost).

and plots the dev F_BERT (independent scorer) of every arm against the step and against the
CPU-seconds (``dev_curves.png`` beside the outputs).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

RECIPES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(RECIPES))

from summarize_results import (  # noqa: E402
    DIFFERENCE_HEADER,
    NAMES,
    RESAMPLES,
    Scores,
    column_order,
    config_task,
    default_store,
    difference_rows,
    over_seeds,
    paired_difference,
)
from tasks import Task  # noqa: E402

CONFIG = RECIPES / "configs" / "bible-es-en-gemma-stage2.yaml"
CONTROL = "ce"  # the control every study of recipes/study/manifest.yaml compares against
GOAL_METRIC = "f_bert_mpnet"  # the independent scorer: the goal is stated on it


@dataclass
class Run:
    """One stage-2 run's outputs: the test answers, the log, the dev answers by step."""

    test: list[str]
    log: list[dict]
    dev: dict[int, list[str]] = field(default_factory=dict)

    @property
    def cpu_total(self) -> float:
        """Core-seconds of the whole run (training and evaluations), its log's last ``cpu``."""
        return max((e["cpu"] for e in self.log if "cpu" in e), default=float("nan"))

    @property
    def cpu_training(self) -> float:
        """Core-seconds spent training: the log's ``cpu`` increments that end at a training
        step (the model's loading goes with the first line, an evaluation at step 0)."""
        spent = previous = 0.0
        for entry in self.log:
            if "cpu" in entry:
                if entry.get("kind") == "train":
                    spent += entry["cpu"] - previous
                previous = entry["cpu"]
        return spent

    def _step_costs(self) -> list[tuple[float, dict]]:
        """(CPU-seconds, the step's log line) for each training step that follows another
        with no evaluation between them (an evaluation's cost is not a step's)."""
        lines = [e for e in self.log if e.get("kind") in ("train", "eval")]
        return [
            (b["cpu"] - a["cpu"], b)
            for a, b in zip(lines, lines[1:], strict=False)
            if a.get("kind") == b.get("kind") == "train" and b["step"] == a["step"] + 1
        ]

    @property
    def cpu_per_step(self) -> float:
        """The median CPU-seconds of a training step (:meth:`_step_costs`)."""
        steps = [cost for cost, _ in self._step_costs()]
        return float(np.median(steps)) if steps else float("nan")

    @property
    def cpu_over_ce_steps(self) -> float:
        """Training compute against CE alone, measured inside the run: the mean CPU-seconds
        of its steps over the mean of its steps without the term (a schedule that answers
        every k-th step logs no ``bertscore_loss`` between). Both from one process on one
        machine, so unlike a ratio to another run it needs no idle machine; NaN for a run
        whose steps all carry the term, or none."""
        steps = self._step_costs()
        alone = [cost for cost, line in steps if "bertscore_loss" not in line]
        if not alone or len(alone) == len(steps):
            return float("nan")
        return float(np.mean([cost for cost, _ in steps]) / np.mean(alone))

    def dev_cpu(self, step: int) -> float:
        """The CPU-seconds when the dev evaluation of ``step`` was logged."""
        return next(
            e["cpu"]
            for e in self.log
            if e.get("kind") == "eval" and e.get("split") == "validation" and e["step"] == step
        )


@dataclass
class Study:
    start: dict[int, list[str]]  # stage 1's test answers, by seed
    arms: dict[str, dict[int, Run]]  # stage 2: arm -> seed -> run
    # equal-compute controls: name -> seed -> run (not arms: they ran other step counts)
    equal_compute: dict[str, dict[int, Run]] = field(default_factory=dict)


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def load_study(folder: Path) -> Study:
    """The finished runs under ``folder`` (a run is finished when its ``test_outputs.txt``
    exists); ``ce`` first, then the arms in name order."""
    start = {
        int(p.parent.name.removeprefix("stage1-seed")): _lines(p)
        for p in folder.glob("stage1-seed*/test_outputs.txt")
    }
    arms: dict[str, dict[int, Run]] = {}
    for test in sorted(folder.glob("stage2-seed*/*/test_outputs.txt")):
        seed = int(test.parent.parent.name.removeprefix("stage2-seed"))
        arms.setdefault(test.parent.name, {})[seed] = _load_run(test.parent)
    equal: dict[str, dict[int, Run]] = {}
    for test in sorted(folder.glob("equal-compute/*-seed*/test_outputs.txt")):
        name, seed = test.parent.name.rsplit("-seed", 1)
        equal.setdefault(name, {})[int(seed)] = _load_run(test.parent)
    order = sorted(arms, key=lambda name: (name != CONTROL, name))
    return Study(start, {name: arms[name] for name in order}, equal)


def _load_run(folder: Path) -> Run:
    log = [json.loads(line) for line in _lines(folder / "log.jsonl")]
    dev = {
        int(p.stem.removeprefix("step_")): _lines(p)
        for p in (folder / "dev_outputs").glob("step_*.txt")
    }
    return Run(_lines(folder / "test_outputs.txt"), log, dev)


def study_task(config: Path = CONFIG) -> Task:
    """The task of the study's config (its ``task``: translation for the Bible es->en study)."""
    return config_task(config)


def references(config: Path = CONFIG, overrides: list[str] | None = None) -> dict[str, list[str]]:
    """The test and dev references of the study's config (its data section; ``overrides``:
    ``--set`` pairs, e.g. where the XSum study's split file was built)."""
    from config import load_config
    from examples import load_splits

    splits = load_splits(load_config(config, overrides or []).data)
    return {split: [e.target for e in splits[split]] for split in ("test", "validation")}


def mean_table(study: Study, scores: Scores, metrics: list[str]) -> list[str]:
    lines = [
        "| run | seeds | " + " | ".join(NAMES[m] for m in metrics) + " |",
        "|---|---:|" + "---:|" * len(metrics),
    ]
    rows = {"stage-1 start": study.start} | {
        arm: {s: r.test for s, r in runs.items()} for arm, runs in study.arms.items()
    }
    for name, by_seed in rows.items():
        if not by_seed:
            continue
        cells = []
        for m in metrics:
            cells.append(over_seeds([scores.all(outputs)[m] for outputs in by_seed.values()], m))
        lines.append(f"| {name} | {len(by_seed)} | " + " | ".join(cells) + " |")
    return lines


def runs_of(study: Study, name: str) -> dict[int, Run]:
    """seed -> run of ``name``: a stage-2 arm or a run of another length; ``{}`` if none."""
    return study.arms.get(name) or study.equal_compute.get(name, {})


def pairs_against(study: Study, arm: str, control: str = CONTROL) -> list[tuple]:
    """(arm's answers, control's answers) for each seed both finished."""
    runs, controls = runs_of(study, arm), runs_of(study, control)
    return [(runs[s].test, controls[s].test) for s in sorted(set(runs) & set(controls))]


def matching_ablation(
    study: Study, scores: Scores, metrics: list[str], samples: np.ndarray, pairs
) -> list[str]:
    """Each hard arm minus its soft twin (``pairs``), paired by seed as against ``ce``; ``[]``
    when no pair has finished runs."""
    lines = []
    for hard, soft in pairs:
        runs = pairs_against(study, hard, soft) if hard in study.arms else []
        if runs:
            lines += difference_rows(scores, f"{hard} − {soft}", runs, metrics, samples)
    return list(DIFFERENCE_HEADER) + lines if lines else []


def rows_against_control(study: Study, scores: Scores, metrics, samples: np.ndarray) -> list[str]:
    """Each arm minus ``ce`` in ``metrics``: one table row per arm and metric, paired by seed."""
    rows = []
    for arm in study.arms:
        if arm != CONTROL and pairs_against(study, arm):
            rows += difference_rows(scores, f"{arm} − ce", pairs_against(study, arm), metrics,
                                    samples)  # fmt: skip
    return rows


LENGTH_CHECK = ("p_bert_mpnet", "r_bert_mpnet", "words")


def length_check(study: Study, scores: Scores, samples: np.ndarray) -> list[str]:
    """Each arm minus ``ce`` in the independent scorer's precision and recall and in words
    (:data:`LENGTH_CHECK`), paired by seed as in the main comparison; ``[]`` without arms."""
    rows = rows_against_control(study, scores, LENGTH_CHECK, samples)
    return list(DIFFERENCE_HEADER) + rows if rows else []


def equal_compute(
    study: Study, scores: Scores, metrics: list[str], samples: np.ndarray, pairs
) -> list[str]:
    """Each run of another length against ``ce`` (what its compute gave) and its arm against
    it (what the arm's extra compute, or the control's, changed), paired by the seeds all three
    finished, then both sides' mean core-hours, in all and training; ``[]`` when no such run
    has finished."""
    lines, costs = [], []
    for name, arm in pairs:
        runs = study.equal_compute.get(name, {})
        seeds = sorted(set(runs) & set(study.arms.get(arm, {})) & set(study.arms.get(CONTROL, {})))
        if not seeds:
            continue
        other = [runs[s].test for s in seeds]
        ce = [study.arms[CONTROL][s].test for s in seeds]
        answers = [study.arms[arm][s].test for s in seeds]
        for label, pairs_of_seeds in (
            (f"{name} − ce", zip(other, ce, strict=True)),
            (f"{arm} − {name}", zip(answers, other, strict=True)),
        ):
            lines += difference_rows(scores, label, list(pairs_of_seeds), metrics, samples)
        hours = [
            [np.mean([getattr(r[s], cost) for s in seeds]) / 3600 for r in (runs, study.arms[arm])]
            for cost in ("cpu_total", "cpu_training")
        ]
        costs.append(f"- {name} (seeds {', '.join(map(str, seeds))}): {hours[0][0]:.2f} "
                     f"core-hours per run ({hours[1][0]:.2f} training) against {arm}'s "
                     f"{hours[0][1]:.2f} ({hours[1][1]:.2f} training)")  # fmt: skip
    return list(DIFFERENCE_HEADER) + lines + [""] + costs if lines else []


def cost_table(study: Study) -> tuple[list[str], float]:
    """Each arm's and each run of another length's cost, the means over its runs; and the
    stage-2 arms' core-hours in all."""
    lines = [
        "| run | runs | CPU-s per step (median) | training core-hours per run "
        "| core-hours per run (training + evaluations) | × its own CE-alone steps |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    total = 0.0
    for name, runs in (study.arms | study.equal_compute).items():
        per_step = np.mean([r.cpu_per_step for r in runs.values()])
        training = np.mean([r.cpu_training / 3600 for r in runs.values()])
        hours = [r.cpu_total / 3600 for r in runs.values()]
        total += sum(hours) if name in study.arms else 0.0
        within = [r.cpu_over_ce_steps for r in runs.values()]
        within_text = "—" if np.isnan(within).all() else f"{np.nanmean(within):.2f}"
        lines.append(f"| {name} | {len(runs)} | {per_step:.1f} | {training:.2f} "
                     f"| {np.mean(hours):.2f} | {within_text} |")  # fmt: skip
    return lines, total


def goal_lines(
    study: Study, scores: Scores, samples: np.ndarray, task_metrics: list[str], ce_controls=()
) -> list[str]:
    """The issue's goal for each differentiable arm and each run of another length that is not
    CE alone: beats ``ce`` on the independent scorer (interval above 0, positive in every seed,
    at least 3 seeds), the task's metrics (``task_metrics``: BLEU and chrF for translation)
    not significantly lower (interval reaching 0 or above), and
    GRPO's gain on that scorer at no more than a third of GRPO's training core-seconds (the
    mean over seeds; the ratio with evaluations counted is shown beside it). ``ce_controls``:
    runs of other lengths that are CE alone, not judged."""
    grpo = study.arms.get("grpo")
    grpo_gain = None
    if grpo and pairs_against(study, "grpo"):
        grpo_gain = paired_difference(scores, GOAL_METRIC, pairs_against(study, "grpo"), samples)[0]
    lines = [
        f"| run | Δ mpnet > 0 (interval) | seeds + | {', '.join(NAMES[m] for m in task_metrics)} "
        "not lower "
        "| ≥ GRPO's gain at ≤ 1/3 its training compute | goal |",
        "|---|---|---|---|---|---|",
    ]
    judged = [a for a in study.arms if a not in (CONTROL, "grpo")]
    judged += [r for r in study.equal_compute if r not in ce_controls]
    for name in judged:
        pairs = pairs_against(study, name)
        if not pairs:
            continue
        delta, low, _, positive = paired_difference(scores, GOAL_METRIC, pairs, samples)
        beats = low > 0
        all_seeds = positive == len(pairs) >= 3
        not_lower = all(paired_difference(scores, m, pairs, samples)[2] >= 0 for m in task_metrics)
        if grpo_gain is None:
            cheap, cheap_text = False, "no GRPO run"
        else:
            runs = runs_of(study, name).values()
            training, total = (
                np.mean([getattr(r, cost) for r in runs])
                / np.mean([getattr(r, cost) for r in grpo.values()])
                for cost in ("cpu_training", "cpu_total")
            )
            cheap = delta >= grpo_gain and training <= 1 / 3
            cheap_text = (f"Δ {delta:+.4f} vs {grpo_gain:+.4f}, {training:.2f}× its training CPU "
                          f"({total:.2f}× with evaluations)")  # fmt: skip
        met = beats and all_seeds and not_lower and cheap
        lines.append(
            f"| {name} | {'yes' if beats else 'no'} (low {low:+.4f}) | {positive}/{len(pairs)} | "
            f"{'yes' if not_lower else 'no'} | {cheap_text} | {'met' if met else 'not met'} |"
        )
    return lines


def dev_curves(
    study: Study, dev_references: list[str], store: Path | None = None, task: Task | None = None
) -> dict[str, dict[int, list]]:
    """arm -> seed -> [(step, cpu, mean dev F_BERT under the independent scorer)]; ``task``:
    the study's (default the es->en config's)."""
    scores = Scores(task or study_task(), dev_references, store)
    curves: dict[str, dict[int, list]] = {}
    for arm, runs in study.arms.items():
        for seed, run in runs.items():
            points = []
            for step in sorted(run.dev):
                if len(run.dev[step]) != len(dev_references):
                    continue
                value = float(scores.cached(run.dev[step])[GOAL_METRIC].mean())
                points.append((step, run.dev_cpu(step), value))
            curves.setdefault(arm, {})[seed] = points
    return curves


def plot_dev_curves(curves: dict[str, dict[int, list]], path: Path) -> Path:
    """Dev F_BERT (independent scorer) against the step and against the CPU-seconds: one colour
    per arm, a thin line per seed, the mean over seeds bold (against the step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(points for by_seed in curves.values() for points in by_seed.values()):
        # an empty figure reads as "no curves measured"; the cause is missing inputs
        raise ValueError(
            "plot_dev_curves: no run has dev outputs (dev_outputs/step_<K>.txt beside its "
            "log.jsonl, as recipes/study/harness.py sync copies them): nothing to plot"
        )
    figure, (by_step, by_cpu) = plt.subplots(1, 2, figsize=(12.5, 4))
    most_seeds = max(len(by_seed) for by_seed in curves.values())
    for index, (arm, by_seed) in enumerate(curves.items()):
        # ten colours, then the same ten dashed: an 11th arm must not pass for the first
        colour, style = f"C{index % 10}", ("-", "--", ":")[index // 10 % 3]
        for points in by_seed.values():
            if points:
                steps, cpu, values = zip(*points, strict=True)
                by_step.plot(steps, values, color=colour, ls=style, lw=0.7, alpha=0.4)
                by_cpu.plot(np.array(cpu) / 3600, values, color=colour, ls=style, lw=1)
        shared = sorted(set.intersection(*[{p[0] for p in pts} for pts in by_seed.values()]))
        if shared:
            means = [
                np.mean([v for pts in by_seed.values() for s, _, v in pts if s == step])
                for step in shared
            ]
            # an arm run at fewer seeds says so: its mean starts from those seeds' start
            fewer = f" ({len(by_seed)} of {most_seeds} seeds)" if len(by_seed) < most_seeds else ""
            by_step.plot(shared, means, color=colour, ls=style, lw=2.2, marker="o", ms=3,
                         label=arm + fewer)  # fmt: skip
    by_step.set(xlabel="stage-2 step", ylabel="dev F_BERT (all-mpnet-base-v2)")
    by_step.set_title("against the step (bold: mean over seeds)")
    by_cpu.set(xlabel="core-hours of the run (training + evaluations)")
    by_cpu.set_title("against compute (one line per seed)")
    if len(curves) <= 4:  # a few arms: the legend fits in a corner of the panel
        by_step.legend(fontsize=8)
        figure.tight_layout()
    else:  # many: beside the panels, over no curve
        figure.legend(loc="center right", fontsize=8)
        figure.tight_layout(rect=(0, 0, 0.83, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def tables(spec, folder: Path, refs: dict[str, list[str]], config: Path, plot=True) -> str:
    """The tables of a study of ``recipes/study/manifest.yaml`` (``spec``: its entry, as
    ``harness.load_manifest`` gives it; its comparisons), from the outputs under ``folder``;
    ``plot``: draw ``dev_curves.png`` beside them (its line ends the tables)."""
    if spec.control != CONTROL:
        raise ValueError(f"study {spec.name!r}: the tables compare against {CONTROL!r}")
    study = load_study(folder)
    if CONTROL not in study.arms:
        raise ValueError(f"no finished {CONTROL!r} run under {folder}: nothing to compare with")
    task = study_task(config)
    scores = Scores(task, refs["test"], default_store())
    first = next(iter(study.arms[CONTROL].values())).test
    metrics = column_order(scores.all(first))
    task_metrics = [m for m in metrics if m not in ("f_bert", "f_bert_mpnet", "words")]
    samples = np.random.default_rng(0).integers(0, len(refs["test"]), (RESAMPLES, len(first)))
    out = [f"Test examples: {len(refs['test'])}; dev examples: {len(refs['validation'])}.\n"]
    out.append("\n".join(mean_table(study, scores, metrics)) + "\n")
    lines = list(DIFFERENCE_HEADER) + rows_against_control(study, scores, metrics, samples)
    out.append("\n".join(lines) + "\n")
    ablation = matching_ablation(study, scores, metrics, samples, spec.matching_pairs)
    if ablation:
        out.append("Hard minus soft matching, the same candidates and weight:\n")
        out.append("\n".join(ablation) + "\n")
    length = length_check(study, scores, samples)
    if length:
        out.append(
            "The length check: the independent scorer's precision and recall (shorter answers "
            "raise precision and lower recall; a gain in recall is not length alone):\n"
        )
        out.append("\n".join(length) + "\n")
    others = [(o.name, o.measured_by) for o in spec.other_lengths]
    equal = equal_compute(study, scores, metrics, samples, others)
    if equal:
        out.append(
            "Runs of other lengths (`ce` continued for about an arm's core-seconds; an arm "
            "stopped early to fit a compute budget), against `ce` and the arm:\n"
        )
        out.append("\n".join(equal) + "\n")
    costs, total = cost_table(study)
    out.append("\n".join(costs))
    out.append(f"\nStage 2 in all: {total:.1f} core-hours.\n")
    controls = [o.name for o in spec.other_lengths if o.ce_control]
    out.append("\n".join(goal_lines(study, scores, samples, task_metrics, controls)) + "\n")
    if plot:
        curves = dev_curves(study, refs["validation"], default_store(), task)
        path = plot_dev_curves(curves, folder / "dev_curves.png")
        out.append(f"Dev curves: {path.relative_to(folder)}")
    else:
        out.append("Dev curves: dev_curves.png")
    return "".join(chunk + "\n" for chunk in out)
