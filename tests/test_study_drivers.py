"""The studies' harness (recipes/study/harness.py, driven by recipes/study/manifest.yaml): the
manifest is checked, the runs it starts are the command lines the committed results.json
recorded, finished runs are skipped and checkpointed ones resumed (a stand-in script records
its arguments instead of training), its summary is the committed tables, and its verify finds
a tampered figure. And the short-budget study's driver (recipes/run_results.sh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes" / "study"))
import arms as study_arms  # noqa: E402
import harness  # noqa: E402

needs_taskset = pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
# the runs here write a few bytes: their checks must not depend on the machine's free disk
# (CI's may be nearly full); the disk check itself is tested with an impossible --gb-per-run
NO_DISK_CHECK = ("--gb-per-run", "0")

FAKE = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--output_dir") + 1])
with open(out / "argv.jsonl", "a") as f:
    f.write(json.dumps(args) + "\\n")
(out / "results.json").write_text(json.dumps({"after": {"f_bert": 0.5}}))
"""


def _manifest(tmp_path: Path, defined: dict, **study) -> Path:
    """A manifest of one study `s` over the arms ``defined`` (written beside it)."""
    (tmp_path / "arms.yaml").write_text(yaml.safe_dump(defined, sort_keys=False))
    entry = {"stages": {"stage1": "s1.yaml", "stage2": "base.yaml"}, "arms": list(defined),
             "control": next(iter(defined), "ce"), "seeds": [0, 1], "steps": 4, "out": "runs/s",
             "results": "results/s", **study}  # fmt: skip
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump({"arms_file": str(tmp_path / "arms.yaml"),
                                    "studies": {"s": entry}}))  # fmt: skip
    return path


def test_the_manifest_names_every_study_and_its_arms_are_defined():
    studies = harness.load_manifest()
    assert set(studies) == {"es-en", "xsum"}
    assert set(studies["es-en"].arms) >= {"ce", "sampled", "grpo", "berttune"}
    assert list(studies["xsum"].arms) == ["ce", "sampled"]
    for study in studies.values():
        assert (REPO / study.stages["stage1"]).is_file() and study.results.is_dir()
        assert (study.results / study.sample / "results.json").is_file()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"arms": ["ce", "nope"]}, "study 's': arm 'nope' is not in"),
        ({"seeds": [0, -1]}, "study 's': seed -1 is not a whole number from 0"),
        ({"seeds": [0, "one"]}, "study 's': seed 'one' is not a whole number"),
        ({"matching_pairs": [["ce", "soft"]]}, "arm 'soft' is not in"),
        ({"control": "mix"}, "the control 'mix' is not one of its arms"),
        ({"stages": {"stage3": "x.yaml"}}, "unknown stage 'stage3'"),
    ],
)
def test_a_bad_manifest_is_refused_naming_what(tmp_path, change, message):
    arms = {"ce": {"loss.weight": 0.0}, "mix": {"loss.weight": 0.5}}
    path = _manifest(tmp_path, arms, **{"arms": ["ce"], **change})
    with pytest.raises(ValueError, match=message):
        harness.load_manifest(path)


def _committed():
    studies = harness.load_manifest()
    for study in studies.values():
        for run in harness.run_folders(study):
            yield study, run


@pytest.mark.parametrize(
    "study, run", list(_committed()), ids=lambda x: getattr(x, "name", None) or str(x)
)
def test_the_harness_runs_the_command_lines_the_committed_runs_recorded(study, run):
    """Each committed results.json's `command` (the old shell drivers'), up to where its run
    folder was and a `--resume` of a continued run, is one the harness gives."""
    recorded = json.loads((run / "results.json").read_text()).get("command")
    if recorded is None or "mixin-seed" in str(run):
        pytest.skip("no recorded command, or not a run of the manifest")
    words = recorded.split()
    words = [w for w in words if w != "--resume"]
    out = words[words.index("--output_dir") + 1]
    relative = run.relative_to(study.results)
    first = relative.parts[0]
    stage = "other_lengths" if first == "equal-compute" else first.split("-")[0]
    seed = int(str(relative).rsplit("seed", 1)[1].split("/")[0])
    prefix = out.removesuffix("/" + str(relative)) if out.endswith(str(relative)) else None
    start = None
    if "--init_from" in words:
        start = words[words.index("--init_from") + 1].removesuffix(f"/stage1-seed{seed}/best")
    queue = harness.jobs(study, stage, [seed], out=prefix or study.out, start=start)
    made = {job.out: job.argv for job in queue}
    key = f"{prefix or study.out}/{relative}"
    argv = made[key]
    if prefix is None:  # run into another folder than the manifest's layout (runs/extra/...)
        argv = [out if w == key else w for w in argv]
    if stage == "stage1":  # the first seed of a call scores the pretrained model
        words = [w for w in words if not w.startswith("eval.before=")]
        argv = [w for w in argv if not w.startswith("eval.before=")]
        words = [
            w for i, w in enumerate(words) if not (w == "--set" and words[i + 1 : i + 2] == [])
        ]
    assert [w for w in argv if w != "--set"] == [w for w in words if w != "--set"], run


