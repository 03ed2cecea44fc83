"""The studies of recipes/RESULTS.md, driven by ``recipes/study/manifest.yaml``: one command to
run them, summarise them and check their committed figures.

    python recipes/study/harness.py run es-en --stage stage1            # seeds 0-2, cores 0 1
    python recipes/study/harness.py run es-en --stage stage2 --arms ce sampled --seeds 0
    python recipes/study/harness.py run es-en --stage other_lengths --start recipes/results/study
    python recipes/study/harness.py sync es-en [FROM]     # FROM (default `out`) -> `results`
    python recipes/study/harness.py summary es-en > recipes/results/study/tables.md
    python recipes/study/harness.py verify [STUDY ...]    # `make verify-results`

``run`` starts the runs a stage is missing, one process per core (``--cores``, pinned with
``taskset``, one thread each): a finished run (``results.json`` with the test score after
training) is skipped, one with checkpoints continues (``--resume``), output goes to the run's
``stdout.log``, and a finished run's checkpoints are removed (``--keep-checkpoints`` keeps them).
Before any run it refuses a queue the machine cannot hold (a core ``taskset`` cannot use, less
free disk than the runs going at once may write) and a tree other than the one the study's
``out`` was started from (``out/pinned.txt`` records the commit; a study's runs all come from
one commit). ``verify`` re-scores every committed output file and compares the F_BERT with its
``results.json`` and the summary with the committed ``tables.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO / "recipes"))

from arms import command as arm_command  # noqa: E402
from arms import load_arms  # noqa: E402

MANIFEST = HERE / "manifest.yaml"
STAGES = ("stage1", "stage2", "other_lengths")


@dataclass
class OtherLength:
    name: str
    arm: str
    steps: int
    save_every: int
    measured_by: str
    ce_control: bool = False


@dataclass
class Study:
    name: str
    stages: dict[str, str]
    arms: dict[str, dict]  # name -> its overrides (arms.yaml), in the manifest's order
    control: str
    seeds: list[int]
    steps: int
    out: str
    results: Path
    matching_pairs: list[tuple[str, str]] = field(default_factory=list)
    other_lengths: list[OtherLength] = field(default_factory=list)
    over_budget: dict[str, int] = field(default_factory=dict)
    split_file: str | None = None
    sample: str | None = None


def load_manifest(path: Path = MANIFEST) -> dict[str, Study]:
    """The studies of ``path``; refuses, naming it, an arm that ``arms_file`` does not define,
    a seed that is not a whole number from 0, a stage it does not know."""
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    defined = load_arms(REPO / raw["arms_file"])
    studies = {}
    for name, entry in raw["studies"].items():
        where = f"{path}: study {name!r}"
        unknown = [s for s in entry["stages"] if s not in STAGES[:2]]
        if unknown:
            raise ValueError(f"{where}: unknown stage {unknown[0]!r} (stages: stage1, stage2)")
        seeds = entry["seeds"]
        for seed in seeds:
            if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
                raise ValueError(f"{where}: seed {seed!r} is not a whole number from 0")
        others = [OtherLength(**o) for o in entry.get("other_lengths") or []]
        pairs = [tuple(p) for p in entry.get("matching_pairs") or []]
        named = [*entry["arms"], entry["control"], *(a for p in pairs for a in p)]
        named += [a for o in others for a in (o.arm, o.measured_by)]
        for arm in named:
            if arm not in defined:
                raise ValueError(
                    f"{where}: arm {arm!r} is not in {raw['arms_file']} "
                    f"(arms: {', '.join(defined)})"
                )
        if entry["control"] not in entry["arms"]:
            raise ValueError(f"{where}: the control {entry['control']!r} is not one of its arms")
        studies[name] = Study(
            name=name,
            stages=entry["stages"],
            arms={arm: defined[arm] for arm in entry["arms"]},
            control=entry["control"],
            seeds=list(seeds),
            steps=entry["steps"],
            out=entry["out"],
            results=REPO / entry["results"],
            matching_pairs=pairs,
            other_lengths=others,
            over_budget=entry.get("over_budget") or {},
            split_file=entry.get("split_file"),
            sample=entry.get("sample"),
        )
    return studies


# --- run ----------------------------------------------------------------------------------------


@dataclass
class Job:
    out: str  # the run's folder
    argv: list[str]  # SCRIPT --output_dir OUT ARGS... (as results.json's `command` records it)


def jobs(
    study: Study,
    stage: str,
    seeds: list[int] | None = None,
    arms: list[str] | None = None,
    out: str | None = None,
    start: str | None = None,
    config: str | None = None,
    extra: list[str] = (),
) -> list[Job]:
    """The runs of ``stage`` for ``seeds`` (default the study's) and, in stage 2, ``arms``
    (default all; other_lengths: names of its runs), seed by seed: the command lines the
    shell drivers ran. ``start``: where stage 1's ``stage1-seed<N>/best`` are (default
    ``out``); ``config``: another config for the stage; ``extra``: words added to every run."""
    seeds = study.seeds if seeds is None else seeds
    out = out or study.out
    start = start or out
    found = []
    if stage == "stage1":
        for index, seed in enumerate(seeds):
            # the pretrained model's test score is the same for every seed (greedy): once
            before = "true" if index == 0 else "false"
            run = f"{out}/stage1-seed{seed}"
            first = config or study.stages["stage1"]
            argv = ["recipes/finetune.py", "--output_dir", run, "--config", first,
                    "--set", f"train.seed={seed}", "--set", f"eval.before={before}"]  # fmt: skip
            found.append(Job(run, [*argv, *extra]))
        return found
    if stage == "stage2":
        names = arms or list(study.arms)
        runs = [(arm, f"stage2-seed{{seed}}/{arm}", []) for arm in names]
    elif stage == "other_lengths":
        chosen = [o for o in study.other_lengths if not arms or o.name in arms]
        runs = [
            (o.arm, f"equal-compute/{o.name}-seed{{seed}}",
             ["--set", f"train.steps={o.steps}", "--set", f"train.eval_every={o.steps}",
              "--set", f"train.save_every={o.save_every}"])
            for o in chosen
        ]  # fmt: skip
    else:
        raise ValueError(f"unknown stage {stage!r} (stages: {', '.join(STAGES)})")
    unknown = [a for a in (arms or []) if a not in study.arms and stage == "stage2"]
    if unknown:
        raise ValueError(f"study {study.name!r} has no arm {unknown[0]!r}: {', '.join(study.arms)}")
    for seed in seeds:
        for arm, folder, more in runs:
            script, *args = arm_command(study.arms[arm], config or study.stages["stage2"])
            run = f"{out}/{folder.format(seed=seed)}"
            argv = [script, "--output_dir", run, *args, "--init_from",
                    f"{start}/stage1-seed{seed}/best", "--set", f"train.seed={seed}",
                    "--set", "eval.before=false", *more]  # fmt: skip
            found.append(Job(run, [*argv, *extra]))
    return found


def finished(folder: Path) -> bool:
    """The run has its test score after training (results.json's ``after``)."""
    path = folder / "results.json"
    return path.is_file() and '"after"' in path.read_text(encoding="utf-8")


def check_budget(queue: list[Job], cores: list[int], gb_per_run: float, root: Path) -> None:
    """Refuse, naming the setting, a queue this machine cannot hold, before any job starts."""
    if not cores:
        raise SystemExit("--cores is empty: name at least one core (e.g. --cores 0 1)")
    for core in cores:
        if subprocess.run(["taskset", "-c", str(core), "true"], capture_output=True).returncode:
            raise SystemExit(f"--cores {' '.join(map(str, cores))}: taskset cannot run a process "
                             f"on core {core} (this machine has {os.cpu_count()} CPUs, numbered "
                             "from 0)")  # fmt: skip
    pending = [j for j in queue if not finished(root / j.out)]
    at_once = min(len(pending), len(cores))
    if not at_once:
        return
    first = root / pending[0].out
    first.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(first.parent).free / 2**30
    if free < at_once * gb_per_run:
        raise SystemExit(f"{first.parent} has {free:.1f} GB free; {at_once} runs at once may write "
                         f"--gb-per-run {gb_per_run:g} GB each: free space, or name fewer "
                         "--cores")  # fmt: skip


def check_pinned(out: Path, commit: str) -> None:
    """A study's runs come from one commit: ``out/pinned.txt`` records the first run's, later
    runs from another commit are refused (a new ``--out`` starts another set of runs)."""
    pinned = out / "pinned.txt"
    if pinned.exists():
        recorded = pinned.read_text().strip()
        if recorded != commit:
            raise SystemExit(
                f"{out} was started from commit {recorded}, this tree is {commit}: "
                "run from a worktree at that commit, or name another --out"
            )
    else:
        out.mkdir(parents=True, exist_ok=True)
        pinned.write_text(commit + "\n")


def tree_commit(root: Path) -> str:
    """HEAD, with ``-dirty`` where tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode
    return (head.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


def run_job(job: Job, core: int, root: Path, keep_checkpoints: bool) -> int:
    """Skip a finished run, continue one with checkpoints, else start it (output appended to
    its stdout.log); a run that finishes has its checkpoints removed."""
    folder = root / job.out
    if finished(folder):
        print(f"{job.out}: done", flush=True)
        return 0
    # finetune.py saves checkpoint_<step> (accelerate), grpo.py checkpoint-<step> (TRL)
    resume = any((folder / "checkpoints").glob("checkpoint[_-]*"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{job.out}: core {core} {'--resume' if resume else '(new)'}", flush=True)
    argv = ["taskset", "-c", str(core), sys.executable, *job.argv, *(["--resume"] * resume)]
    with open(folder / "stdout.log", "a") as log:
        status = subprocess.run(argv, cwd=root, stdout=log, stderr=subprocess.STDOUT).returncode
    if not keep_checkpoints and finished(folder):
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return status


def run_queue(queue: list[Job], cores: list[int], root: Path, keep_checkpoints=False) -> int:
    """Job i on core ``cores[i mod #cores]``, a core's jobs one after another; 1 if any failed."""
    failed = []

    def worker(index: int) -> None:
        for job in queue[index :: len(cores)]:
            if run_job(job, cores[index], root, keep_checkpoints):
                failed.append(job.out)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for out in failed:
        print(f"{out}: failed (see its stdout.log)", file=sys.stderr)
    return 1 if failed else 0


def environment() -> None:
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
                      MKL_NUM_THREADS="1")  # fmt: skip


# --- sync ---------------------------------------------------------------------------------------

# a run's curves.png is left out: it is drawn from its log.jsonl (recipes/results/study/README.md)
SMALL = (".jsonl", ".json", ".txt")
ADAPTER = ("adapter_config.json", "adapter_model.safetensors", "config.json", "best.json")


def sync(source: Path, target: Path) -> list[Path]:
    """Copy every run's small outputs (logs, results, test and dev outputs) from ``source`` to
    ``target``, and a LoRA run's ``best/`` adapter (no tokenizer, no checkpoints)."""
    copied = []
    runs = [*source.glob("stage1-seed*"), *source.glob("stage2-seed*/*"),
            *source.glob("equal-compute/*")]  # fmt: skip
    for run in runs:
        if not (run / "log.jsonl").is_file():
            continue
        to = target / run.relative_to(source)
        files = [p for p in run.iterdir() if p.is_file() and p.suffix in SMALL]
        files += sorted((run / "dev_outputs").glob("step_*.txt"))
        if (run / "best/adapter_config.json").is_file():
            files += [run / "best" / name for name in ADAPTER if (run / "best" / name).is_file()]
        for path in files:
            destination = to / path.relative_to(run)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination)
            copied.append(destination)
    return copied


