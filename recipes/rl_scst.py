"""Self-critical sequence training (Rennie et al., 2017) of a seq2seq model with the F_BERT reward.

    accelerate launch recipes/rl_scst.py --config recipes/configs/xsum-bert2bert.yaml \\
        --output_dir runs/xsum-scst --init_from runs/xsum-ce/model [--set rl.ce_weight=0.1]

For each source the model samples a sequence and decodes greedily; the reward is the hard
BERTScore F of each against the reference (:class:`bsloss.BERTScoreReward`), and the policy-gradient
loss is

.. math::  -(r(y^s) - r(\\hat y)) \\frac{1}{|y^s|} \\sum_t \\log p(y^s_t \\mid y^s_{<t}, x)

(the greedy reward is the baseline), plus ``rl.ce_weight`` times the teacher-forced CE. Shares
the config, data, evaluation, log and checkpoints of ``finetune.py``; the ``rl`` section
of the config (optional) sets ``ce_weight`` and ``sample_top_k``.
"""

from __future__ import annotations

import torch
from config import base_arguments
from run import RecipeRun, end_processes

from bsloss import BERTScoreReward
from bsloss.integrations.lm_head import IGNORE_INDEX, token_cross_entropy


def sequence_log_prob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean log-probability per token of ``labels`` (eos included, padding excluded) ``[B]``."""
    mask = labels != IGNORE_INDEX
    token_log_probs = -token_cross_entropy(labels, logits=logits, reduction="none")
    return token_log_probs.sum(1) / mask.sum(1).clamp_min(1)


def main(argv: list[str] | None = None) -> dict:
    args = base_arguments(__doc__.splitlines()[0]).parse_args(argv)
    run = RecipeRun(args, gradient_accumulation=False)
    run.log_setup()
    train_spec, rl_spec = run.train, run.config.rl
    reward = BERTScoreReward(scorer=run.scorer)
    trainable = [p for p in run.model.parameters() if p.requires_grad]  # train.freeze_embeddings
    optimizer = torch.optim.AdamW(trainable, lr=train_spec.learning_rate)
    model, optimizer, start_step = run.prepare(optimizer)

    accelerator, collator = run.accelerator, run.collator
    ce_weight, top_k = rl_spec.ce_weight, rl_spec.sample_top_k
    max_new = run.config.data.max_target_length
    batches = run.batches(start_step)
    stop = run.last_step(start_step)
    model.train()
    for step in range(start_step + 1, stop + 1):
        examples = next(batches)
        batch = run.collate(examples)
        references = [e.target for e in examples]
        with accelerator.autocast():
            sampled = collator.generate(run.unwrapped, batch, max_new, sample=True, top_k=top_k)
            greedy = collator.generate(run.unwrapped, batch, max_new)
            # one reward call: both outputs are scored in the same encoder batches
            rewards = torch.tensor(
                reward(
                    completions=collator.decode(sampled) + collator.decode(greedy),
                    reference=references * 2,
                )
            )
            sampled_reward, greedy_reward = rewards.chunk(2)
            advantage = (sampled_reward - greedy_reward).to(accelerator.device)
            label_sets = [sampled]
            if ce_weight > 0:
                label_sets.append(batch["labels"])
            logits = collator.teacher_forced_logits(model, batch, label_sets)
            loss = -(advantage * sequence_log_prob(logits[0], label_sets[0])).mean()
            parts = {}
            if ce_weight > 0:
                ce = token_cross_entropy(batch["labels"], logits=logits[1])
                loss = loss + ce_weight * ce
                parts["ce"] = ce.item()
        accelerator.backward(loss)
        if train_spec.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), train_spec.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        stop_early = run.end_of_step(
            step,
            loss=loss.item(),
            reward=float(sampled_reward.mean()),
            greedy_reward=float(greedy_reward.mean()),
            **parts,
        )
        if stop_early:
            break
    return run.finish(stop, f"SCST: {args.config.name}")


if __name__ == "__main__":
    main()
    end_processes()
