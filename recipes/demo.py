"""The main job (``make demo``): what the BERTScore term does, shown in minutes.

    python recipes/demo.py [--output_dir runs/demo] [--seeds 0 1 2] [--limit N]
                           [--steps 4] [--test 4] [--no-live]

1. **The evidence.** The efficacy study (recipes/RESULTS.md) trained Gemma 3 270M from the same
   CE-converged start, with the same seed and batches, 100 more steps of either CE alone
   (``ce``) or CE + the balanced soft BERTScore term on the model's own sampled answers
   (``sampled``), 3 seeds, and committed every decoded test answer
   (``recipes/results/study/stage2-seed<N>/<arm>/test_outputs.txt``). They are re-scored here,
   now: F_BERT with bsloss's exact ``BERTScorer`` (the embedded MiniLM the loss trained with,
   and the independent all-mpnet-base-v2 the loss never saw, when it is installed), sacreBLEU's
   BLEU and chrF; per seed and pooled, with the study's paired bootstrap interval of
   ``sampled − ce`` (:func:`summarize_results.paired_difference`, the tables' own).
2. **The package on this machine.** A short live fine-tune through the recipe itself
   (``recipes/finetune.py``, ``bible-es-en-gemma-sampled.yaml``) from the study's committed
   start: a few steps of CE + the term on sampled answers, the start and the fine-tuned model
   scored on a few test verses. A run this short shows the job runs and what the term
   measures; its test change is noise, not evidence (part 1 is).
3. **One picture**, ``demo.png`` in the run folder: per-seed F_BERT of the start, ``ce`` and
   ``sampled``; ``sampled − ce`` per seed and pooled with its interval; the live run's losses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RECIPES = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPES))
sys.path.insert(0, str(RECIPES / "study"))

from summarize_results import DIGITS, RESAMPLES, Scores, paired_difference  # noqa: E402
from summary import CONTROL, load_study, references, study_task  # noqa: E402

ARM = "sampled"  # the recipe the study measured best (configs/bible-es-en-gemma-sampled.yaml)
CONFIG = RECIPES / "configs" / "bible-es-en-gemma-sampled.yaml"
STUDY = RECIPES / "results" / "study"  # the es→en study's committed runs (manifest: es-en)
START = STUDY / "stage1-seed0" / "best"  # the committed CE-converged LoRA adapter (seed 0)
INDEPENDENT = "all-mpnet-base-v2"
COMMITTED_TABLES = STUDY / "tables.md"
COLUMNS = {
    "f_bert": "F_BERT MiniLM",
    "f_bert_mpnet": "F_BERT mpnet",
    "bleu": "BLEU",
    "chrf": "chrF",
}
# the column names of recipes/results/study/tables.md (summarize_results.NAMES)
COMMITTED_NAMES = {"f_bert_mpnet": "F_BERT mpnet (independent)"}
RUNS = ("stage-1 start", CONTROL, ARM)  # the table's rows, each seed's and the pooled
DIFFERENCE = f"{ARM} − {CONTROL}"


def independent_installed() -> bool:
    """Whether the independent scorer all-mpnet-base-v2 can be loaded offline
    (:mod:`bsloss.pretrained`: its packages installed; converted here on first use)."""
    from bsloss.pretrained import pretrained_folder

    try:
        pretrained_folder(INDEPENDENT)
    except ImportError:
        return False
    return True


@dataclass
class Comparison:
    """The study's re-scored comparison: each run's scores per seed, ``sampled − ce`` per seed
    and pooled (mean over seeds, 95% paired bootstrap interval, seeds with a gain)."""

    metrics: list[str]
    examples: int
    levels: dict[str, dict[int, dict[str, float]]]  # run -> seed -> metric -> value
    per_seed: dict[int, dict[str, tuple[float, float, float]]]  # seed -> metric -> (Δ, low, high)
    pooled: dict[str, tuple[float, float, float, int]]  # metric -> (Δ, low, high, seeds Δ > 0)
    committed: dict[str, str]  # mpnet's figures read from tables.md (mpnet not installed)


def rescore_study(
    seeds: list[int], limit: int | None = None, independent: bool = True, folder: Path = STUDY
) -> Comparison:
    """Re-score the committed test answers of the stage-1 start, ``ce`` and ``sampled`` for
    ``seeds`` (the first ``limit`` test verses; all 200 by default) and compare ``sampled``
    with ``ce`` as the study's tables do (the same bootstrap resamples of the test verses).
    Without ``independent`` the mpnet column comes from the committed tables instead.

    Raises:
        ValueError: a seed in ``seeds`` has no committed ``ce`` and ``sampled`` run, or
            ``limit`` is below 2.
    """
    study = load_study(folder)
    seeds = sorted(set(seeds))  # a seed named twice would count twice in the pooled rows
    missing = [s for s in seeds if s not in study.arms.get(CONTROL, {})
               or s not in study.arms.get(ARM, {}) or s not in study.start]  # fmt: skip
    if missing:
        raise ValueError(f"--seeds: no committed start, {CONTROL} and {ARM} for seed(s) {missing}")
    if limit is not None and limit < 2:
        raise ValueError(f"--limit must be at least 2 test verses (a bootstrap), got {limit}")
    refs = references()["test"][:limit]
    scores = Scores(study_task(), refs, store=None, independent=independent)
    answers = {
        RUNS[0]: {s: study.start[s][: len(refs)] for s in seeds},
        CONTROL: {s: study.arms[CONTROL][s].test[: len(refs)] for s in seeds},
        ARM: {s: study.arms[ARM][s].test[: len(refs)] for s in seeds},
    }
    metrics = [m for m in COLUMNS if independent or m != "f_bert_mpnet"]
    from evaluation import progress_bar

    # a bar on a terminal: the re-scoring is the demo's first silence otherwise (~12 s)
    levels: dict[str, dict[int, dict[str, float]]] = {run: {} for run in answers}
    with progress_bar(sum(map(len, answers.values())), "re-scoring", unit="run") as bar:
        for run, by_seed in answers.items():
            for s, outputs in by_seed.items():
                every = scores.all(outputs)
                levels[run][s] = {m: every[m] for m in metrics}
                bar.update()
    # the study's resamples (recipes/study/summary.py): seed 0, one row of test verses each
    samples = np.random.default_rng(0).integers(0, len(refs), (RESAMPLES, len(refs)))
    pairs = {s: (answers[ARM][s], answers[CONTROL][s]) for s in seeds}
    per_seed = {
        s: {m: paired_difference(scores, m, [pairs[s]], samples)[:3] for m in metrics}
        for s in seeds
    }
    pooled = {m: paired_difference(scores, m, list(pairs.values()), samples) for m in metrics}
    committed = {} if independent else committed_figures(COMMITTED_TABLES)
    return Comparison(metrics, len(refs), levels, per_seed, pooled, committed)


def committed_figures(tables: Path, metric: str = "f_bert_mpnet") -> dict[str, str]:
    """``metric``'s figures in the study's committed tables (``tables.md``, written by
    recipes/study/summary.py): each run's mean ± sd over seeds (keyed by the run), and
    ``sampled − ce``'s difference, interval and seeds with a gain (keys ``Δ``, ``interval``,
    ``seeds``).

    Raises:
        ValueError: the tables have no such column or no ``sampled − ce`` row for it.
    """
    name, found = COMMITTED_NAMES[metric], {}
    header: list[str] | None = None
    for line in tables.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None and cells[:2] == ["run", "seeds"] and name in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[0] in RUNS:
            found.setdefault(cells[0], cells[header.index(name)])
        elif cells[:2] == [f"{ARM} − {CONTROL}", name] and "Δ" not in found:
            found |= {"Δ": cells[2], "interval": cells[3], "seeds": cells[4]}
    if not set(RUNS) | {"Δ"} <= set(found):
        raise ValueError(f"{tables}: no {name!r} figures for {RUNS} and {ARM} − {CONTROL}")
    return found


def _cell(value: float, metric: str, signed: bool = False) -> str:
    return f"{value:{'+' if signed else ''}.{DIGITS.get(metric, 4)}f}"


LABEL, WIDTH = 28, 20  # the table's label column and metric columns, in characters


def comparison_table(comparison: Comparison) -> str:
    """The study's comparison as one plain table: each seed's start, ``ce``, ``sampled`` and
    ``sampled − ce``; then the means over seeds, ``sampled − ce`` with its 95% paired
    bootstrap interval and the seeds with a gain. Committed figures (mpnet not installed) form
    a column of their own, marked ``*``, filled where the committed tables have them."""
    metrics, seeds = comparison.metrics, sorted(comparison.per_seed)
    columns = {m: COLUMNS[m] for m in metrics}
    committed = comparison.committed
    if committed:  # beside the training scorer's column, as the independent one would be
        columns = {"f_bert": COLUMNS["f_bert"], "committed": "F_BERT mpnet *"} | columns
    rows: list[tuple[str, dict[str, str]]] = []
    for seed in seeds:
        for index, run in enumerate(RUNS):
            values = comparison.levels[run][seed]
            label = f"seed {seed}" if index == 0 else ""
            rows.append((f"{label:8}{run}", {m: _cell(values[m], m) for m in metrics}))
        deltas = comparison.per_seed[seed]
        rows.append((f"{'':8}{DIFFERENCE}", {m: _cell(deltas[m][0], m, True) for m in metrics}))
    rows.append(("", {}))
    pooled = comparison.pooled
    for index, run in enumerate(RUNS):
        means = {m: np.mean([comparison.levels[run][s][m] for s in seeds]) for m in metrics}
        cells = {m: _cell(v, m) for m, v in means.items()} | {"committed": committed.get(run, "")}
        label = f"{len(seeds)} seed{'s' * (len(seeds) > 1)}" if index == 0 else ""
        rows.append((f"{label:8}{run}", cells))
    rows += [
        (f"{'':8}{DIFFERENCE}", {m: _cell(pooled[m][0], m, True) for m in metrics}
         | {"committed": committed.get("Δ", "")}),
        (f"{'':8}  95% interval", {m: f"[{_cell(pooled[m][1], m, True)}, "
                                   f"{_cell(pooled[m][2], m, True)}]" for m in metrics}
         | {"committed": committed.get("interval", "")}),
        (f"{'':8}  seeds with a gain", {m: f"{pooled[m][3]}/{len(seeds)}" for m in metrics}
         | {"committed": committed.get("seeds", "")}),
    ]  # fmt: skip
    lines = [f"{'':{LABEL}}" + "".join(f"{name:>{WIDTH}}" for name in columns.values())]
    for label, cells in rows:
        texts = [cells.get(key, "–" if cells else "") for key in columns]
        lines.append((f"{label:{LABEL}}" + "".join(f"{t:>{WIDTH}}" for t in texts)).rstrip())
    if committed:
        where = COMMITTED_TABLES.relative_to(RECIPES.parent)
        lines.append(f"* committed, not re-scored here: {where} (3 seeds x 200 test verses)")
    return "\n".join(lines)


def live_arguments(output_dir: Path, steps: int, test: int, init_from: Path = START) -> list[str]:
    """The short live run's command line for ``recipes/finetune.py``: the documented recipe
    (``bible-es-en-gemma-sampled.yaml``, as the study ran it) from ``init_from``, shortened to
    ``steps`` steps, scored on ``test`` test verses before and after, with no dev evaluations
    and no saved model (what a run this short can afford). The generator's activations are
    recomputed in the backward pass (gradient checkpointing: the same losses, measured equal,
    ~15% more time) so that the demo stays within a laptop's 4 GB."""
    return [
        "--config", str(CONFIG), "--init_from", str(init_from), "--output_dir", str(output_dir),
        "--set", f"train.steps={steps}", "--set", "eval.before=true",
        "--set", f"data.max_test={test}", "--set", "train.save_model=false",
        "--set", "train.eval_every=0", "--set", "train.save_every=0",
        "--set", "train.gradient_checkpointing=true",
    ]  # fmt: skip