# --- summary and verify -------------------------------------------------------------------------


def references(study: Study) -> dict[str, list[str]]:
    """The study's test and dev references (its stage-2 config's data; a ``split_file`` built
    from the shared data, ``$BSLOSS_DATA_DIR`` or ``../shared/data``)."""
    from summary import references as config_references

    overrides = []
    if study.split_file:
        import tempfile

        data = Path(os.environ.get("BSLOSS_DATA_DIR") or REPO.parent / "shared/data")
        path = Path(tempfile.mkdtemp()) / f"{study.split_file}.jsonl"
        subprocess.run([sys.executable, str(REPO / "recipes/data/make_samples.py"), "--data-dir",
                        str(data), f"--{study.split_file}", str(path)], check=True)  # fmt: skip
        overrides = [f"data.path={path}"]
    return config_references(REPO / study.stages["stage2"], overrides)


def summary(study: Study, refs: dict[str, list[str]] | None = None, plot: bool = True) -> str:
    """The study's tables (``tables.md``), from its committed outputs."""
    import summary as tables

    refs = refs or references(study)
    return tables.tables(study, study.results, refs, REPO / study.stages["stage2"], plot=plot)


def run_folders(study: Study) -> list[Path]:
    """The study's committed runs: stage 1, stage 2's arms, the runs of other lengths."""
    found = [*study.results.glob("stage1-seed*"), *study.results.glob("stage2-seed*/*"),
             *study.results.glob("equal-compute/*")]  # fmt: skip
    return sorted(p for p in found if (p / "results.json").is_file())


