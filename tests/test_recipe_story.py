"""What a recipe run tells its user (issue 24): one run per output folder (a second is refused,
named, unless --resume or --overwrite), a labelled zero-shot vs fine-tuned table, smoothed
training curves beside held-out F_BERT and CE, a progress line for each phase, and a --resume
that reads checkpoints with weights_only=True (recipes/run.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run import RunLog, check_fresh_output, plot_curves, smoothed, summary_table

REPO = Path(__file__).resolve().parents[1]


def test_a_second_run_into_one_folder_is_refused(tmp_path):
    check_fresh_output(tmp_path, resume=False, overwrite=False)  # empty: fine
    (tmp_path / "log.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(FileExistsError) as caught:
        check_fresh_output(tmp_path, resume=False, overwrite=False)
    message = str(caught.value)
    assert str(tmp_path) in message and "--overwrite" in message and "--resume" in message
    (tmp_path / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    check_fresh_output(tmp_path, resume=True, overwrite=False)  # continuing it: fine
    assert (tmp_path / "log.jsonl").exists()
    check_fresh_output(tmp_path, resume=False, overwrite=True)  # replacing it
    assert not (tmp_path / "log.jsonl").exists()


def test_summary_table_says_what_is_compared():
    before = {"f_bert": 0.40, "ce": 2.60, "examples": 20}
    after = {"f_bert": 0.47, "ce": 2.40, "examples": 20}
    table = summary_table(before, after, 20, 30)
    assert "| metric (test, 20 examples) | zero-shot | fine-tuned (30 steps) | change |" in table
    assert "| f_bert | 0.4000 | 0.4700 | +0.0700 |" in table
    assert "| ce | 2.6000 | 2.4000 | -0.2000 |" in table
    assert "examples |" not in table.split("\n", 2)[2]  # the count is in the header, not a row
    # from a checkpoint (--init_from), the first column is that start, named, not "zero-shot"
    started = summary_table(before, after, 20, 30, started_from="the checkpoint ck",
                            metrics_note="bleu: BLEU")  # fmt: skip
    assert "| metric (test, 20 examples) | start | fine-tuned (30 steps) | change |" in started
    assert "start = the checkpoint ck" in started and "zero-shot" not in started
    assert "bleu: BLEU" in started.splitlines()[-1] and "rouge" not in started


def test_smoothed_is_a_trailing_mean():
    assert smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smoothed([2.0], 5) == [2.0]


def test_curves_draw_training_and_held_out_panels(tmp_path):
    pytest.importorskip("matplotlib")
    log = RunLog(tmp_path / "log.jsonl", True)
    log.write(kind="eval", split="test", step=0, f_bert=0.4, ce=2.6, examples=20)
    for step in (0, 2, 4):
        log.write(kind="eval", split="validation", step=step, f_bert=0.4 + step / 100, ce=2.5,
                  examples=10)  # fmt: skip
    for step in range(1, 5):
        log.write(kind="train", step=step, loss=3.0 - step / 10, ce=2.5, bertscore_loss=0.4)
    log.write(kind="eval", split="test", step=4, f_bert=0.47, ce=2.4, examples=20)
    path = plot_curves(log, tmp_path / "curves.png", "demo")
    assert path.stat().st_size > 10_000


def test_curves_name_the_terms_matching_and_candidates(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    from config import CANDIDATE_LABELS

    titles = []
    set_title = matplotlib.axes.Axes.set_title

    def recording(ax, text, *args, **kwargs):
        titles.append(text)
        return set_title(ax, text, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", recording)
    log = RunLog(tmp_path / "log.jsonl", True)
    for step in range(1, 4):
        log.write(kind="train", step=step, loss=3.0, ce=2.5, bertscore_loss=0.4)
    term = f"hard matching, {CANDIDATE_LABELS['sample']}"
    plot_curves(log, tmp_path / "curves.png", "demo", term)
    assert "training 1 − F_BERT\n(hard matching, sampled answers)" in titles
    assert "training CE" in titles  # the other panels keep their titles


def test_recipe_prints_a_line_per_phase_and_refuses_a_second_run(tmp_path):
    from test_recipes import SUMMARIZATION, TINY, run_recipe

    out = tmp_path / "run"
    done = run_recipe("finetune.py", "--config", SUMMARIZATION, "--output_dir", out, *TINY)
    lines = done.stdout
    for phase in ("loading the scorer", "loading the generator", "building the loss",
                  "zero-shot evaluation", "held-out evaluation at step 0",
                  "held-out evaluation at step 2", "step 2/2", "final evaluation"):  # fmt: skip
        assert f"{phase}" in lines, phase
    assert "zero-shot | fine-tuned (2 steps)" in lines
    evals = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals if e.get("split") == "validation"] == [0, 2]

    again = subprocess.run(
        [sys.executable, str(Path(SUMMARIZATION).parents[1] / "finetune.py"), "--config",
         str(SUMMARIZATION), "--output_dir", str(out), *TINY],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode != 0 and "--overwrite" in again.stderr and str(out) in again.stderr
