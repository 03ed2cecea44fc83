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
