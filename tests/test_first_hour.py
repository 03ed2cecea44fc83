"""What a new user hits first (issue 24): candidate ids as a tokenizer returns them, multi-process
scoring without a process group, the docs' torchrun script as written, and bert_score's helpers
that a migrating script imports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bsloss

REPO = Path(__file__).resolve().parents[1]
CANDS = ["the cat sat on the mat today", "a dog ran"]
REFS = ["a cat was sitting on the mat", "the dog runs in a park"]


@pytest.fixture(scope="module")
def hard_loss(scorer):
    return bsloss.BERTScoreLoss(encoder=scorer.encoder, matching="hard")


def test_candidate_ids_with_the_tokenizers_special_tokens(scorer, hard_loss):
    """ids from tokenizer(texts), [CLS]/[SEP]/[PAD] included, score as the metric does (they
    are skipped: the loss adds its own), with or without the attention mask."""
    tokenizer = scorer.encoder.tokenizer
    metric_f = scorer.score(CANDS, REFS)[2]
    with_special = tokenizer(CANDS, return_tensors="pt", padding=True)
    bare = tokenizer(CANDS, return_tensors="pt", padding=True, add_special_tokens=False)
    assert with_special["input_ids"][0, 0] == tokenizer.cls_token_id
    for batch in (with_special, bare):
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        torch.testing.assert_close(
            hard_loss.score(candidate_ids=ids, candidate_mask=mask, references=REFS).f1,
            metric_f,
            atol=1e-5,
            rtol=0,
        )
    unmasked = hard_loss.score(candidate_ids=with_special["input_ids"], references=REFS).f1
    torch.testing.assert_close(unmasked, metric_f, atol=1e-5, rtol=0)


def test_distributed_without_a_process_group_warns_once(scorer):
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    distributed = bsloss.BERTScorer(encoder=scorer.encoder, distributed=True)
    with pytest.warns(UserWarning, match=r"torchrun --nproc_per_node N.*init_process_group"):
        F = distributed.score(CANDS, REFS)[2]
    torch.testing.assert_close(F, scorer.score(CANDS, REFS)[2])  # scored locally
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distributed.score(CANDS, REFS)  # once per scorer
        bsloss.BERTScorer(encoder=scorer.encoder).score(CANDS, REFS)  # not asked for


def docs_block(path: str, marker: str) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / path).read_text(), re.M | re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_docs_torchrun_script_as_written(tmp_path, scorer):
    """docs/metric.md's multi-process script, run with the command its first line names."""
    script = docs_block("docs/metric.md", "torchrun --nproc_per_node")
    command = re.search(r"started as: (torchrun .*)", script).group(1).split()
    assert command[:3] == ["torchrun", "--nproc_per_node", "2"]
    (tmp_path / command[-1]).write_text(script)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *command[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(printed) == 1  # rank 0 only
    namespace: dict = {}
    exec(script.split("scorer = ")[0].replace('dist.init_process_group("gloo")', ""), namespace)
    expected = scorer.score(namespace["cands"], namespace["refs"])[2]
    torch.testing.assert_close(torch.tensor(eval(printed[0])), expected, atol=1e-6, rtol=0)
    assert "no torch.distributed process group" not in done.stderr
