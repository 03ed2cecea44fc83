"""BERTScorer(distributed=True) under torch.distributed: two CPU processes (gloo) split the
pairs, each encodes about half of the texts, and every process gets all scores in input order,
equal to one process's within 1e-6 (idf from all references and the baseline alike on both)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bsloss

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port no one listens on now (a fixed one collides with any other run on the machine)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_two_processes(script: str, result_dir: Path, *args: str) -> list:
    """``tests/<script> result_dir *args`` under ``torchrun --nproc_per_node 2`` (gloo, one
    thread each); what each rank saved as ``result_dir/rank<r>.pt``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), str(REPO / "tests" / script), str(result_dir), *args,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(result_dir / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.slow  # two processes each load the scorer: ~40 s on 2 busy cores
def test_two_processes_split_the_pairs_and_match_one_process(tmp_path, stsb_dev):
    """Two processes split the pairs and each gets one process's scores; different inputs
    raise on both; inputs invalid on one process raise on both at once."""
    rows = stsb_dev[:120]
    cands = [r[1] for r in rows]
    refs = [r[2] for r in rows]
    multi = [[r[2], r[1][::-1]] if i % 3 else [r[2]] for i, r in enumerate(rows)]
    (tmp_path / "pairs.json").write_text(
        json.dumps({"cands": cands, "refs": refs, "multi_refs": multi})
    )
    results = run_two_processes("_distributed_scoring.py", tmp_path, str(tmp_path / "pairs.json"))

    single = bsloss.BERTScorer(device="cpu", idf=True, rescale_with_baseline=True)
    expected = torch.stack(single.score(cands, refs, progress=False))
    expected_multi = torch.stack(bsloss.BERTScorer(encoder=single.encoder).score(cands, multi))
    expected_layers = torch.stack(bsloss.BERTScorer(all_layers=True).score(cands, refs))
    expected_plain = torch.stack(
        bsloss.BERTScorer(encoder=single.encoder).score(cands[:2], refs[:2], progress=False)
    )
    unique_texts = len(set(cands) | set(refs))
    for result in results:
        assert result["prf"].shape == (3, 120)
        assert (result["prf"] - expected).abs().max().item() < 1e-6
        assert (result["multi"] - expected_multi).abs().max().item() < 1e-6
        assert result["all_layers"].shape == (3, 7, 120)  # P/R/F x (embeddings + 6 layers) x N
        assert (result["all_layers"] - expected_layers).abs().max().item() < 1e-6
        # about half of the texts each (pairs are split, not texts: a few may repeat)
        assert 0.4 * unique_texts <= result["encoded"] <= 0.6 * unique_texts
        assert "process(es) [1] passed different cands/refs" in result["error"]
        # inputs invalid on process 1 only: it raised there and left process 0 waiting in the
        # inputs' check (paired with its next call, or a timeout: audit h12); now both raise
        # and the next call is in step
        torch.testing.assert_close(result["after"], expected_plain, rtol=0, atol=1e-6)
    assert "process(es) [1] passed invalid cands/refs" in results[0]["invalid"]
    assert "same length" in results[1]["invalid"]
    assert results[0]["encoded"] + results[1]["encoded"] >= unique_texts
