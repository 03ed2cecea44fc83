"""Run by tests/test_functional.py as ``torchrun --nproc_per_node 2`` on the CPU (gloo):
``BERTScoreLoss(center=True)`` compiled (``loss.compile()``), whose matching step holds the
centering all-reduce. Each process scores two rows eagerly, then compiled, then compiled again
with the other process's rows (new reference texts, the same graphs), and writes the values and
the logits' gradients to ``RESULT_DIR/rank{r}.pt``.

    torchrun --nproc_per_node 2 tests/_distributed_compiled_centering.py RESULT_DIR
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import bsloss

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _distributed_empty_batch import REFERENCES, batch  # noqa: E402


def main() -> None:
    result_dir = Path(sys.argv[1])
    # compiling takes ~30 s on two busy cores; a process that skipped a collective still fails
    dist.init_process_group("gloo", timeout=timedelta(seconds=240))
    rank = dist.get_rank()
    loss = bsloss.BERTScoreLoss(center=True, reduction="none", device="cpu")
    vocab = loss.generator_vocab_size
    own, other = ([0, 1], [2, 3]) if rank == 0 else ([2, 3], [0, 1])
    results = {}
    for name, rows in (("eager", own), ("compiled", own), ("compiled, other rows", other)):
        if name == "compiled":
            loss.compile(dynamic=False)
        logits = batch(rows, vocab)
        value = loss(logits=logits, references=[REFERENCES[i] for i in rows])
        value.sum().backward()
        results[name] = (value.detach(), logits.grad)
    dist.barrier()
    torch.save(results, result_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
