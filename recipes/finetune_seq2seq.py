"""Fine-tune a seq2seq model (summarization or translation) against CE + lambda * (1 - F_BERT).

    accelerate launch recipes/finetune_seq2seq.py --config recipes/configs/xsum-bert2bert.yaml \\
        --output_dir runs/xsum [--set loss.weight=1.0 --set loss.matching=softmax] [--resume]

The task, data, generator, scorer, loss and schedule come from the YAML config (see
``recipes/configs/``); ``--set key=value`` overrides an entry. Candidate distributions are the
teacher-forced next-token distributions (``loss.candidates: teacher_forced``), or the model's own
greedy or sampled output re-scored under teacher forcing (``greedy`` / ``sample``). Writes
``log.jsonl``, ``curves.png``, ``checkpoints/step-N`` (for ``--resume``), ``model/`` and
``results.json`` (test metrics before and after) under ``--output_dir``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from common import (  # noqa: E402
    Collator,
    Evaluator,
    RunLog,
    Timer,
    base_arguments,
    generated_labels,
    linear_warmup,
    load_config,
    load_generator,
    load_splits,
    plot_curves,
    resume,
    save_checkpoint,
    summary_table,
    teacher_forced_logits,
    token_cross_entropy,
)
from common import batch_indices as batches  # noqa: E402

from bsloss import BERTScoreLoss, BERTScorer  # noqa: E402
from bsloss.scorer.encoder import ScorerEncoder  # noqa: E402


def build_loss(config: dict, encoder: ScorerEncoder, generator_tokenizer) -> BERTScoreLoss:
    spec = config["loss"]
    same_vocabulary = generator_tokenizer.get_vocab() == encoder.tokenizer.get_vocab()
    return BERTScoreLoss(
        encoder=encoder,
        matching=spec.get("matching", "hard"),
        temperature=spec.get("temperature", 0.05),
        sinkhorn_iterations=spec.get("sinkhorn_iterations", 1),
        center=spec.get("center", False),
        top_k=spec.get("top_k"),
        straight_through=spec.get("straight_through", False),
        generator_tokenizer=None if same_vocabulary else generator_tokenizer,
        gradient_checkpointing=config["train"].get("scorer_gradient_checkpointing", True),
    )


@torch.no_grad()
def own_output_labels(model, batch, collator: Collator, mode: str, max_new_tokens: int):
    """Labels-style ids of the model's own greedy or sampled output."""
    was_training = model.training
    model.eval()
    sequences = model.generate(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        do_sample=mode == "sample",
        top_k=0 if mode == "sample" else None,
        num_beams=1,
        max_new_tokens=max_new_tokens,
    )
    model.train(was_training)
    return generated_labels(sequences, collator.pad, collator.eos)