def check_scores(run: Path, test_references: list[str], scorer) -> list[str]:
    """What does not hold of a run: its outputs are one line per test example and score, under
    the training scorer, the F_BERT its results.json recorded (``before``: the pretrained)."""
    problems = []
    result = json.loads((run / "results.json").read_text())
    for when, name in (("after", "test_outputs.txt"), ("before", "test_outputs_before.txt")):
        if not (run / name).exists():
            if when == "after" or when in result:
                problems.append(f"{run}: no {name} for results.json's {when!r}")
            continue
        outputs = (run / name).read_text(encoding="utf-8").split("\n")[:-1]
        if not len(outputs) == len(test_references) == result[when]["examples"]:
            problems.append(f"{run}/{name}: {len(outputs)} lines, {len(test_references)} "
                            f"references, results.json {result[when]['examples']}")  # fmt: skip
            continue
        if scorer is not None:
            f = float(scorer.score(outputs, test_references, progress=False)[2].mean())
            if abs(f - result[when]["f_bert"]) > 1e-5:
                problems.append(f"{run}/{name}: scores F_BERT {f:.6f}, results.json "
                                f"{result[when]['f_bert']:.6f}")  # fmt: skip
    return problems


def verify(study: Study, scorer=None, tables: bool = True) -> list[str]:
    """Every committed run re-scored against its results.json, and (``tables``) the summary
    against the committed ``tables.md``; the problems found, ``[]`` when all hold."""
    if scorer is None:
        import bsloss

        scorer = bsloss.BERTScorer(device="cpu", reference_cache_size=10_000)
    refs = references(study)
    problems = [p for run in run_folders(study) for p in check_scores(run, refs["test"], scorer)]
    if tables:
        committed = (study.results / "tables.md").read_text(encoding="utf-8")
        made = summary(study, refs, plot=False)
        if made.rstrip("\n") != committed.rstrip("\n"):
            import difflib

            diff = difflib.unified_diff(committed.splitlines(), made.splitlines(), "tables.md",
                                        "summary", lineterm="", n=0)  # fmt: skip
            problems.append(f"{study.results}/tables.md differs from the summary:\n"
                            + "\n".join(list(diff)[:20]))  # fmt: skip
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    commands = parser.add_subparsers(dest="what", required=True)
    run = commands.add_parser("run", help="run what a stage is missing")
    run.add_argument("study")
    run.add_argument("--stage", choices=STAGES, required=True)
    run.add_argument("--arms", nargs="+", help="stage2: arms; other_lengths: run names")
    run.add_argument("--seeds", nargs="+", type=int)
    run.add_argument("--out", help="default the manifest's `out`")
    run.add_argument("--start", help="where stage1-seed<N>/best are (default --out)")
    run.add_argument("--config", help="another config for the stage (default the manifest's)")
    run.add_argument("--extra", default="", help='words added to every run ("--set k=v ...")')
    run.add_argument("--cores", nargs="+", type=int, default=[0, 1])
    run.add_argument("--gb-per-run", type=float, default=2.0)
    run.add_argument("--keep-checkpoints", action="store_true")
    run.add_argument("--dry-run", action="store_true", help="print the command lines only")
    run.add_argument("--root", type=Path, default=REPO, help=argparse.SUPPRESS)
    copy = commands.add_parser("sync", help="copy a study's small outputs into `results`")
    copy.add_argument("study")
    copy.add_argument("source", nargs="?", type=Path)
    copy.add_argument("--to", type=Path, help="default the manifest's `results`")
    tables = commands.add_parser("summary", help="the study's tables, to stdout")
    tables.add_argument("study")
    check = commands.add_parser("verify", help="re-score every committed output, check tables")
    check.add_argument("studies", nargs="*")
    check.add_argument("--no-tables", action="store_true")
    args = parser.parse_args(argv)
    studies = load_manifest(args.manifest)
    names = [args.study] if hasattr(args, "study") else (args.studies or list(studies))
    for name in names:
        if name not in studies:
            parser.error(f"no study {name!r} in {args.manifest} (studies: {', '.join(studies)})")
    if args.what == "run":
        study = studies[args.study]
        try:
            queue = jobs(study, args.stage, args.seeds, args.arms, args.out, args.start,
                         args.config, args.extra.split())  # fmt: skip
        except ValueError as error:
            parser.error(str(error))
        if args.dry_run:
            print("\n".join(" ".join(job.argv) for job in queue))
            return 0
        environment()
        if args.stage != "stage1":
            for job in queue:
                start = args.root / job.argv[job.argv.index("--init_from") + 1]
                if not (start / "config.json").is_file():
                    raise SystemExit(f"{job.out}: no stage-1 checkpoint at {start} "
                                     "(run --stage stage1)")  # fmt: skip
        check_budget(queue, args.cores, args.gb_per_run, args.root)
        check_pinned(args.root / (args.out or study.out), tree_commit(args.root))
        return run_queue(queue, args.cores, args.root, args.keep_checkpoints)
    if args.what == "sync":
        study = studies[args.study]
        copied = sync(args.source or REPO / study.out, args.to or study.results)
        print(f"{len(copied)} files copied to {args.to or study.results}")
        return 0
    if args.what == "summary":
        print(summary(studies[args.study]), end="")
        return 0
    problems = []
    for name in names:
        found = verify(studies[name], tables=not args.no_tables)
        print(f"{name}: {'ok' if not found else f'{len(found)} problems'}", flush=True)
        problems += found
    print("\n".join(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
