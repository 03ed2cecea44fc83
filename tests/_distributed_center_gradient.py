"""Run by tests/test_functional.py as ``torchrun --nproc_per_node 2`` on the CPU (gloo):
``BERTScoreLoss(center=True)`` over two processes that split four rows evenly, unevenly and
all-to-one (the other process an empty batch), each differentiating the sum of its own per-row
losses; saves each split's values and the gradient of its rows' logits to
``RESULT_DIR/rank{r}.pt``. The whole batch's objective is the sum over both processes, so each
row's gradient must equal one process's holding all four rows.

    torchrun --nproc_per_node 2 tests/_distributed_center_gradient.py RESULT_DIR
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _distributed_empty_batch import REFERENCES, batch  # noqa: E402

import bsloss  # noqa: E402

SPLITS = {"even": ([0, 1], [2, 3]), "uneven": ([0, 1, 2], [3]), "empty": ([0, 1, 2, 3], [])}


def main() -> None:
    result_dir = Path(sys.argv[1])
    # a short timeout: a process that skipped a collective (forward or backward) fails the run
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    loss = bsloss.BERTScoreLoss(center=True, reduction="none", device="cpu")
    vocab = loss.generator_vocab_size
    results = {}
    for name, split in SPLITS.items():
        rows = split[rank]
        logits = batch(rows, vocab)
        values = loss(logits=logits, references=[REFERENCES[i] for i in rows])
        values.sum().backward()
        results[name] = (rows, values.detach(), logits.grad.clone())
    dist.barrier()
    torch.save(results, result_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