def live_run(output_dir: Path, steps: int, test: int, overwrite: bool = False) -> dict:
    """Fine-tune through the recipe (:func:`finetune.main`): its lines as it goes, its table
    of the start against the fine-tuned model; returns its results (``results.json``)."""
    import finetune
    from run import limit_malloc_arenas

    # a laptop's 4 GB: freed activations back to the system at once (about 5% more time)
    limit_malloc_arenas(mmap_threshold=4 << 20)
    return finetune.main(live_arguments(output_dir, steps, test) + ["--overwrite"] * overwrite)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def draw(comparison: Comparison, live_log: list[dict] | None, path: Path) -> Path:
    """The picture: per-seed F_BERT of the start, ``ce`` and ``sampled`` (the training scorer;
    the independent one dashed when it was re-scored); ``sampled − ce`` per seed and pooled
    with its 95% paired bootstrap interval, beside 0; the live run's training CE and
    1 − F_BERT against the step (``live_log``: its ``log.jsonl``; ``None``: no live run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scorers = [m for m in ("f_bert", "f_bert_mpnet") if m in comparison.metrics]
    seeds = sorted(comparison.per_seed)
    panels = 3 if live_log is not None else 2
    figure, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.2))
    levels, gains = axes[0], axes[1]
    for index, seed in enumerate(seeds):
        for metric, style in zip(scorers, ("-", "--"), strict=False):
            values = [comparison.levels[run][seed][metric] for run in RUNS]
            label = f"seed {seed}" if metric == "f_bert" else None
            levels.plot(range(len(RUNS)), values, style, marker="o", color=f"C{index}",
                        label=label)  # fmt: skip
    levels.set_xticks(range(len(RUNS)), ["start\n(CE-converged)", "+100 steps\nCE alone",
                                         "+100 steps\nCE + term"])  # fmt: skip
    scorer_note = " (dashed: mpnet, never trained against)" if len(scorers) > 1 else ""
    levels.set_title(f"test F_BERT, {comparison.examples} verses{scorer_note}", fontsize=9)
    solid = "solid: " if len(scorers) > 1 else ""
    levels.set_ylabel(f"F_BERT ({solid}MiniLM, the training scorer)")
    levels.legend(fontsize=8)
    rows = [(f"seed {s}", comparison.per_seed[s]) for s in seeds]
    rows.append((f"mean of {len(seeds)}" if len(seeds) > 1 else "the seed", comparison.pooled))
    offsets = {"f_bert": -0.12, "f_bert_mpnet": 0.12} if len(scorers) > 1 else {"f_bert": 0.0}
    for metric in scorers:
        for y, (_, figures) in enumerate(rows):
            delta, low, high = figures[metric][:3]
            gains.errorbar(delta, y + offsets[metric], xerr=[[delta - low], [high - delta]],
                           fmt="o" if metric == "f_bert" else "s", capsize=3,
                           color="C3" if y == len(rows) - 1 else "k",
                           mfc="white" if metric == "f_bert_mpnet" else None,
                           label=COLUMNS[metric] if y == 0 else None)  # fmt: skip
    gains.axvline(0, color="grey", lw=1)
    gains.set_yticks(range(len(rows)), [name for name, _ in rows])
    gains.invert_yaxis()
    gains.set_xlabel(f"F_BERT of {DIFFERENCE} (95% paired bootstrap)")
    gains.set_title("the term's gain over CE alone, same start and batches", fontsize=9)
    gains.legend(fontsize=8)
    if live_log is not None:
        live = axes[2]
        train = [e for e in live_log if e.get("kind") == "train"]
        for key, label in (("ce", "CE"), ("bertscore_loss", "1 − F_BERT (sampled answers)")):
            points = [(e["step"], e[key]) for e in train if key in e]
            if points:
                live.plot(*zip(*points, strict=True), marker="o", label=label)
        tests = {e["step"]: e["f_bert"] for e in live_log
                 if e.get("kind") == "eval" and e.get("split") == "test"}  # fmt: skip
        change = ""
        if len(tests) == 2:
            before, after = (tests[k] for k in sorted(tests))
            change = f"\ntest F_BERT {before:.4f} → {after:.4f} (noise at this size)"
        live.set_title(f"this machine: {len(train)} live steps, one batch each{change}",
                       fontsize=9)  # fmt: skip
        live.set_xlabel("training step")
        live.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        live.legend(fontsize=8)
    pooled = comparison.pooled["f_bert"]
    figure.suptitle(
        "What the BERTScore term did: CE + term on sampled answers vs CE alone, same start\n"
        f"{_cell(pooled[0], 'f_bert', True)} F_BERT (MiniLM) [{_cell(pooled[1], 'f_bert', True)}"
        f", {_cell(pooled[2], 'f_bert', True)}], a gain in {pooled[3]}/{len(seeds)} seeds, "
        f"{comparison.examples} test verses (the committed study; Gemma 3 270M, es→en)",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


class Clock:
    """Wall and CPU seconds (this process, all its threads) since the last :meth:`lap`."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> str:
        wall, cpu = time.perf_counter(), time.process_time()
        text = f"{wall - self.wall:.0f} s wall, {cpu - self.cpu:.0f} CPU-s"
        self.wall, self.cpu = wall, cpu
        return text


