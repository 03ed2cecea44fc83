"""The soft-vs-hard notebook: the committed copy is the executed build of its source, and the
notebook runs top to bottom on a small subset (its own assertions included)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "notebooks"))

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

import build_soft_vs_hard  # noqa: E402


def images(notebook) -> int:
    return sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )


def test_committed_notebook_is_executed_and_current():
    committed = nbformat.read(REPO / "notebooks/soft_vs_hard.ipynb", as_version=4)
    fresh = build_soft_vs_hard.build()
    assert [c.source for c in committed.cells] == [c.source for c in fresh.cells]
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert not [o for c in code for o in c.outputs if o.get("output_type") == "error"]
    assert images(committed) >= 7


def test_notebook_runs_on_a_small_subset(monkeypatch):
    monkeypatch.setenv("BSLOSS_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws PNGs
    if "BSLOSS_DATA_DIR" not in os.environ and not (REPO.parent / "shared/data").is_dir():
        pytest.skip("the shared data folder is missing (set BSLOSS_DATA_DIR)")
    notebook = build_soft_vs_hard.execute(build_soft_vs_hard.build(), timeout=600)
    errors = [
        o
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "error"
    ]
    assert not errors
    assert images(notebook) >= 6
