"""Run under ``accelerate launch --multi_gpu --num_processes 2`` with the recipe's ``--cpu``:
two optimisation steps of the fine-tuning recipe with batch centering on, recording every
``batch_center`` call of the loss, then checking that each process subtracted the mean over
*both* processes' tokens; and recording the rows each process trains on at each step.

    accelerate launch --multi_gpu --num_processes 2 tests/_distributed_centering.py RESULT_DIR -- \\
        <finetune.py arguments> --cpu
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import bsloss.loss
from bsloss.functional.centering import batch_center

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))

import finetune  # noqa: E402

calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
trained_rows: list[list[int]] = []  # each training row's input ids (padding left out)


def recording_batch_center(embeddings, mask, distributed=None):
    out = batch_center(embeddings, mask, distributed)
    calls.append((embeddings.detach().double(), mask.clone(), out.detach().double()))
    return out


def recording_compute_loss(compute_loss):
    def compute(self, model, inputs, *args, **kwargs):
        if model.training:
            for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"], strict=True):
                trained_rows.append(ids[mask.bool()].tolist())
        return compute_loss(self, model, inputs, *args, **kwargs)

    return compute


def main() -> None:
    result_dir = Path(sys.argv[1])
    recipe_args = sys.argv[sys.argv.index("--") + 1 :]
    bsloss.loss.batch_center = recording_batch_center
    trainer = finetune.RecipeTrainer
    trainer.compute_loss = recording_compute_loss(trainer.compute_loss)
    finetune.main(recipe_args)
    rank, world = dist.get_rank(), dist.get_world_size()
    global_errors, local_gaps = [], []
    for embeddings, mask, out in calls:
        weights = mask.double()
        local_sum = torch.einsum("bld,bl->d", embeddings, weights)
        stats = torch.cat([local_sum, weights.sum().reshape(1)])
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        total = torch.stack(gathered).sum(0)
        global_mean = total[:-1] / total[-1]
        local_mean = local_sum / weights.sum()
        expected = (embeddings - global_mean) * weights[..., None]
        with_local = (embeddings - local_mean) * weights[..., None]
        global_errors.append(float((out - expected).abs().max()))
        local_gaps.append(float((out - with_local).abs().max()))
    every_row: list[list[list[int]]] = [None] * world
    dist.all_gather_object(every_row, trained_rows)
    result = {
        "rank": rank,
        "rows_trained": sum(len(rows) for rows in every_row),
        "distinct_rows_trained": len({tuple(row) for rows in every_row for row in rows}),
        "world_size": world,
        "calls": len(calls),
        "max_error_vs_global_mean": max(global_errors),
        "min_gap_to_local_mean": min(local_gaps),
    }
    (result_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
