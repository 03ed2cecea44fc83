"""Issue 22: each of the 9 root causes found by the second adversarial round has a test here
(``test_rcN_...``), and each decision on its list of questionable behaviour
(``test_decision_...``). The property-based side (the fused path, the bridge and the trainer
integration under the fuzz suite's invariants) is in test_fuzz.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- root causes


# --------------------------------------------------------------------------- decisions


def test_decision_recipe_config_values_checked_at_load():
    """--set train.steps=abc and --set loss.weight=-1 passed config loading; decision: every
    section's values are checked against their field's type and range when loaded, named."""
    from config import load_config

    path = REPO / "recipes/configs/xsum-bert2bert.yaml"
    cases = {
        "train.steps=abc": "config train.steps: expected int, got 'abc'",
        "train.steps=0": "config train.steps: expected a finite number > 0",
        "train.learning_rate=-1e-4": "config train.learning_rate: expected a finite number > 0",
        "loss.weight=-1": "config loss.weight: expected a finite number >= 0",
        "loss.weight=nan": "config loss.weight: expected a finite number >= 0",
        "loss.candidates=beam": "config loss.candidates: expected one of",
        "eval.before=3": "config eval.before: expected bool",
        "data.max_train=2.5": "config data.max_train: expected int | None",
    }
    for override, message in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("|", r"\|")):
            load_config(path, [override])
    config = load_config(path, ["train.steps=3", "loss.weight=0.5", "train.max_grad_norm=null"])
    assert config.train.steps == 3 and config.loss["weight"] == 0.5


RESUME_SCRIPT = """
import pickle, sys, torch
from pathlib import Path
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from run import EarlyStopping, Progress, RunLog, Timer, resume

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=str(out), automatic_checkpoint_naming=True))
timer = Timer()
progress = Progress(EarlyStopping("dev_ce", None), timer)
accelerator.register_for_checkpointing(progress)
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
progress.step = 3
sum(i * i for i in range(3_000_000))  # CPU time before the checkpoint
saved_cpu = timer.cpu()
accelerator.save_state()
log = RunLog(out / "log.jsonl", True)
progress.step = 0
timer.continue_from(0.0, 0.0)  # as a fresh process's timer
print("resumed", resume(accelerator, out, log, progress))
print("cpu counts on", saved_cpu > 0 and timer.cpu() >= saved_cpu)


class RunsCode:
    def __reduce__(self):
        return (print, ("CODE RAN",))


(checkpoint,) = (out / "checkpoints").iterdir()
torch.save({"state": RunsCode()}, checkpoint / "optimizer.bin")
try:
    resume(accelerator, out, log, progress)
except pickle.UnpicklingError as error:
    print("refused", type(error).__name__)
"""


@pytest.mark.slow  # a fresh process imports accelerate (its state is a per-process singleton)
def test_decision_resume_unpickles_with_weights_only(tmp_path):
    """--resume goes through accelerate's load_state, which unpickles checkpoint files;
    decision: they are read with weights_only=True (no arbitrary objects; documented), so a
    tampered checkpoint is refused instead of running code."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'recipes'}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed 3" in done.stdout and "refused UnpicklingError" in done.stdout
    assert "cpu counts on True" in done.stdout  # the log's cpu goes on across a resume
    assert "CODE RAN" not in done.stdout
