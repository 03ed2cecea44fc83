"""Run by tests/test_lm_head_integration.py as ``torchrun --nproc_per_node 2`` on the CPU (gloo):
a DDP-wrapped tiny GPT-2 (tied and untied head), each process scoring its half of a batch with
``BERTScoreTerm``, once through the fused LM-head path (the forward through DDP inside
``lm_head_inputs``) and once densely; each writes the all-reduced gradients of both to
``RESULT_DIR/rank{r}.pt``.

    torchrun --nproc_per_node 2 tests/_distributed_lm_head.py RESULT_DIR
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import scorer_vocabulary_tokenizer, tiny_gpt2  # noqa: E402

import bsloss  # noqa: E402
from bsloss.integrations.huggingface import BERTScoreTerm  # noqa: E402
from bsloss.integrations.lm_head import lm_head_inputs  # noqa: E402

PROMPTS = ["translate: el gato", "translate: la casa", "translate: el perro", "translate: sol"]
REFERENCES = ["the cat", "the big house", "the dog ran", "the sun"]


def batch(tokenizer, rows: list[int]) -> dict:
    ids, labels = [], []
    for i in rows:
        p = tokenizer(PROMPTS[i], add_special_tokens=False)["input_ids"]
        r = tokenizer(REFERENCES[i], add_special_tokens=False)["input_ids"]
        r = r + [tokenizer.sep_token_id]
        ids.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in ids]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]),
        "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels]),
    }


def gradients(model, ddp, term, inputs, labels, fused: bool) -> dict:
    model.zero_grad(set_to_none=True)
    if fused:
        with lm_head_inputs(model) as head:
            outputs = ddp(**inputs)
    else:
        head, outputs = None, ddp(**inputs)
    term(outputs, labels, head=head).backward()  # DDP averages the gradients over processes
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    result_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    scorer = bsloss.BERTScorer(device="cpu")
    tokenizer = scorer_vocabulary_tokenizer(scorer)
    term = BERTScoreTerm(bsloss.BERTScoreLoss(encoder=scorer.encoder), tokenizer, weight=1.0)
    data = batch(tokenizer, [0, 1] if rank == 0 else [2, 3])
    labels = data.pop("labels")
    results = {}
    for tied in (True, False):
        model = tiny_gpt2(tokenizer).eval()  # no dropout: the two passes must see one model
        if not tied:  # an untied head: a parameter the forward (with the head swapped) never uses
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        ddp = DistributedDataParallel(model)
        for fused in (True, False):
            key = f"{'tied' if tied else 'untied'}-{'fused' if fused else 'dense'}"
            results[key] = gradients(model, ddp, term, data, labels, fused)
    dist.barrier()
    torch.save(results, result_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
