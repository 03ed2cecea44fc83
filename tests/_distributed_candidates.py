"""Run by tests/test_candidates.py as ``torchrun --nproc_per_node 2`` on the CPU (gloo): the
model's own greedy answers as the BERTScore term's candidates while the model trains across two
processes, under DDP or FSDP 2 (``fully_shard`` on the block, then the model). Each process
answers its own half of a batch (the halves' references differ in length, so the processes
generate a different number of tokens), joins the answers to its rows and runs one forward
through the wrapped model, dense and fused; each writes its answers and the reduced gradients
(full tensors) to ``RESULT_DIR/rank{r}.pt``.

    torchrun --nproc_per_node 2 tests/_distributed_candidates.py RESULT_DIR [ddp|fsdp]
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _distributed_lm_head import batch, distributed_model  # noqa: E402
from _models import scorer_vocabulary_tokenizer  # noqa: E402

import bsloss  # noqa: E402
from bsloss.integrations.candidates import GreedyAnswers  # noqa: E402
from bsloss.integrations.huggingface import BERTScoreTerm  # noqa: E402
from bsloss.integrations.lm_head import lm_head_inputs  # noqa: E402

# rank 0 answers rows 0 and 3, rank 1 rows 1 and 2: their longest references (the answers'
# length limit) are 3 and 4 tokens with [SEP], so the processes' generation loops differ in length
ROWS = ([0, 3], [1, 2])


def answered_gradients(model, wrapped, term, tokenizer, rows: list[int], fused: bool) -> dict:
    """The model's greedy answers to ``rows``' prompts joined to the rows, one forward through
    ``wrapped``, the term (CE on the labels, BERTScore on the answers), backward: the answers'
    labels and the (reduced, when ``wrapped`` is distributed) gradients."""
    data = batch(tokenizer, rows)
    labels = data.pop("labels")
    model.zero_grad(set_to_none=True)
    joint = GreedyAnswers().answer(
        model, data, labels, causal=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.sep_token_id],
    )  # fmt: skip
    if fused:
        with lm_head_inputs(model) as head:
            outputs = wrapped(**joint.inputs)
    else:
        head, outputs = None, wrapped(**joint.inputs)
    own, answers = joint.split(outputs["logits"])
    term(
        {"logits": own}, labels, head=head,
        candidate_outputs={"logits": answers}, candidate_labels=joint.candidate_labels,
    ).backward()  # fmt: skip
    return {
        "answers": joint.candidate_labels,
        "grads": {  # FSDP's gradients are shards (DTensors): gathered whole to compare
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        },
    }


def main() -> None:
    result_dir = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "ddp"
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    scorer = bsloss.BERTScorer(device="cpu")
    tokenizer = scorer_vocabulary_tokenizer(scorer)
    term = BERTScoreTerm(bsloss.BERTScoreLoss(encoder=scorer.encoder), tokenizer, weight=1.0)
    results = {}
    for fused in (True, False):
        model, wrapped = distributed_model(tokenizer, tied=True, mode=mode)  # the same start
        results["fused" if fused else "dense"] = answered_gradients(
            model, wrapped, term, tokenizer, ROWS[rank], fused
        )
    dist.barrier()
    torch.save(results, result_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
