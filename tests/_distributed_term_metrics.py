"""Run by tests/test_huggingface.py as ``torchrun --nproc_per_node 2`` on the CPU (gloo):
``BERTScoreTerm.pop_metrics(distributed=True)`` over two processes whose recorded values
differ (process 1 kept no row: no ``bertscore_f``); saves each process's means, and its local
ones, to ``RESULT_DIR/rank{r}.pt``.

    torchrun --nproc_per_node 2 tests/_distributed_term_metrics.py RESULT_DIR
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import bsloss
from bsloss.integrations.huggingface import BERTScoreTerm

# (value, weight) per key and process: shares of the accumulated batch's tokens, as recorded
RECORDED = [
    {"ce": [(2.0, 0.25), (3.0, 0.25)], "bertscore_loss": [(0.5, 0.25), (0.25, 0.25)],
     "bertscore_f": [(0.9, 2), (0.4, 1)]},
    {"ce": [(4.0, 0.5)], "bertscore_loss": [(0.75, 0.5)]},
]  # fmt: skip


def main() -> None:
    result_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    loss = bsloss.BERTScoreLoss(device="cpu")
    term = BERTScoreTerm(loss, loss.encoder.tokenizer, causal=True)
    results = {}
    for name, distributed in (("local", False), ("reduced", True)):
        for key, entries in RECORDED[rank].items():
            term._metrics["train"][key].extend((torch.tensor(v), w) for v, w in entries)
        results[name] = term.pop_metrics(training=True, distributed=distributed)
    torch.save(results, result_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
