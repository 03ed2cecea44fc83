"""``benchmarks/gpu.py --smoke``: issue 45's GPU benchmark runs every section at tiny sizes on
the CPU and writes a table with each section's rows. The GPU run happens once, on a lent machine
with a few minutes of device time: a section that crashes or drops out there is lost, so the
script is run whole here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _tokenizers import data_file

pytestmark = pytest.mark.slow  # one run of the whole script, 1-2 minutes on 2 cores

REPO_ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("placement", "fused", "gemma_step", "precision", "checkpointing", "metric")


def rows_of(results: dict, section: str) -> list[dict]:
    return results["sections"][section]["rows"]


def measured(rows: list[dict], name: str | None = None, **cells) -> list[dict]:
    """The rows with these cells (``name``: the fused section's ``pass``) that carry a time
    (not skipped, not failed)."""
    if name is not None:
        cells["pass"] = name
    return [
        r for r in rows if all(r.get(k) == v for k, v in cells.items()) and r.get("ms") is not None
    ]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[dict, str]:
    data_file("brown-sentences.txt")  # the metric's pairs (skips without the shared data)
    folder = tmp_path_factory.mktemp("gpu-smoke")
    out = folder / "gpu.md"
    command = [sys.executable, "benchmarks/gpu.py", "--smoke", "--out", str(out)]
    command += ["--profile", "CE + term"]  # the fused section's and the Gemma step's rows
    # no carried folder: MiniLM's files from the embedded scorer, no wheels to install
    command += ["--assets", str(folder / "no-assets")]
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    return results, out.read_text(encoding="utf-8")


def test_every_section_runs_to_the_end_and_is_in_the_table(smoke_run):
    results, markdown = smoke_run
    assert set(results["sections"]) == set(SECTIONS)
    for name in SECTIONS:
        section = results["sections"][name]
        assert section["status"] == "done", (name, section.get("error"))
        assert section["rows"], name
        failed = [r for r in section["rows"] if "FAILED" in json.dumps(r)]
        assert not failed, (name, failed)
    headings = [line for line in markdown.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Goals" and len(headings) == 1 + len(SECTIONS)
    assert "SMOKE" in markdown


def test_placement_checks_the_loss_metric_reward_and_both_trainer_paths(smoke_run):
    results, _ = smoke_run
    checks = {r["check"]: r["result"] for r in rows_of(results, "placement")}
    for part in ("BERTScoreLoss", "BERTScorer", "BERTScoreReward", "fused=True", "fused=False"):
        assert [c for c in checks if part in c], part
    assert set(checks.values()) == {"OK"}


def test_fused_section_has_every_pass_at_both_sizes_with_values_that_agree(smoke_run):
    results, _ = smoke_run
    rows = rows_of(results, "fused")
    for tokens in ("2x32", "2x16"):
        for name in ("torch CE, bf16 logits", "torch CE, float32 logits"):
            assert measured(rows, name, tokens=tokens), (tokens, name)
        dense = measured(rows, "bsloss dense, CE + term (logits=)", tokens=tokens)
        fused = measured(rows, "bsloss fused, CE + term", tokens=tokens, backend="torch")
        term = measured(rows, "bsloss fused, term only", tokens=tokens, backend="torch")
        assert dense and fused and term, tokens
        assert fused[0]["ce"] == pytest.approx(dense[0]["ce"], rel=1e-3)
        assert fused[0]["term"] == pytest.approx(dense[0]["term"], rel=1e-3)
        assert fused[0]["vs_dense"] is not None
        # the optional libraries and the Triton backend: a row saying why they were not run
        for name in ("Cut Cross-Entropy linear_cross_entropy", "Liger fused linear CE"):
            assert [r for r in rows if r["tokens"] == tokens and r["pass"] == name], name
        triton = [r for r in rows if r["tokens"] == tokens and r.get("backend") == "triton"]
        assert all("CUDA" in r["note"] for r in triton)


def test_gemma_precision_checkpointing_and_metric_rows(smoke_run):
    results, _ = smoke_run
    gemma = rows_of(results, "gemma_step")
    assert measured(gemma, variant="the model's own CE (model(input_ids, labels=...).loss)")
    fused = [r for r in measured(gemma, backend="torch") if r["variant"].startswith("mixin")]
    assert len(fused) == 2 and all(r["vs_model"] is not None for r in fused)

    precision = rows_of(results, "precision")
    for name in ("fp32", "bf16 autocast", "fp16 autocast"):
        for setting in ("on", "off"):
            assert measured(precision, precision=name, checkpointing=setting), (name, setting)

    checkpointing = rows_of(results, "checkpointing")
    assert measured(checkpointing, checkpointing="on") and measured(
        checkpointing, checkpointing="off"
    )

    metric = rows_of(results, "metric")
    exact = [r for r in metric if r["system"].endswith("exact")]
    assert exact and exact[0]["pairs_per_s"] > 0
    bert_score = [r for r in metric if r["system"].startswith("bert_score")]
    assert bert_score
    if bert_score[0].get("s") is not None:  # installed: the two agree as the metric promises
        assert exact[0]["max_abs_diff"] < 1e-5


def test_profile_covers_the_rows_it_names_and_only_them(smoke_run):
    results, _ = smoke_run
    text = Path(results["profile_path"]).read_text(encoding="utf-8")
    headers = [line for line in text.splitlines() if line.startswith("## ")]
    assert headers and all("CE + term" in line for line in headers)
    assert any(line.startswith("## fused:") for line in headers)
    assert any(line.startswith("## gemma_step:") for line in headers)
    assert "Self CPU" in text  # the profiler's table (CPU: smoke)
    # each row's pass says whether the host or the device set its pace
    sections = text.split("\n## ")
    assert all(re.search(r"wall [0-9.]+ ms under the profiler; device busy [0-9.]+ ms; host self "
                         r"time [0-9.]+ ms", part) for part in sections)  # fmt: skip


def test_the_gpu_check_runs_every_cuda_test():
    """``make gpu-check`` runs the Makefile's ``CUDA_TESTS`` on the lent card, where every test
    that skips without CUDA must run: one left off that list never runs anywhere."""
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    listed = re.search(r"^CUDA_TESTS :=(.*?)\n\n", makefile, re.M | re.S)
    assert listed is not None, "no CUDA_TESTS in the Makefile"
    named = set(listed.group(1).replace("\\", " ").split())
    skipping = re.compile(
        r"^@pytest\.mark\.skipif\(not torch\.cuda\.is_available\(\).*?^def (test_\w+)", re.M | re.S
    )
    found = {
        f"tests/{path.name}::{name}"
        for path in sorted((REPO_ROOT / "tests").glob("test_*.py"))
        for name in skipping.findall(path.read_text(encoding="utf-8"))
    }
    assert len(found) >= 6, found
    assert found == named


def test_the_scratch_folder_is_never_read_as_a_t5_by_bert_score(monkeypatch, tmp_path):
    """bert_score loads any model name with "t5" in it as a T5 encoder: the smoke run's metric
    section failed in CI when mkdtemp named the folder of its random BERT scorer so. A folder
    so named is given back and another one made."""
    import tempfile

    from benchmarks import gpu

    names = iter(["bsloss-gpu-at5q", "bsloss-gpu-plain"])

    def mkdtemp(prefix: str = "") -> str:
        folder = tmp_path / next(names)
        folder.mkdir()
        return str(folder)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    folder = gpu.scratch_folder()
    assert folder.name == "bsloss-gpu-plain" and "t5" not in str(folder)
    assert not (tmp_path / "bsloss-gpu-at5q").exists()
