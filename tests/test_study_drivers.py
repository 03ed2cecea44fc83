"""The efficacy study's drivers (recipes/study/stage1.sh, stage2.sh, arms.py): which runs they
start, with which arguments, on which core, and that they skip finished runs and resume
checkpointed ones. A stand-in script records its arguments instead of training."""

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

pytestmark = pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")

FAKE = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--output_dir") + 1])
with open(out / "argv.jsonl", "a") as f:
    f.write(json.dumps(args) + "\\n")
(out / "results.json").write_text(json.dumps({"after": {"f_bert": 0.5}}))
"""


def _driver(tmp_path: Path, arms: dict) -> Path:
    """A copy of the repository's drivers whose arms run the stand-in script."""
    root = tmp_path / "repo"
    (root / "recipes/study").mkdir(parents=True)
    for name in ("lib.sh", "stage1.sh", "stage2.sh", "arms.py"):
        shutil.copy(REPO / "recipes/study" / name, root / "recipes/study" / name)
    (root / "fake.py").write_text(FAKE)
    (root / "arms.yaml").write_text(yaml.safe_dump(arms, sort_keys=False))
    return root


def _run(root: Path, script: str, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "CORES": "0", **env}
    return subprocess.run(
        ["bash", f"recipes/study/{script}"],
        cwd=root,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _argv(folder: Path) -> list[list[str]]:
    return [json.loads(line) for line in (folder / "argv.jsonl").read_text().splitlines()]


def test_stage2_runs_every_arm_from_its_seeds_checkpoint_and_skips_finished(tmp_path):
    arms = {
        "ce": {"script": "fake.py", "loss.weight": 0.0},
        "mix": {"script": "fake.py", "config": "other.yaml", "loss.weight": 0.5},
    }
    root = _driver(tmp_path, arms)
    for seed in (0, 1):
        best = root / f"runs/study/stage1-seed{seed}/best"
        best.mkdir(parents=True)
        (best / "config.json").write_text("{}")
    done = _run(root, "stage2.sh", SEEDS="0 1", ARMS_FILE="arms.yaml", CONFIG="base.yaml")
    assert done.returncode == 0, done.stderr
    for seed in (0, 1):
        (ce,) = _argv(root / f"runs/study/stage2-seed{seed}/ce")
        assert ce[ce.index("--config") + 1] == "base.yaml"
        assert ce[ce.index("--init_from") + 1] == f"runs/study/stage1-seed{seed}/best"
        assert f"train.seed={seed}" in ce and "loss.weight=0.0" in ce and "--resume" not in ce
        (mix,) = _argv(root / f"runs/study/stage2-seed{seed}/mix")
        assert mix[mix.index("--config") + 1] == "other.yaml"  # the arm's own config wins
        assert "loss.weight=0.5" in mix
    # finished runs are skipped; a run with a checkpoint and no result resumes, whether
    # finetune.py's (accelerate: checkpoint_<step>) or grpo.py's (TRL: checkpoint-<step>)
    (root / "runs/study/stage2-seed1/mix/results.json").unlink()
    (root / "runs/study/stage2-seed1/mix/checkpoints/checkpoint_0").mkdir(parents=True)
    (root / "runs/study/stage2-seed1/ce/results.json").unlink()
    (root / "runs/study/stage2-seed1/ce/checkpoints/checkpoint-25").mkdir(parents=True)
    again = _run(root, "stage2.sh", SEEDS="0 1", ARMS_FILE="arms.yaml", CONFIG="base.yaml")
    assert again.returncode == 0, again.stderr
    assert len(_argv(root / "runs/study/stage2-seed0/ce")) == 1
    for arm in ("mix", "ce"):
        first, second = _argv(root / f"runs/study/stage2-seed1/{arm}")
        assert "--resume" not in first and second[-1] == "--resume", arm
        assert not (root / f"runs/study/stage2-seed1/{arm}/checkpoints").exists()  # removed


def test_stage2_refuses_a_seed_without_its_stage1_checkpoint(tmp_path):
    root = _driver(tmp_path, {"ce": {"script": "fake.py", "loss.weight": 0.0}})
    result = _run(root, "stage2.sh", SEEDS="3", ARMS_FILE="arms.yaml")
    assert result.returncode != 0
    assert "seed 3: no stage-1 checkpoint at runs/study/stage1-seed3/best" in result.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({"CORES": "0 4096"}, "CORES=\"0 4096\": taskset cannot run a process on core '4096'"),
        ({"CORES": "0 one"}, "taskset cannot run a process on core 'one'"),
        ({"GB_PER_RUN": "1e9"}, "GB_PER_RUN=1e9: expected a number of GB"),
        ({"GB_PER_RUN": "100000000"}, "GB_PER_RUN=100000000 GB each: free space, or name fewer"),
    ],
)
def test_a_queue_the_machine_cannot_hold_is_refused_before_any_run(tmp_path, env, message):
    root = _driver(tmp_path, {})
    shutil.copy(root / "fake.py", root / "recipes/finetune.py")
    result = _run(root, "stage1.sh", SEEDS="0 1", **env)
    assert result.returncode != 0
    assert message in result.stderr
    assert not list(root.glob("runs/study/stage1-seed*/argv.jsonl"))  # nothing started