def _fake_root(tmp_path: Path, arms: dict) -> tuple[Path, Path]:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "fake.py").write_text(FAKE)
    (root / "recipes").mkdir()
    shutil.copy(root / "fake.py", root / "recipes/finetune.py")
    return root, _manifest(tmp_path, arms)


def _harness(root: Path, manifest: Path, *words: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "recipes/study/harness.py"), "--manifest",
               str(manifest), "run", "s", "--root", str(root), *words]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _argv(folder: Path) -> list[list[str]]:
    return [json.loads(line) for line in (folder / "argv.jsonl").read_text().splitlines()]


@needs_taskset
def test_stage2_runs_every_arm_from_its_seeds_checkpoint_and_skips_finished(tmp_path):
    arms = {
        "ce": {"script": "fake.py", "loss.weight": 0.0},
        "mix": {"script": "fake.py", "config": "other.yaml", "loss.weight": 0.5},
    }
    root, manifest = _fake_root(tmp_path, arms)
    for seed in (0, 1):
        best = root / f"runs/s/stage1-seed{seed}/best"
        best.mkdir(parents=True)
        (best / "config.json").write_text("{}")
    done = _harness(root, manifest, "--stage", "stage2", "--cores", "0", *NO_DISK_CHECK)
    assert done.returncode == 0, done.stderr
    for seed in (0, 1):
        (ce,) = _argv(root / f"runs/s/stage2-seed{seed}/ce")
        assert ce[ce.index("--config") + 1] == "base.yaml"
        assert ce[ce.index("--init_from") + 1] == f"runs/s/stage1-seed{seed}/best"
        assert f"train.seed={seed}" in ce and "loss.weight=0.0" in ce and "--resume" not in ce
        (mix,) = _argv(root / f"runs/s/stage2-seed{seed}/mix")
        assert mix[mix.index("--config") + 1] == "other.yaml"  # the arm's own config wins
    assert (root / "runs/s/pinned.txt").is_file()
    # finished runs are skipped; a run with a checkpoint and no result resumes, whether
    # finetune.py's (accelerate: checkpoint_<step>) or grpo.py's (TRL: checkpoint-<step>)
    (root / "runs/s/stage2-seed1/mix/results.json").unlink()
    (root / "runs/s/stage2-seed1/mix/checkpoints/checkpoint_0").mkdir(parents=True)
    (root / "runs/s/stage2-seed1/ce/results.json").unlink()
    (root / "runs/s/stage2-seed1/ce/checkpoints/checkpoint-25").mkdir(parents=True)
    again = _harness(root, manifest, "--stage", "stage2", "--cores", "0", *NO_DISK_CHECK)
    assert again.returncode == 0, again.stderr
    assert "runs/s/stage2-seed0/ce: done" in again.stdout
    for arm in ("mix", "ce"):
        first, second = _argv(root / f"runs/s/stage2-seed1/{arm}")
        assert "--resume" not in first and second[-1] == "--resume", arm
        assert not (root / f"runs/s/stage2-seed1/{arm}/checkpoints").exists()  # removed
    # another commit than the one the runs came from is refused
    (root / "runs/s/pinned.txt").write_text("0" * 40 + "\n")
    third = _harness(root, manifest, "--stage", "stage2", "--cores", "0", *NO_DISK_CHECK)
    assert third.returncode != 0 and "was started from commit 0000" in third.stderr


@needs_taskset
def test_stage2_refuses_a_seed_without_its_stage1_checkpoint(tmp_path):
    root, manifest = _fake_root(tmp_path, {"ce": {"script": "fake.py", "loss.weight": 0.0}})
    result = _harness(root, manifest, "--stage", "stage2", "--seeds", "3")
    assert result.returncode != 0
    assert "no stage-1 checkpoint at" in result.stderr and "stage1-seed3/best" in result.stderr


