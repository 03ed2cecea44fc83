"""The committed results of recipes/RESULTS.md are what their outputs score: re-scoring a
run's committed test outputs with the training scorer gives the F_BERT its results.json recorded,
so the tables describe those runs. Every file is checked here for its shape (one line per test
example, the keys the tables read); the re-scoring is a sample (one run per task and study, the
manifest's `sample`): `make verify-results` (recipes/study/harness.py verify) re-scores them all
and re-makes the studies' tables."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "recipes" / "results"
# the short-budget study's runs (<task>/<run>-s<seed>), and their re-run with the fixed training
# signal (fixed-gradient/<task>/<run>-s<seed>)
RERUN = RESULTS / "fixed-gradient"
RUNS = sorted(
    p
    for p in [*RESULTS.glob("*/*-s*"), *RERUN.glob("*/*-s*")]
    if p.parent.name != "study" and (p / "results.json").exists()
)
# the efficacy study's finished runs (issue 25; recipes/study/harness.py sync copies them as they
# arrive): stage1-seed<N> (the converged start), stage2-seed<N>/<arm>, and equal-compute/<run>
# (runs of other lengths: CE continued for a costlier arm's compute, an arm stopped early)
STUDY = RESULTS / "study"
STUDY_RUNS = sorted(
    p
    for p in [
        *STUDY.glob("stage1-seed*"),
        *STUDY.glob("stage2-seed*/*"),
        *STUDY.glob("equal-compute/*"),
    ]
    if (p / "results.json").exists()
)
# the study's second task (XSum; recipes/configs/xsum-gemma-stage*.yaml), synced to study/xsum/
XSUM_STUDY = STUDY / "xsum"
XSUM_RUNS = sorted(
    p
    for p in [
        *XSUM_STUDY.glob("stage1-seed*"),
        *XSUM_STUDY.glob("stage2-seed*/*"),
        *XSUM_STUDY.glob("equal-compute/*"),
    ]
    if (p / "results.json").exists()
)
STAGE2_STEPS = 100  # recipes/configs/bible-es-en-gemma-stage2.yaml's train.max_steps


@pytest.fixture(scope="module")
def references():
    from summarize_results import CONFIGS, held_out

    return {task: held_out(task)[1] for task in CONFIGS}


def test_every_results_folder_has_its_task_from_its_config():
    # the tables' task (ROUGE or BLEU/chrF) comes from the config's `task`, not the folder's name
    from summarize_results import task_of

    folders = [p for p in RESULTS.iterdir() if p.is_dir() and p not in (STUDY, RERUN)]
    assert {task_of(p).name for p in folders} == {"summarization", "translation"}
    assert task_of(RESULTS / "grpo-bible-es-en").name == "translation"
    with pytest.raises(ValueError, match="no config known for 'wmt'"):
        task_of(RESULTS / "grpo-wmt")


def test_the_study_has_three_seeds_of_each_run():
    assert RUNS, "no committed study runs"
    names = {(p.parent, p.name.rpartition("-s")[0]) for p in RUNS}
    for task, run in names:
        seeds = [p for p in RUNS if p.parent == task and p.name.rpartition("-s")[0] == run]
        assert len(seeds) >= 3, (task, run)
    names = {(task.name, run) for task, run in names if task.parent == RESULTS}
    assert {("xsum", "ce"), ("xsum", "hard"), ("xsum", "soft")} <= names
    assert {("bible-es-en", "ce"), ("bible-es-en", "hard"), ("bible-es-en", "soft")} <= names


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.mark.parametrize("run", RUNS, ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_outputs_have_one_line_per_example_and_a_score(run, references):
    result = json.loads((run / "results.json").read_text())
    refs = references[run.parent.name]
    assert len(_lines(run / "test_outputs.txt")) == len(refs)
    assert 0 < result["after"]["f_bert"] < 1
    before = run / "test_outputs_before.txt"
    if before.exists():
        assert len(_lines(before)) == len(refs) and 0 < result["before"]["f_bert"] < 1


# the sample re-scored here: the first run of each task folder
SAMPLE = sorted({p.parent: p for p in reversed(RUNS)}.values())


@pytest.mark.parametrize("run", SAMPLE, ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_outputs_score_what_results_json_says(run, references, scorer):
    result = json.loads((run / "results.json").read_text())
    outputs = (run / "test_outputs.txt").read_text(encoding="utf-8").split("\n")[:-1]
    refs = references[run.parent.name]
    assert len(outputs) == len(refs)
    f = scorer.score(outputs, refs)[2]
    assert float(f.mean()) == pytest.approx(result["after"]["f_bert"], abs=1e-5)
    before = run / "test_outputs_before.txt"
    if before.exists():
        zero_shot = before.read_text(encoding="utf-8").split("\n")[:-1]
        f = scorer.score(zero_shot, refs)[2]
        assert float(f.mean()) == pytest.approx(result["before"]["f_bert"], abs=1e-5)


@pytest.fixture(scope="module")
def study_references():
    from study.summary import references

    return references()["test"]


def _study_name(run: Path) -> str:
    return str(run.relative_to(STUDY))


@pytest.fixture(scope="module")
def xsum_study_references(tmp_path_factory):
    """The XSum study's 200 test summaries, from ../shared/data's XSum split as the runs' was
    (the file is not vendored)."""
    from _tokenizers import xsum_study_file
    from study.summary import references

    path = xsum_study_file(tmp_path_factory.mktemp("xsum"))
    config = REPO / "recipes/configs/xsum-gemma-stage2.yaml"
    return references(config, [f"data.path={path}"])["test"]


def _manifest():
    from study.harness import load_manifest

    return load_manifest()


@pytest.mark.parametrize("run", STUDY_RUNS + XSUM_RUNS, ids=_study_name)
def test_study_outputs_have_one_line_per_example_and_their_results_keys(run):
    from study.harness import check_scores

    examples = json.loads((run / "results.json").read_text())["after"]["examples"]
    assert examples == 200
    assert check_scores(run, ["reference"] * examples, scorer=None) == []


@pytest.mark.parametrize("name", ["es-en"])
def test_a_study_sample_scores_what_results_json_says(name, study_references, scorer):
    from study.harness import check_scores

    study = _manifest()[name]
    assert check_scores(study.results / study.sample, study_references, scorer) == []


def test_the_xsum_study_sample_scores_what_results_json_says(xsum_study_references, scorer):
    from study.harness import check_scores

    study = _manifest()["xsum"]
    assert check_scores(study.results / study.sample, xsum_study_references, scorer) == []


def test_study_stage2_arms_start_alike_and_train_the_same_steps():
    """Equal compute in the sense the study compares: every arm of a seed starts from that
    seed's stage-1 checkpoint with the same seed and trains the same number of optimizer steps
    (a GRPO arm's steps are its reward curve's)."""
    arms = [p for p in STUDY_RUNS if p.parent.name.startswith("stage2-seed")]
    assert arms, "no committed stage-2 runs"
    for run in arms:
        seed = int(run.parent.name.removeprefix("stage2-seed"))
        result = json.loads((run / "results.json").read_text())
        assert result["seed"] == seed, run
        assert Path(result["init_from"]).parts[-2:] == (f"stage1-seed{seed}", "best"), run
        assert result["steps"] == STAGE2_STEPS, run
        steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "train"]  # fmt: skip
        if "reward_curve" in result:
            steps = [c["step"] for c in result["reward_curve"]]
        # runs known to have trained longer (the manifest's over_budget, README there)
        expected = _manifest()["es-en"].over_budget.get(_study_name(run), STAGE2_STEPS)
        assert sorted(set(steps)) == list(range(1, expected + 1)), run


def test_study_runs_of_other_lengths_start_alike_and_train_the_steps_they_are_named_for():
    """equal-compute/<arm>-<steps>-seed<N> (both tasks): the seed's stage-1 start and seed,
    <steps> steps."""
    runs = [p for p in STUDY_RUNS if p.parent.name == "equal-compute"]
    assert runs, "no committed runs of other lengths"
    runs += [p for p in XSUM_RUNS if p.parent.name == "equal-compute"]
    for run in runs:
        name, seed = run.name.rsplit("-seed", 1)
        steps = int(name.rsplit("-", 1)[1])
        result = json.loads((run / "results.json").read_text())
        assert result["seed"] == int(seed), run
        assert Path(result["init_from"]).parts[-2:] == (f"stage1-seed{seed}", "best"), run
        assert result["steps"] == steps, run
        logged = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        trained = sorted({e["step"] for e in logged if e["kind"] == "train"})
        assert trained == list(range(1, steps + 1)), run


def test_grpo_outputs_score_what_results_json_says(scorer):
    folder = RESULTS / "grpo-bible-es-en"
    result = json.loads((folder / "results.json").read_text())
    rows = [json.loads(line) for line in (folder / "test_outputs.jsonl").read_text().splitlines()]
    refs = [r["reference"] for r in rows]
    for when in ("before", "after"):
        f = scorer.score([r[when] for r in rows], refs)[2]
        assert float(f.mean()) == pytest.approx(result[when]["f_bert"], abs=1e-5)
    curve = result["reward_curve"]
    assert [c["step"] for c in curve] == list(range(1, result["steps"] + 1))


def test_a_grpo_run_as_grpo_py_writes_it_is_summarized(tmp_path):
    """summarize_results.py read only the first grpo.py's test_outputs.jsonl: a run of today's
    grpo.py (test_outputs_before.txt, test_outputs.txt, results.json's command) crashed it,
    FileNotFoundError. Its references are the test split of the command's config and --set
    options; answers equal to them score 1."""
    from summarize_results import grpo_table, run_test_split

    folder = tmp_path / "grpo-bible-es-en"
    folder.mkdir()
    config = "recipes/configs/bible-es-en-gemma-grpo.yaml"  # relative: the repository's
    command = ["recipes/grpo.py", "--config", config, "--output_dir", str(folder),
               "--set", "data.max_test=3", "--set", "train.steps=1"]  # fmt: skip
    (folder / "results.json").write_text(json.dumps({"command": shlex.join(command)}))
    task, references = run_test_split(folder)
    assert task.name == "translation" and len(references) == 3
    (folder / "test_outputs_before.txt").write_text("\n".join(["a", "b", "c"]) + "\n")
    (folder / "test_outputs.txt").write_text("\n".join(references) + "\n")
    table = grpo_table(folder)
    assert "Held-out prompts: 3." in table
    after = next(line for line in table.splitlines() if line.startswith("| after |"))
    assert after.split(" | ")[1] == "1.0000", table  # F_BERT of the references themselves


# the study's arms re-run through the mixin recipe (recipes/RESULTS.md: "The study's path is the
# library's path"), and `sampled` again at 7b7b613 (hardening round 6's gradient)
MIXIN_RUNS = sorted(p for p in (STUDY / "mixin-seed0").glob("*") if (p / "results.json").exists())


@pytest.mark.parametrize("run", MIXIN_RUNS, ids=_study_name)
def test_mixin_reruns_score_what_results_json_says(run, study_references, scorer):
    from study.harness import check_scores

    assert check_scores(run, study_references, scorer) == []