def test_finished_runs_need_no_disk(tmp_path):
    root = _driver(tmp_path, {})
    shutil.copy(root / "fake.py", root / "recipes/finetune.py")
    for seed in (0, 1):
        (root / f"runs/study/stage1-seed{seed}").mkdir(parents=True)
        (root / f"runs/study/stage1-seed{seed}/results.json").write_text('{"after": {}}')
    done = _run(root, "stage1.sh", SEEDS="0 1", GB_PER_RUN="100000000")
    assert done.returncode == 0, done.stderr
    assert "runs/study/stage1-seed0: done" in done.stdout


def test_stage1_records_the_pretrained_score_once_and_deals_seeds_to_cores(tmp_path):
    root = _driver(tmp_path, {})
    shutil.copy(root / "fake.py", root / "recipes/finetune.py")
    result = _run(root, "stage1.sh", SEEDS="4 5 6", CORES="0 0")
    assert result.returncode == 0, result.stderr
    befores = [
        _argv(root / f"runs/study/stage1-seed{seed}")[0][-1] for seed in (4, 5, 6)
    ]  # eval.before=... is the last override
    assert befores == ["eval.before=true", "eval.before=false", "eval.before=false"]


def test_arms_file_of_the_study_gives_one_command_per_arm():
    arms = study_arms.load_arms(REPO / "recipes/study/arms.yaml")
    assert {"ce", "berttune", "balanced", "sampled"} <= set(arms)
    words = study_arms.command(arms["berttune"], "base.yaml")
    assert words[:3] == ["recipes/finetune.py", "--config", "base.yaml"]
    assert "loss.gumbel_temperature=0.1" in words


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
    root = tmp_path / "repo"
    (root / "recipes/study").mkdir(parents=True)
    shutil.copy(REPO / "recipes/study/sync.sh", root / "recipes/study/sync.sh")
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
    done = subprocess.run(["bash", "recipes/study/sync.sh", str(runs)], cwd=root,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    copied = root / "recipes/results/study"
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
        "stage2-seed0/ce/curves.png",
        "stage2-seed0/ce/dev_outputs/step_25.txt",
        "stage2-seed0/ce/log.jsonl",
        "stage2-seed0/ce/results.json",
        "stage2-seed0/ce/test_outputs.txt",
    ]
    # a second task's study goes to the folder named second, the same files
    command = ["bash", "recipes/study/sync.sh", str(runs), "recipes/results/study/xsum"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    second = copied / "xsum"
    assert sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file()) == files


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