@needs_taskset
@pytest.mark.parametrize(
    "words, message",
    [
        (["--cores", "0", "4096"], "taskset cannot run a process on core 4096"),
        (["--gb-per-run", "100000000"], "--gb-per-run 1e+08 GB each: free space, or name fewer"),
    ],
)
def test_a_queue_the_machine_cannot_hold_is_refused_before_any_run(tmp_path, words, message):
    root, manifest = _fake_root(tmp_path, {"ce": {"loss.weight": 0.0}})
    result = _harness(root, manifest, "--stage", "stage1", *words)
    assert result.returncode != 0
    assert message in result.stderr
    assert not list(root.glob("runs/s/stage1-seed*/argv.jsonl"))  # nothing started


@needs_taskset
def test_stage1_records_the_pretrained_score_once_and_finished_runs_need_no_disk(tmp_path):
    root, manifest = _fake_root(tmp_path, {"ce": {"loss.weight": 0.0}})
    result = _harness(root, manifest, "--stage", "stage1", "--seeds", "4", "5", "6",
                      "--cores", "0", "0", *NO_DISK_CHECK)  # fmt: skip
    assert result.returncode == 0, result.stderr
    befores = [_argv(root / f"runs/s/stage1-seed{seed}")[0][-1] for seed in (4, 5, 6)]
    assert befores == ["eval.before=true", "eval.before=false", "eval.before=false"]
    done = _harness(root, manifest, "--stage", "stage1", "--seeds", "4", "5",
                    "--gb-per-run", "100000000")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "runs/s/stage1-seed4: done" in done.stdout


def test_arms_file_refuses_a_value_with_a_space_and_a_non_mapping(tmp_path):
    bad = tmp_path / "arms.yaml"
    bad.write_text(yaml.safe_dump({"x": {"data.prompt_format": "two words"}}))
    with pytest.raises(ValueError, match="arm 'x', data.prompt_format: a value with a space"):
        study_arms.load_arms(bad)
    bad.write_text(yaml.safe_dump({"y": ["loss.weight=1"]}))
    with pytest.raises(ValueError, match="arm 'y' must be a mapping"):
        study_arms.load_arms(bad)


def test_sync_copies_logs_outputs_dev_answers_and_adapters_but_no_checkpoints(tmp_path):
    """Every run (stage 1, stage 2's arms, equal-compute/'s runs of other lengths)."""
    runs = tmp_path / "runs"
    arm = runs / "stage2-seed0/ce"
    (arm / "dev_outputs").mkdir(parents=True)
    (arm / "checkpoints/checkpoint_50").mkdir(parents=True)
    for name in ("log.jsonl", "results.json", "test_outputs.txt", "curves.png", "stdout.log"):
        (arm / name).write_text(name)
    (arm / "dev_outputs/step_25.txt").write_text("dev answers\n")
    (arm / "checkpoints/checkpoint_50/model.safetensors").write_text("weights")
    start = runs / "stage1-seed0"
    (start / "best").mkdir(parents=True)
    (start / "log.jsonl").write_text("{}")
    for name in ("adapter_config.json", "adapter_model.safetensors", "config.json", "best.json",
                 "tokenizer.json"):  # fmt: skip
        (start / "best" / name).write_text(name)
    (runs / "stage2-seed0/unstarted").mkdir()  # no log.jsonl: nothing to copy
    longer = runs / "equal-compute/ce-285-seed0"  # a run of another length
    (longer / "checkpoints/checkpoint_250").mkdir(parents=True)
    for name in ("log.jsonl", "results.json", "test_outputs.txt", "stdout.log"):
        (longer / name).write_text(name)
    copied = tmp_path / "results"
    harness.sync(runs, copied)
    files = sorted(str(p.relative_to(copied)) for p in copied.rglob("*") if p.is_file())
    assert files == [
        "equal-compute/ce-285-seed0/log.jsonl",
        "equal-compute/ce-285-seed0/results.json",
        "equal-compute/ce-285-seed0/test_outputs.txt",
        "stage1-seed0/best/adapter_config.json",
        "stage1-seed0/best/adapter_model.safetensors",
        "stage1-seed0/best/best.json",
        "stage1-seed0/best/config.json",
        "stage1-seed0/log.jsonl",
        "stage2-seed0/ce/dev_outputs/step_25.txt",
        "stage2-seed0/ce/log.jsonl",
        "stage2-seed0/ce/results.json",
        "stage2-seed0/ce/test_outputs.txt",
    ]