def main(argv: list[str] | None = None) -> Comparison:
    from run import RUN_FILES, RUN_FOLDERS, check_fresh_output

    demo_artefacts = (*RUN_FILES, *RUN_FOLDERS, "study_comparison.txt", "demo.png")

    from bsloss.pretrained import OFFLINE_MODELS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output_dir", type=Path, default=Path(time.strftime("runs/demo-%Y%m%d-%H%M%S"))
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="the study's seeds to re-score (default all three)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="re-score the first LIMIT test verses only (default all 200)",
    )
    parser.add_argument("--steps", type=int, default=4, help="the live run's training steps")
    parser.add_argument(
        "--test", type=int, default=4, help="test verses the live run scores before and after"
    )
    parser.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        help="re-score the study only (no fine-tune)",
    )
    parser.add_argument(
        "--committed-mpnet",
        dest="rescore_independent",
        action="store_false",
        help=f"show the study's committed {INDEPENDENT} figures instead of re-scoring them "
        "(the independent scorer costs minutes of CPU; default: re-score it when installed)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a run already in --output_dir"
    )
    args = parser.parse_args(argv)
    args.seeds = sorted(set(args.seeds))  # a seed named twice is scored once (and said so)
    try:  # before minutes of work, as the recipe itself would refuse it after them
        # the demo's own files count too: a --no-live run writes no log (audit h32)
        check_fresh_output(args.output_dir, False, args.overwrite, demo_artefacts)
        if args.live and min(args.steps, args.test) < 1:
            raise ValueError(
                f"--steps and --test must be at least 1, got {args.steps}, {args.test}"
            )
    except (FileExistsError, ValueError) as refused:
        parser.error(str(refused))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    clock = Clock()

    print(
        "1/3  The evidence: the efficacy study's committed test answers, re-scored now.\n"
        f"     From the same CE-converged start (stage 1), seed and batches, 100 more steps of\n"
        f"     CE alone ({CONTROL}) or CE + the soft BERTScore term on the model's own sampled\n"
        f"     answers ({ARM}); Gemma 3 270M + LoRA, Spanish→English verses.",
        flush=True,
    )
    independent = args.rescore_independent and independent_installed()
    if not args.rescore_independent:
        print(
            f"     --committed-mpnet: the {INDEPENDENT} column (*) holds the study's committed "
            f"figures\n     ({COMMITTED_TABLES.relative_to(RECIPES.parent)}, 3 seeds x 200 verses)."
        )
    elif not independent:
        print(
            f"     {INDEPENDENT} (the independent scorer) is not installed: its column (*) holds "
            f"the study's committed figures\n     ({COMMITTED_TABLES.relative_to(RECIPES.parent)}, "
            f"3 seeds x 200 verses). To re-score it too: {OFFLINE_MODELS[INDEPENDENT].install}"
        )
    try:
        comparison = rescore_study(args.seeds, args.limit, independent)
    except ValueError as refused:
        parser.error(str(refused))
    table = comparison_table(comparison)
    (args.output_dir / "study_comparison.txt").write_text(table + "\n", encoding="utf-8")
    print(
        f"\n     {comparison.examples} test verses, seeds {', '.join(map(str, args.seeds))} "
        f"(re-scored in {clock.lap()}):\n\n{table}\n"
    )
    print(
        "     F_BERT: BERTScore F1 against the reference (MiniLM trained the term; mpnet never "
        "saw it);\n     BLEU, chrF: sacreBLEU, corpus-level. Interval: paired bootstrap over "
        "the test verses, 1000 resamples.\n",
        flush=True,
    )
    from summarize_results import scorers

    scorers.cache_clear()  # the study's scorers are done with: their memory is the live run's

    live_log = None
    if args.live:
        print(
            f"2/3  The package on this machine: {args.steps} steps of the same recipe from "
            f"the study's seed-0 start,\n     scored on {args.test} test verses before and "
            "after.\n",
            flush=True,
        )
        live_run(args.output_dir, args.steps, args.test, args.overwrite)
        live_log = read_log(args.output_dir / "log.jsonl")
        print(f"\n     The live run took {clock.lap()}. What a run this short can show: the "
              "recipe runs here,\n     the term is computed on the model's own sampled answers "
              "and trains the adapter (its losses\n     per step are in the picture). What it "
              f"cannot show: whether the term helps. {args.test} verses after\n     {args.steps} "
              "steps move the test scores by noise (the study needed 200 verses, 100 steps and "
              "3 seeds\n     to measure a gain of about +0.01 F_BERT); part 1 is the evidence.\n",
              flush=True)  # fmt: skip
    picture = draw(comparison, live_log, args.output_dir / "demo.png")
    pooled = comparison.pooled["f_bert"]
    print(f"3/3  The picture: {picture}\n\n     In short: over the study's {comparison.examples} "
          f"verses and {len(args.seeds)} seed(s), the term gave {_cell(pooled[0], 'f_bert', True)}"
          f" F_BERT (MiniLM) over CE alone,\n     95% interval [{_cell(pooled[1], 'f_bert', True)}"
          f", {_cell(pooled[2], 'f_bert', True)}], a gain in {pooled[3]} of {len(args.seeds)} "
          "seed(s).")  # fmt: skip
    return comparison


if __name__ == "__main__":
    main()
