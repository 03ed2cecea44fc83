"""Self-critical sequence training (Rennie et al., 2017) of a seq2seq model with the F_BERT reward.

    accelerate launch recipes/rl_scst.py --config recipes/configs/xsum-bert2bert.yaml \\
        --output_dir runs/xsum-scst --init_from runs/xsum-ce/model [--set rl.ce_weight=0.1]

For each source the model samples a sequence and decodes greedily; the reward is the hard
BERTScore F of each against the reference (:class:`bsloss.BERTScoreReward`), and the policy-gradient
loss is

.. math::  -(r(y^s) - r(\\hat y)) \\frac{1}{|y^s|} \\sum_t \\log p(y^s_t \\mid y^s_{<t}, x)

(the greedy reward is the baseline), plus ``rl.ce_weight`` times the teacher-forced CE. Shares
the config, data, evaluation, log and checkpoints of ``finetune_seq2seq.py``; the ``rl`` section
of the config (optional) sets ``ce_weight`` and ``sample_top_k``.
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
    batch_indices,
    generated_labels,
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

from bsloss import BERTScorer, BERTScoreReward  # noqa: E402
from bsloss.scorer.encoder import ScorerEncoder  # noqa: E402


def sequence_log_prob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean log-probability per token of ``labels`` (eos included, padding excluded) ``[B]``."""
    mask = labels != -100
    token_log_probs = torch.log_softmax(logits.float(), dim=-1).gather(
        -1, labels.clamp_min(0)[..., None]
    )[..., 0]
    return (token_log_probs * mask).sum(1) / mask.sum(1).clamp_min(1)


@torch.no_grad()
def decode(model, batch, tokenizer, sample: bool, top_k: int, max_new_tokens: int):
    was_training = model.training
    model.eval()
    sequences = model.generate(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        do_sample=sample,
        top_k=top_k if sample else None,
        num_beams=1,
        max_new_tokens=max_new_tokens,
    )
    model.train(was_training)
    texts = [
        " ".join(t.split()) for t in tokenizer.batch_decode(sequences, skip_special_tokens=True)
    ]
    return sequences, texts


def main(argv: list[str] | None = None) -> dict:
    args = base_arguments(__doc__.splitlines()[0]).parse_args(argv)
    config = load_config(args.config, args.overrides)
    train_spec, rl_spec = config["train"], config.get("rl", {})
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision or train_spec.get("mixed_precision", "no"),
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
    scorer = BERTScorer(encoder=encoder, reference_cache_size=100_000)
    reward = BERTScoreReward(scorer=scorer)
    model, tokenizer = load_generator(config["model"], args.init_from, encoder)
    if train_spec.get("gradient_checkpointing", False):
        model.gradient_checkpointing_enable()
    collator = Collator(
        tokenizer, model, config["data"]["max_source_length"], config["data"]["max_target_length"]
    )
    evaluator = Evaluator(config["task"], scorer, config.get("eval", {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_spec["learning_rate"])
    model, optimizer = accelerator.prepare(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)

    start_step = resume(accelerator, output_dir, log) if args.resume else 0
    results_path = output_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if (
        start_step == 0
        and accelerator.is_main_process
        and config.get("eval", {}).get("before", True)
    ):
        before, _ = evaluator(unwrapped, tokenizer, collator, data["test"], accelerator.device)
        results["before"] = before
        results_path.write_text(json.dumps(results, indent=2))
        log.write(kind="eval", split="test", step=0, **before)

    steps, micro = train_spec["steps"], train_spec["batch_size"]
    world, rank = accelerator.num_processes, accelerator.process_index
    stream = batch_indices(len(data["train"]), micro * world, train_spec["seed"], start_step)
    ce_weight, top_k = rl_spec.get("ce_weight", 0.0), rl_spec.get("sample_top_k", 0)
    max_new = config["data"]["max_target_length"]
    eval_every, save_every = train_spec.get("eval_every", 0), train_spec.get("save_every", 0)
    stop = steps if args.stop_after is None else min(steps, start_step + args.stop_after)
    timer = Timer()
    model.train()
    for step in range(start_step + 1, stop + 1):
        indices = next(stream)[rank::world]
        examples = [data["train"][i] for i in indices]
        batch = {k: v.to(accelerator.device) for k, v in collator(examples).items()}
        references = [e.target for e in examples]
        with accelerator.autocast():
            sampled, sampled_texts = decode(unwrapped, batch, tokenizer, True, top_k, max_new)
            _, greedy_texts = decode(unwrapped, batch, tokenizer, False, top_k, max_new)
            sampled_reward = torch.tensor(reward(completions=sampled_texts, reference=references))
            greedy_reward = torch.tensor(reward(completions=greedy_texts, reference=references))
            advantage = (sampled_reward - greedy_reward).to(accelerator.device)
            label_sets = [generated_labels(sampled, collator.pad, collator.eos)]
            if ce_weight > 0:
                label_sets.append(batch["labels"])
            logits = teacher_forced_logits(model, batch, label_sets, collator)
            policy_loss = -(advantage * sequence_log_prob(logits[0], label_sets[0])).mean()
            loss = policy_loss
            ce = None
            if ce_weight > 0:
                ce = token_cross_entropy(logits[1], batch["labels"])
                loss = loss + ce_weight * ce
        accelerator.backward(loss)
        if train_spec.get("max_grad_norm"):
            accelerator.clip_grad_norm_(model.parameters(), train_spec["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"step {step}: the loss is {loss.item()}")
        entry = {
            "kind": "train",
            "step": step,
            "time": timer(),
            "loss": loss.item(),
            "reward": float(sampled_reward.mean()),
            "greedy_reward": float(greedy_reward.mean()),
        }
        if ce is not None:
            entry["ce"] = ce.item()
        log.write(**entry)
        if eval_every and step % eval_every == 0 and accelerator.is_main_process:
            metrics, _ = evaluator(
                unwrapped, tokenizer, collator, data["validation"], accelerator.device
            )
            log.write(kind="eval", split="validation", step=step, time=timer(), **metrics)
        if save_every and step % save_every == 0:
            save_checkpoint(accelerator, output_dir, step)
    accelerator.wait_for_everyone()
    if stop < steps:
        accelerator.print(f"stopped after step {stop} of {steps} (--stop_after)")
        return results
    if accelerator.is_main_process:
        unwrapped.save_pretrained(output_dir / "model")
        tokenizer.save_pretrained(output_dir / "model")
        after, _ = evaluator(unwrapped, tokenizer, collator, data["test"], accelerator.device)
        log.write(kind="eval", split="test", step=steps, **after)
        results.update(
            after=after,
            steps=steps,
            seed=train_spec["seed"],
            train_seconds=timer(),
            command=" ".join(sys.argv),
        )
        results_path.write_text(json.dumps(results, indent=2))
        plot = plot_curves(log, output_dir / "curves.png", f"SCST: {args.config.name}")
        if "before" in results:
            print(summary_table(results["before"], after))
        print(f"curves: {plot}")
    accelerator.wait_for_everyone()
    return results


if __name__ == "__main__":
    main()