def test_verify_finds_a_tampered_figure_in_a_copy(tmp_path, scorer):
    study = harness.load_manifest()["es-en"]
    copy = tmp_path / "study"
    for name in ("stage1-seed0", study.sample):
        shutil.copytree(study.results / name, copy / name)
    study.results = copy
    assert harness.verify(study, scorer, tables=False) == []
    path = copy / study.sample / "results.json"
    result = json.loads(path.read_text())
    result["after"]["f_bert"] += 0.001
    path.write_text(json.dumps(result))
    (problem,) = harness.verify(study, scorer, tables=False)
    assert f"{study.sample}/test_outputs.txt: scores F_BERT" in problem


@pytest.mark.skipif(
    not os.environ.get("BSLOSS_VERIFY_RESULTS"),
    reason="re-scores every output with two scorers: `make verify-results` checks it",
)
def test_the_summary_is_the_committed_tables():
    """The es->en study's tables, re-made from its outputs (the per-example scores are kept
    in the store between runs), are the committed tables.md."""
    study = harness.load_manifest()["es-en"]
    made = harness.summary(study, plot=False)
    assert made == (study.results / "tables.md").read_text(encoding="utf-8")


FAKE_FINETUNE = """#!/usr/bin/env bash
# stands in for `python recipes/finetune.py ...`: records the arguments, writes what a run writes
args=("$@")
for i in "${!args[@]}"; do [ "${args[$i]}" = --output_dir ] && out=${args[$((i + 1))]}; done
# as recipes/run.py's check_fresh_output: a folder holding a run needs --resume or --overwrite
if [ -f "$out/log.jsonl" ] && [[ " $* " != *" --overwrite "* && " $* " != *" --resume "* ]]; then
    echo "already holds a run" >&2; exit 1
fi
printf '%s\\n' "$*" >> "$out/argv.txt"
echo '{"after": {"f_bert": 0.5}}' > "$out/results.json"
echo '{}' > "$out/log.jsonl"
echo answer > "$out/test_outputs.txt"
"""


def test_run_results_reruns_beside_the_kept_runs_and_skips_finished_ones(tmp_path):
    # the short-budget study's re-run with the fixed training signal writes RUNS_DIR and KEEP,
    # never the committed runs of recipes/results/<task>/
    root = tmp_path / "repo"
    (root / "recipes").mkdir(parents=True)
    shutil.copy(REPO / "recipes/run_results.sh", root / "recipes/run_results.sh")
    kept = root / "recipes/results/bible-es-en/soft-s0"
    kept.mkdir(parents=True)
    (kept / "results.json").write_text("old")
    # a run cut off by the end of a session: its log, no results.json (no checkpoint either)
    cut = root / "runs/fixed-gradient/bible-es-en/ce-s1"
    cut.mkdir(parents=True)
    (cut / "log.jsonl").write_text('{"step": 7}')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_FINETUNE)
    (bin_dir / "python").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RUNS_DIR": "runs/fixed-gradient",
        "KEEP": "recipes/results/fixed-gradient",
        "TASKS": "bible-es-en",
        "SEEDS": "0 1",
        "RUNS": "ce soft",
        "WEIGHT": "10",
    }
    run = subprocess.run(["bash", "recipes/run_results.sh"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    rerun = root / "recipes/results/fixed-gradient/bible-es-en"
    assert sorted(p.name for p in rerun.iterdir()) == [
        "ce-s0",
        "ce-s1",
        "soft-w10-s0",
        "soft-w10-s1",
    ]
    assert (kept / "results.json").read_text() == "old"
    argv = (root / "runs/fixed-gradient/bible-es-en/soft-w10-s1/argv.txt").read_text()
    assert "--set loss.weight=10 --set loss.matching=softmax" in argv
    assert "--set train.seed=1" in argv and "--set eval.before=false" in argv
    first = (root / "runs/fixed-gradient/bible-es-en/ce-s0/argv.txt").read_text()
    assert "--set eval.before=true" in first  # the zero-shot outputs: once, the first CE run
    assert (cut / "results.json").exists()  # the cut-off run was run again from the start
    # a second call finds every run finished and starts none
    again = subprocess.run(["bash", "recipes/run_results.sh"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert (root / "runs/fixed-gradient/bible-es-en/ce-s0/argv.txt").read_text().count("\n") == 1
