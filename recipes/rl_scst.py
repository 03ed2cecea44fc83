"""Self-critical sequence training (Rennie et al., 2017) of a generator with the F_BERT reward.

    accelerate launch recipes/rl_scst.py --config recipes/configs/xsum-bert2bert.yaml \\
        --output_dir runs/xsum-scst --init_from runs/xsum-ce/model [--set rl.ce_weight=0.1]

For each source the model samples an answer and decodes one greedily; the reward is the hard
BERTScore F of each against the reference (:class:`bsloss.BERTScoreReward`), and the
policy-gradient loss is

.. math::  -(r(y^s) - r(\\hat y)) \\frac{1}{|y^s|} \\sum_t \\log p(y^s_t \\mid y^s_{<t}, x)

(the greedy reward is the baseline), plus ``rl.ce_weight`` times the teacher-forced CE.

A transformers ``Trainer`` whose loss is that (:class:`SelfCriticalTrainer`): both answers come
from the library's :class:`~bsloss.integrations.candidates.SampledAnswers` /
:class:`~bsloss.integrations.candidates.GreedyAnswers` (the sampled ones join the batch as extra
rows, so one forward pass gives the CE's logits and the answers'), as the mixin's ``sampled``
candidates do; the trainer's optimiser, clipping, schedule and checkpoints, and the recipe's
log, dev evaluations and early stopping as in ``finetune.py`` (:mod:`trainer_run`). The
generator is an encoder-decoder or a decoder-only LM (:mod:`causal`); the ``rl`` section of the
config (optional) sets ``ce_weight`` and ``sample_top_k``.
"""

from __future__ import annotations

import torch
from run import RecipeRun, end_processes
from trainer_run import (
    REFERENCE_COLUMN,
    RecipeCallback,
    train_from_command_line,
    trainer_inputs,
)
from transformers import Trainer

from bsloss import BERTScoreReward
from bsloss.integrations.candidates import GreedyAnswers, SampledAnswers
from bsloss.integrations.lm_head import IGNORE_INDEX, token_cross_entropy

__all__ = ["SelfCriticalTrainer", "build_trainer", "main", "sequence_log_prob"]

# the trainer's log keys kept in log.jsonl, under the recipe's names
LOGGED = {"loss": "loss", "ce": "ce", "reward": "reward", "greedy_reward": "greedy_reward",
          "learning_rate": "lr"}  # fmt: skip
REFERENCES = "references"  # the batch's key of its reference texts (the reward's)


def sequence_log_prob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean log-probability per token of ``labels`` (eos included, padding excluded) ``[B]``."""
    mask = labels != IGNORE_INDEX
    token_log_probs = -token_cross_entropy(labels, logits=logits, reduction="none")
    return token_log_probs.sum(1) / mask.sum(1).clamp_min(1)


class SelfCriticalTrainer(Trainer):
    """A ``Trainer`` whose loss is self-critical policy gradient with ``reward``.

    Args:
        reward: scores a list of answers against their references (``completions=``,
            ``reference=``), one float each.
        sampled, greedy: the answers' sources (their ``max_new_tokens``, ``top_k``).
        decode: answer ids (labels-style, ``-100`` outside) to answer texts.
        pad_token_id, eos_token_id: the collator's padding and end-of-answer tokens.
        ce_weight: the teacher-forced CE's weight beside the policy gradient.
    """

    def __init__(
        self, *args, reward, sampled: SampledAnswers, greedy: GreedyAnswers, decode,
        pad_token_id: int, eos_token_id: int, ce_weight: float = 0.0, **kwargs,
    ):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.reward, self.sampled, self.greedy, self.decode = reward, sampled, greedy, decode
        self.special = {"pad_token_id": pad_token_id, "eos_token_ids": [eos_token_id]}
        self.ce_weight = ce_weight
        # the loss is a mean over its micro-batch's rows: the trainer divides it by the
        # accumulation steps (it does not when a model takes num_items_in_batch)
        self.model_accepts_loss_kwargs = False
        self._logged: dict[str, list[float]] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        references = inputs.pop(REFERENCES)
        labels = inputs.pop("labels")
        unwrapped = self.accelerator.unwrap_model(model)
        causal = not unwrapped.config.is_encoder_decoder
        prompts = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
        answering = dict(causal=causal, **self.special)
        greedy = self.greedy.answer(unwrapped, prompts, labels, **answering).candidate_labels
        joint = self.sampled.answer(unwrapped, prompts, labels, **answering)
        logits, answer_logits = joint.split(model(**joint.inputs).logits)
        sampled, reference_labels = joint.candidate_labels, labels
        if causal:  # position t predicts token t + 1
            logits, reference_labels = logits[:, :-1], labels[:, 1:]
            answer_logits, sampled = answer_logits[:, :-1], sampled[:, 1:]
        # one reward call: both answers are scored in the same encoder batches
        rewards = torch.tensor(
            self.reward(
                completions=self.decode(joint.candidate_labels) + self.decode(greedy),
                reference=list(references) * 2,
            ),
            device=logits.device,
        )
        sampled_reward, greedy_reward = rewards.chunk(2)
        advantage = sampled_reward - greedy_reward
        loss = -(advantage * sequence_log_prob(answer_logits, sampled)).mean()
        self._record(reward=sampled_reward.mean(), greedy_reward=greedy_reward.mean())
        if self.ce_weight > 0:
            ce = token_cross_entropy(reference_labels, logits=logits)
            loss = loss + self.ce_weight * ce
            self._record(ce=ce)
        return loss

    def _record(self, **values: torch.Tensor) -> None:
        for key, value in values.items():
            self._logged.setdefault(key, []).append(float(value.detach()))

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """The step's rewards (and CE) joined to the trainer's log line, means over its
        micro-batches."""
        logs.update({k: sum(v) / len(v) for k, v in self._logged.items()})
        self._logged = {}
        super().log(logs, *args, **kwargs)


def build_trainer(run: RecipeRun, start: int = 0) -> SelfCriticalTrainer:
    """The recipe's trainer: the config's ``rl`` section, the run's scorer as the reward, the
    training examples in the recipes' order, the callbacks that keep the run's log."""
    rl, collator = run.config.rl, run.collator
    run.log_setup()
    max_new = run.config.data.max_target_length
    run.model.config.use_cache = False  # a training forward keeps no cache (generation its own)

    def batch_with_references(rows: list[dict]) -> dict:
        return collator.training_batch(rows) | {REFERENCES: [row[REFERENCE_COLUMN] for row in rows]}

    return SelfCriticalTrainer(
        **trainer_inputs(run, batch_with_references),
        reward=BERTScoreReward(scorer=run.scorer),
        sampled=SampledAnswers(max_new_tokens=max_new, top_k=rl.sample_top_k),
        greedy=GreedyAnswers(max_new_tokens=max_new),
        decode=collator.decode,
        pad_token_id=collator.pad,
        eos_token_id=collator.eos,
        ce_weight=rl.ce_weight,
        callbacks=[RecipeCallback(run, start, LOGGED, marker="reward")],
    )


def main(argv: list[str] | None = None) -> dict:
    run, _, last_step = train_from_command_line("rl_scst.py", __doc__, build_trainer, argv)
    return run.finish(last_step, f"SCST: {run.args.config.name}")


if __name__ == "__main__":
    main()
    end_processes()