def main(argv: list[str] | None = None) -> dict:
    args = base_arguments(__doc__.splitlines()[0]).parse_args(argv)
    config = load_config(args.config, args.overrides)
    train_spec, loss_spec = config["train"], config["loss"]
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision or train_spec.get("mixed_precision", "no"),
        gradient_accumulation_steps=train_spec.get("gradient_accumulation_steps", 1),
        cpu=args.cpu,
    )
    set_seed(train_spec["seed"])
    output_dir = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    log = RunLog(output_dir / "log.jsonl", accelerator.is_main_process)

    data = load_splits(config["data"])
    scorer_spec = config.get("scorer", {})
    encoder = ScorerEncoder.from_pretrained(
        scorer_spec.get("model"), scorer_spec.get("num_layers"), accelerator.device
    )
    model, tokenizer = load_generator(config["model"], args.init_from, encoder)
    if train_spec.get("gradient_checkpointing", False):
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    collator = Collator(
        tokenizer, model, config["data"]["max_source_length"], config["data"]["max_target_length"]
    )
    loss_fn = build_loss(config, encoder, tokenizer)
    if not args.resume:
        log.write(
            kind="setup",
            step=0,
            generator=type(model).__name__,
            parameters=sum(p.numel() for p in model.parameters()),
            scorer=encoder.describe(),
            bridge=None if loss_fn.bridge is None else loss_fn.bridge.fidelity(),
            world_size=accelerator.num_processes,
        )
    evaluator = Evaluator(config["task"], BERTScorer(encoder=encoder), config.get("eval", {}))

    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=train_spec["learning_rate"],
        weight_decay=train_spec.get("weight_decay", 0.0),
    )
    steps = train_spec["steps"]
    warmup = train_spec.get("lr_warmup_steps", 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(warmup, 1)) if warmup else 1.0
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    start_step = resume(accelerator, output_dir, log) if args.resume else 0
    unwrapped = accelerator.unwrap_model(model)
    eval_examples = {s: data[s] for s in ("validation", "test")}
    results_path = output_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if (
        start_step == 0
        and accelerator.is_main_process
        and config.get("eval", {}).get("before", True)
    ):
        before, _ = evaluator(
            unwrapped, tokenizer, collator, eval_examples["test"], accelerator.device
        )
        results["before"] = before
        results_path.write_text(json.dumps(results, indent=2))
        log.write(kind="eval", split="test", step=0, **before)

    micro = train_spec["batch_size"]
    accumulation = accelerator.gradient_accumulation_steps
    world, rank = accelerator.num_processes, accelerator.process_index
    stream = batches(
        len(data["train"]), micro * world, train_spec["seed"], start_step * accumulation
    )
    mode = loss_spec.get("candidates", "teacher_forced")
    if mode not in ("teacher_forced", "greedy", "sample"):
        raise ValueError(f"loss.candidates must be teacher_forced, greedy or sample: {mode!r}")
    max_target_length = config["data"]["max_target_length"]
    eval_every, save_every = train_spec.get("eval_every", 0), train_spec.get("save_every", 0)
    stop = steps if args.stop_after is None else min(steps, start_step + args.stop_after)
    timer = Timer()
    model.train()
    from tqdm.auto import tqdm

    progress = tqdm(
        total=steps, initial=start_step, disable=not accelerator.is_main_process, desc="train"
    )
    for step in range(start_step + 1, stop + 1):
        weight = linear_warmup(loss_spec.get("weight", 0.0), loss_spec.get("warmup_steps", 0), step)
        totals = {"loss": 0.0, "ce": 0.0, "bertscore_loss": 0.0}
        for _ in range(accumulation):
            indices = next(stream)[rank::world]  # each process takes its share of the batch
            examples = [data["train"][i] for i in indices]
            batch = {k: v.to(accelerator.device) for k, v in collator(examples).items()}
            with accelerator.accumulate(model), accelerator.autocast():
                label_sets = [batch["labels"]]
                if weight > 0 and mode != "teacher_forced":
                    label_sets.append(
                        own_output_labels(unwrapped, batch, collator, mode, max_target_length)
                    )
                logits = teacher_forced_logits(model, batch, label_sets, collator)
                loss = token_cross_entropy(logits[0], batch["labels"])
                parts = {"ce": loss.detach()}
                if weight > 0:
                    bertscore_loss = loss_fn(
                        logits=logits[-1].float(),
                        candidate_mask=collator.content_mask(label_sets[-1]),
                        references=[e.target for e in examples],
                    )
                    loss = loss + weight * bertscore_loss
                    parts["bertscore_loss"] = bertscore_loss.detach()
                accelerator.backward(loss)
                if accelerator.sync_gradients and train_spec.get("max_grad_norm"):
                    accelerator.clip_grad_norm_(model.parameters(), train_spec["max_grad_norm"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            totals["loss"] += loss.item() / accumulation
            for key, value in parts.items():
                totals[key] += value.item() / accumulation
        if not math.isfinite(totals["loss"]):
            raise FloatingPointError(f"step {step}: the loss is {totals['loss']}")
        progress.update(1)
        progress.set_postfix(loss=f"{totals['loss']:.3f}")
        entry = {"kind": "train", "step": step, "weight": weight, "time": timer(), **totals}
        entry["lr"] = scheduler.get_last_lr()[0]
        if weight == 0:
            entry.pop("bertscore_loss")
        log.write(**entry)
        if eval_every and step % eval_every == 0 and accelerator.is_main_process:
            metrics, _ = evaluator(
                unwrapped, tokenizer, collator, eval_examples["validation"], accelerator.device
            )
            log.write(kind="eval", split="validation", step=step, time=timer(), **metrics)
        if save_every and step % save_every == 0:
            save_checkpoint(accelerator, output_dir, step)
    progress.close()
    accelerator.wait_for_everyone()
    if stop < steps:
        accelerator.print(f"stopped after step {stop} of {steps} (--stop_after)")
        return results
    if accelerator.is_main_process:
        unwrapped.save_pretrained(output_dir / "model")
        tokenizer.save_pretrained(output_dir / "model")
        after, hypotheses = evaluator(
            unwrapped, tokenizer, collator, eval_examples["test"], accelerator.device
        )
        log.write(kind="eval", split="test", step=steps, **after)
        results.update(
            after=after,
            steps=steps,
            seed=train_spec["seed"],
            train_seconds=timer(),
            truncated=collator.truncated,
            command=" ".join(sys.argv),
        )
        results_path.write_text(json.dumps(results, indent=2))
        (output_dir / "test_outputs.txt").write_text("\n".join(hypotheses) + "\n")
        plot = plot_curves(log, output_dir / "curves.png", f"{config['task']}: {args.config.name}")
        if "before" in results:
            print(summary_table(results["before"], after))
        print(f"curves: {plot}")
    accelerator.wait_for_everyone()
    return results


if __name__ == "__main__":
    main()
