"""Run by tests/test_distributed_scoring.py as ``torchrun --nproc_per_node 2`` on the CPU (gloo):
each process scores the same pairs with ``BERTScorer(distributed=True)``, counting the texts its
own encoder encodes, and writes its scores and count to ``RESULT_DIR/rank{r}.pt``.

    torchrun --nproc_per_node 2 tests/_distributed_scoring.py RESULT_DIR PAIRS.json
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import bsloss
from bsloss.scorer import reference_cache


def main() -> None:
    result_dir, pairs_file = Path(sys.argv[1]), Path(sys.argv[2])
    pairs = json.loads(pairs_file.read_text())
    # a short timeout: a process left waiting in a collective fails the run instead of hanging
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    scorer = bsloss.BERTScorer(
        device="cpu", idf=True, rescale_with_baseline=True, distributed=True, batch_size=16
    )
    encoded: list[int] = []
    embed = reference_cache.embed_token_ids

    def counting(encoder, token_ids, *args, **kwargs):
        encoded.append(len(token_ids))
        return embed(encoder, token_ids, *args, **kwargs)

    reference_cache.embed_token_ids = counting
    prf = scorer.score(pairs["cands"], pairs["refs"], progress=False)
    plain = bsloss.BERTScorer(encoder=scorer.encoder, distributed=True)
    reference_cache.embed_token_ids = embed
    # a multi-reference call too, and a mismatch that must raise on every process
    multi = plain.score(pairs["cands"], pairs["multi_refs"], progress=False)
    every_layer = bsloss.BERTScorer(all_layers=True, device="cpu", distributed=True)
    all_layers = every_layer.score(pairs["cands"], pairs["refs"], progress=False)
    error = ""
    try:
        plain.score(pairs["cands"][: 10 + rank], pairs["refs"][: 10 + rank])
    except ValueError as caught:
        error = str(caught)
    # inputs that fail validation on process 1 only (3 candidates, 2 references): every
    # process raises at once, and the next call finds them in step
    invalid = ""
    cands, refs = pairs["cands"][:2], pairs["refs"][:2]
    try:
        plain.score(cands + ["one more"] * rank, refs)
    except ValueError as caught:
        invalid = str(caught)
    after = plain.score(cands, refs, progress=False)
    torch.save(
        {
            "prf": torch.stack(prf),
            "multi": torch.stack(multi),
            "all_layers": torch.stack(all_layers),
            "encoded": sum(encoded),
            "error": error,
            "invalid": invalid,
            "after": torch.stack(after),
        },
        result_dir / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
