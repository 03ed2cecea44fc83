"""Run by tests/test_lm_head_integration.py as ``torchrun --nproc_per_node 2`` on the CPU (gloo):
a tiny GPT-2 (tied and untied head) trained across the two processes with DDP or FSDP 2
(``fully_shard`` on each block, on an untied head as its own unit, then on the model), each
process scoring its half of a batch with ``BERTScoreTerm``, once through the fused LM-head path
(the forward inside ``lm_head_inputs``; under FSDP the chunked pass through ``LMHead.run``) and
once densely; each writes the reduced gradients of both (full tensors) to
``RESULT_DIR/rank{r}.pt``.

    torchrun --nproc_per_node 2 tests/_distributed_lm_head.py RESULT_DIR [ddp|fsdp]
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


def gradients(model, wrapped, term, inputs, labels, fused: bool) -> dict:
    model.zero_grad(set_to_none=True)
    if fused:
        with lm_head_inputs(model) as head:
            outputs = wrapped(**inputs)
    else:
        head, outputs = None, wrapped(**inputs)
    term(outputs, labels, head=head).backward()  # DDP / FSDP average over the processes
    return {
        # FSDP's gradients are shards (DTensors): gathered whole to compare
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def distributed_model(tokenizer, tied: bool, mode: str):
    """(the model, what runs its forward): DDP's wrapper, the model itself sharded, or (mode
    ``"none"``, one process) the model itself."""
    model = tiny_gpt2(tokenizer).eval()  # no dropout: the two passes must see one model
    if not tied:  # an untied head: a parameter the forward (with the head swapped) never uses
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    if mode == "none":
        return model, model
    if mode == "ddp":
        return model, DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    if not tied:  # its own unit: its weight is gathered only for the chunked pass
        fully_shard(model.lm_head)
    fully_shard(model)  # the tied matrix belongs to the root unit with the input embedding
    return model, model


def main() -> None:
    result_dir = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "ddp"
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    scorer = bsloss.BERTScorer(device="cpu")
    tokenizer = scorer_vocabulary_tokenizer(scorer)
    term = BERTScoreTerm(bsloss.BERTScoreLoss(encoder=scorer.encoder), tokenizer, weight=1.0)
    data = batch(tokenizer, [0, 1] if rank == 0 else [2, 3])
    labels = data.pop("labels")
    results = {}
    for tied in (True, False):
        for fused in (True, False):
            model, wrapped = distributed_model(tokenizer, tied, mode)  # the same start each time
            key = f"{'tied' if tied else 'untied'}-{'fused' if fused else 'dense'}"
            results[key] = gradients(model, wrapped, term, data, labels, fused)
    dist.barrier()
    torch.save(results, result_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
