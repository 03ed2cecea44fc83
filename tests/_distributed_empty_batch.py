"""Run by tests/test_functional.py as ``torchrun --nproc_per_node 2`` on the CPU (gloo):
``BERTScoreLoss(center=True)`` on two processes where process 1 has an empty batch in the first
call and both have a batch in the second. Every process must join the centering all-reduces of
every call, so the calls pair up; each writes its per-sample losses to ``RESULT_DIR/rank{r}.pt``.

    torchrun --nproc_per_node 2 tests/_distributed_empty_batch.py RESULT_DIR
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import bsloss

REFERENCES = ["the cat sat on the mat", "a dog ran in the park", "birds sing", "rain fell"]


def batch(rows: list[int], vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, vocab, generator=generator) * 3
    return logits[rows].clone().requires_grad_(True)


def main() -> None:
    result_dir = Path(sys.argv[1])
    # a short timeout: a process that skipped a collective fails the run instead of hanging it
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    loss = bsloss.BERTScoreLoss(center=True, reduction="none", device="cpu")
    vocab = loss.generator_vocab_size
    results = {}
    # call 1: process 0 scores rows 0-1, process 1 an empty batch
    rows = [0, 1] if rank == 0 else []
    logits = batch(rows, vocab)
    first = loss(logits=logits, references=[REFERENCES[i] for i in rows])
    first.sum().backward()
    results["first"] = first.detach()
    results["first_grad_finite"] = bool(torch.isfinite(logits.grad).all())
    # call 2: both score two rows (process 0: rows 0-1, process 1: rows 2-3)
    rows = [0, 1] if rank == 0 else [2, 3]
    logits = batch(rows, vocab)
    results["second"] = loss(logits=logits, references=[REFERENCES[i] for i in rows]).detach()
    dist.barrier()
    torch.save(results, result_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
