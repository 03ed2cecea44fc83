"""The efficacy study's summary (recipes/study/summary.py, `harness.py summary`): finished runs
found by folder, costs read from the logs, and the issue's goal decided from re-scored outputs,
on a small made-up study whose answer is known."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes/study"))

import summary  # noqa: E402
from summarize_results import Scores  # noqa: E402
from tasks import get_task  # noqa: E402

REFERENCES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good.",
    "And God called the light Day, and the darkness he called Night.",
    "And God made the firmament, and divided the waters.",
    "And God called the firmament Heaven.",
    "And the evening and the morning were the third day.",
]
TRANSLATION_METRICS = ["bleu", "chrf"]
POOR = ["the the the", "a thing", "nothing at all", "and and", "words", "is was", "of", "a b"]


def _write_run(folder: Path, outputs: list[str], cpu_per_step: float, dev: list[str]) -> None:
    folder.mkdir(parents=True)
    (folder / "test_outputs.txt").write_text("\n".join(outputs) + "\n")
    (folder / "dev_outputs").mkdir()
    log, cpu = [], 0.0
    for step in range(1, 5):
        cpu += cpu_per_step
        log.append({"kind": "train", "step": step, "cpu": cpu})
        if step % 2 == 0:
            cpu += 100.0  # an evaluation: not a step's cost
            log.append({"kind": "eval", "split": "validation", "step": step, "cpu": cpu})
            (folder / f"dev_outputs/step_{step}.txt").write_text("\n".join(dev) + "\n")
    (folder / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))


@pytest.fixture(scope="module")
def made_up_study(tmp_path_factory) -> Path:
    """ce answers poorly; `good` answers with the references in every seed at a tenth of GRPO's
    compute; `grpo` half-way (references for half the verses); `same` is ce again; the
    equal-compute control `longer` (seeds 0 and 1) answers three quarters with the references."""
    root = tmp_path_factory.mktemp("study")
    half = REFERENCES[:4] + POOR[4:]
    for seed in range(3):
        _write_run(root / f"stage2-seed{seed}/ce", POOR, 10.0, POOR)
        _write_run(root / f"stage2-seed{seed}/good", REFERENCES, 12.0, REFERENCES)
        _write_run(root / f"stage2-seed{seed}/grpo", half, 200.0, half)
        _write_run(root / f"stage2-seed{seed}/same", POOR, 10.0, POOR)
    (root / "stage2-seed0/unfinished").mkdir()  # no test_outputs.txt: not a finished run
    for seed in range(2):  # an equal-compute control for two seeds: better than ce, below good
        _write_run(root / f"equal-compute/longer-seed{seed}", REFERENCES[:6] + POOR[6:], 10.0, POOR)
    for seed in range(3):  # a method stopped early: good's answers for most verses, cheaper
        _write_run(root / f"equal-compute/short-seed{seed}", REFERENCES[:7] + POOR[7:], 6.0, POOR)
    return root


def test_a_table_cell_is_the_mean_and_spread_over_seeds_and_one_seed_shows_no_spread():
    # a single run's spread is unknown; "± 0.0000" would read as three identical seeds
    from summarize_results import over_seeds

    assert over_seeds([0.5], "f_bert") == "0.5000"
    assert over_seeds([0.1, 0.2, 0.3], "f_bert") == "0.2000 ± 0.1000"
    assert over_seeds([10.0, 12.0], "bleu") == "11.00 ± 1.41"


def test_runs_and_costs_are_read_from_the_folders(made_up_study):
    study = summary.load_study(made_up_study)
    assert list(study.arms) == ["ce", "good", "grpo", "same"]  # the control first
    assert all(sorted(runs) == [0, 1, 2] for runs in study.arms.values())
    run = study.arms["grpo"][0]
    assert run.cpu_per_step == pytest.approx(200.0)  # evaluations left out
    assert run.cpu_total == pytest.approx(4 * 200.0 + 2 * 100.0)
    assert run.cpu_training == pytest.approx(4 * 200.0)  # the evaluations' 200 left out
    assert sorted(run.dev) == [2, 4] and run.dev_cpu(4) == pytest.approx(1000.0)
    lines, total = summary.cost_table(study)
    # the stage-2 arms' total: the runs of other lengths are listed but not added
    assert total == pytest.approx(3 * (240 + 248 + 1000 + 240) / 3600)
    hours = f"{4 * 200.0 / 3600:.2f} | {1000.0 / 3600:.2f} |"
    assert f"| grpo | 3 | 200.0 | {hours} — |" in lines  # every step carries the term
    assert any(line.startswith("| short | 3 | 6.0 |") for line in lines)


def test_the_goal_is_decided_from_the_scores(made_up_study):
    study = summary.load_study(made_up_study)
    scores = Scores(get_task("translation"), REFERENCES)
    samples = np.random.default_rng(0).integers(0, len(REFERENCES), (200, len(REFERENCES)))
    lines = summary.goal_lines(study, scores, samples, TRANSLATION_METRICS, ["longer"])
    rows = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    # neither the control nor GRPO is judged, nor a run of CE alone (equal-compute/'s controls)
    assert set(rows) == {"good", "same", "short"}
    assert rows["good"].endswith("| met |") and "| 3/3 |" in rows["good"]
    assert rows["same"].endswith("| not met |") and "| 0/3 |" in rows["same"]
    # the short run: better than ce in its 3 seeds at 24/800 of GRPO's training CPU (the
    # evaluations, counted, give (24 + 200) / 1000)
    assert rows["short"].endswith("| met |") and "0.03× its training CPU (0.22× with" in rows[
        "short"]  # fmt: skip
    # without the made-up CE control named: judged, "longer" has 2 seeds: too few
    rows = {line.split(" | ")[0].strip("| "): line for line in
            summary.goal_lines(study, scores, samples, TRANSLATION_METRICS)[2:]}  # fmt: skip
    assert rows["longer"].endswith("| not met |") and "| 2/2 |" in rows["longer"]
    # without a GRPO run the compute half of the goal cannot be met
    del study.arms["grpo"]
    rows = summary.goal_lines(study, scores, samples, TRANSLATION_METRICS)[2:]
    assert all(row.endswith("| not met |") and "no GRPO run" in row for row in rows)


def test_the_goal_of_a_summarization_study_asks_rouge_not_to_be_lower(made_up_study):
    """The second task's study (XSum): the goal's "not significantly lower" is on its own
    metrics, ROUGE-1/2/L; an arm that equals the control everywhere cannot meet it."""
    study = summary.load_study(made_up_study)
    scores = Scores(get_task("summarization"), REFERENCES)
    samples = np.random.default_rng(0).integers(0, len(REFERENCES), (200, len(REFERENCES)))
    metrics = ["rouge1", "rouge2", "rougeL"]
    lines = summary.goal_lines(study, scores, samples, metrics)
    assert "| ROUGE-1, ROUGE-2, ROUGE-L not lower |" in lines[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    assert rows["good"].endswith("| met |") and "| yes | Δ" in rows["good"]
    assert rows["same"].endswith("| not met |")


def test_the_matching_ablation_pairs_each_hard_arm_with_its_soft_twin(made_up_study):
    study = summary.load_study(made_up_study)
    scores = Scores(get_task("translation"), REFERENCES)
    samples = np.random.default_rng(0).integers(0, len(REFERENCES), (200, len(REFERENCES)))
    metrics = ["f_bert", "bleu"]
    lines = summary.matching_ablation(
        study, scores, metrics, samples, (("good", "same"), ("missing", "ce"))
    )
    rows = lines[len(summary.DIFFERENCE_HEADER) :]
    # one row per metric, only the pair with finished runs on both sides
    names = [summary.NAMES[m] for m in metrics]
    assert [r.split(" | ")[:2] for r in rows] == [["| good − same", n] for n in names]
    assert all(r.endswith("| 3/3 |") for r in rows)  # the references win in every seed
    assert summary.matching_ablation(study, scores, metrics, samples, pairs=()) == []


def test_the_length_check_splits_f_bert_into_precision_and_recall(tmp_path):
    # ce pads each reference with words it does not have; dropping the padding shortens the
    # answers and raises the precision; keeping the first half of each reference shortens them
    # and lowers the recall. Each part is stored per example; F_BERT is their harmonic mean.
    padded = [f"{r} and then the market closed lower on Tuesday" for r in REFERENCES]
    halves = [" ".join(r.split()[: len(r.split()) // 2]) for r in REFERENCES]
    root = tmp_path / "study"
    for seed in range(2):
        _write_run(root / f"stage2-seed{seed}/ce", padded, 10.0, REFERENCES)
        _write_run(root / f"stage2-seed{seed}/trimmed", REFERENCES, 10.0, REFERENCES)
        _write_run(root / f"stage2-seed{seed}/halves", halves, 10.0, REFERENCES)
    study = summary.load_study(root)
    scores = Scores(get_task("translation"), REFERENCES)
    parts = scores.cached(halves)
    p, r = parts["p_bert_mpnet"], parts["r_bert_mpnet"]
    np.testing.assert_allclose(parts["f_bert_mpnet"], 2 * p * r / (p + r), atol=1e-6)
    # the parts are not columns of the main tables
    assert summary.column_order(scores.all(halves)) == ["f_bert", "f_bert_mpnet", "bleu", "chrf",
                                                        "words"]  # fmt: skip
    samples = np.random.default_rng(0).integers(0, len(REFERENCES), (200, len(REFERENCES)))
    lines = summary.length_check(study, scores, samples)
    rows = {
        tuple(line.split(" | ")[:2]): float(line.split(" | ")[2])
        for line in lines[len(summary.DIFFERENCE_HEADER) :]
    }
    names = precision, recall, words = [summary.NAMES[m] for m in summary.LENGTH_CHECK]
    assert sorted(rows) == sorted((f"| {a} − ce", n) for a in ("halves", "trimmed") for n in names)
    assert rows["| trimmed − ce", words] < 0 and rows["| trimmed − ce", precision] > 0
    assert rows["| halves − ce", words] < 0 and rows["| halves − ce", recall] < 0
    for arm in ("trimmed", "halves"):  # only the control: nothing to compare
        for seed in range(2):
            (root / f"stage2-seed{seed}/{arm}/test_outputs.txt").unlink()
    assert summary.length_check(summary.load_study(root), scores, samples) == []


def test_equal_compute_controls_are_paired_with_ce_and_their_arm(made_up_study):
    study = summary.load_study(made_up_study)
    assert list(study.arms) == ["ce", "good", "grpo", "same"]  # the control is not an arm
    assert sorted(study.equal_compute["longer"]) == [0, 1]
    scores = Scores(get_task("translation"), REFERENCES)
    samples = np.random.default_rng(0).integers(0, len(REFERENCES), (200, len(REFERENCES)))
    metrics = ["f_bert", "bleu"]
    lines = summary.equal_compute(study, scores, metrics, samples, pairs=(("longer", "good"),))
    rows = lines[len(summary.DIFFERENCE_HEADER) : len(summary.DIFFERENCE_HEADER) + 4]
    names = [summary.NAMES[m] for m in metrics]
    labels = [[f"| {label}", n] for label in ("longer − ce", "good − longer") for n in names]
    assert [r.split(" | ")[:2] for r in rows] == labels
    # on the two seeds the control has: it beats ce, and the references beat it, in both
    assert all(r.endswith("| 2/2 |") for r in rows)
    assert all(float(r.split(" | ")[2]) > 0 for r in rows)
    hours = [(4 * per_step + 2 * 100.0) / 3600 for per_step in (10.0, 12.0)]
    training = [4 * per_step / 3600 for per_step in (10.0, 12.0)]
    assert lines[-1] == (f"- longer (seeds 0, 1): {hours[0]:.2f} core-hours per run "
                         f"({training[0]:.2f} training) against good's {hours[1]:.2f} "
                         f"({training[1]:.2f} training)")  # fmt: skip
    assert summary.equal_compute(study, scores, metrics, samples, pairs=(("none", "good"),)) == []


def test_dev_curves_are_plotted(made_up_study, tmp_path):
    study = summary.load_study(made_up_study)
    curves = summary.dev_curves(study, REFERENCES)
    assert [step for step, _, _ in curves["good"][0]] == [2, 4]
    assert curves["good"][0][0][2] > 0.99 > curves["ce"][0][0][2]
    path = summary.plot_dev_curves(curves, tmp_path / "dev.png")
    assert path.stat().st_size > 10_000


def test_dev_curves_without_dev_outputs_are_refused_not_drawn_empty(made_up_study, tmp_path):
    study = summary.load_study(made_up_study)
    for runs in study.arms.values():
        for run in runs.values():
            run.dev.clear()  # as when the dev answers were not copied beside the logs
    curves = summary.dev_curves(study, REFERENCES)
    with pytest.raises(ValueError, match="no run has dev outputs"):
        summary.plot_dev_curves(curves, tmp_path / "dev.png")
    assert not (tmp_path / "dev.png").exists()


def test_stored_scores_are_the_computed_ones_and_are_not_recomputed(tmp_path, monkeypatch):
    # the summaries keep per-example scores on disk: a second summary re-scores nothing it has
    # seen, and gives the very numbers the scorers gave; other outputs or references are new
    task = get_task("translation")
    first = Scores(task, REFERENCES, store=tmp_path)
    computed = first.cached(POOR)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    second = Scores(task, REFERENCES, store=tmp_path)
    monkeypatch.setattr(Scores, "per_example", lambda self, outputs: pytest.fail("re-scored"))
    stored = second.cached(POOR)
    assert stored.keys() == computed.keys()
    for name in computed:
        np.testing.assert_array_equal(stored[name], computed[name])
    monkeypatch.undo()
    Scores(task, REFERENCES, store=tmp_path).cached(REFERENCES)  # other outputs
    Scores(task, POOR, store=tmp_path).cached(REFERENCES)  # other references
    assert len(list(tmp_path.glob("*.npz"))) == 3
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_schedule_run_is_timed_against_its_own_ce_alone_steps():
    """A run that answers every 4th step: its mean step over its CE-alone steps (the steps
    without ``bertscore_loss``), the evaluations left out; NaN where no step (or every step)
    carries the term."""
    costs = {1: 30.0, 2: 10.0, 3: 12.0, 4: 8.0, 5: 30.0, 6: 10.0}  # steps 1 and 5 answer
    log, cpu = [], 0.0
    for step, cost in costs.items():
        cpu += cost
        entry = {"kind": "train", "step": step, "cpu": cpu}
        if step % 4 == 1:
            entry["bertscore_loss"] = 0.3
        log.append(entry)
        if step == 3:
            cpu += 500.0  # an evaluation between steps 3 and 4: neither step's cost
            log.append({"kind": "eval", "split": "validation", "step": step, "cpu": cpu})
    run = summary.Run([], log)
    # intervals ending at steps 2, 3, 5, 6 (step 1 has no step before it; 4 follows the eval)
    assert run.cpu_over_ce_steps == pytest.approx(np.mean([10, 12, 30, 10]) / np.mean([10, 12, 10]))
    untimed = [{k: v for k, v in e.items() if k != "bertscore_loss"} for e in log]
    assert np.isnan(summary.Run([], untimed).cpu_over_ce_steps)  # CE alone: no control to take
    every = [e | {"bertscore_loss": 0.3} if e["kind"] == "train" else e for e in log]
    assert np.isnan(summary.Run([], every).cpu_over_ce_steps)
