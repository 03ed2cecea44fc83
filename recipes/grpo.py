"""GRPO (Shao et al., 2024) of a decoder-only LM with a BERTScore reward, through TRL's
``GRPOTrainer`` and :class:`bsloss.BERTScoreReward`.

    python recipes/grpo.py --config recipes/configs/bible-es-en-gemma-grpo.yaml \\
        --output_dir runs/grpo-bible [--set train.steps=60] [--init_from stage1/best] [--resume]

The config is every recipe's (:mod:`config`: YAML sections, ``--set section.key=value``), read the
way finetune.py reads it: ``data`` (examples, prompt, ``max_target_length`` = the completion
length), ``model`` (with ``train.lora_rank`` and ``--init_from``, :func:`generators.with_lora`),
``scorer`` (the reward's and the evaluation's), ``eval`` (the held-out generation). ``train``
gives TRL its optimisation: ``steps``, ``batch_size`` (completions per step: ``batch_size /
rl.num_generations`` prompts), the learning rate and schedule, ``max_grad_norm``, ``seed``, a
checkpoint every ``save_every`` steps (``--resume``) and the dev evaluation every ``eval_every``.
``rl`` holds GRPO's own: ``num_generations``, ``temperature``, ``beta``; everything else is TRL's
default (its loss ``dapo``, rewards scaled per group). The reward is the hard F_BERT of each
completion's answer (its first line, :func:`prompting.answer`) against the reference.

Shares finetune.py's run (:class:`run.RecipeRun`): the test split scored before and after training
by the same evaluator (F_BERT, BLEU / chrF or ROUGE, length, CE), ``log.jsonl`` (train lines carry
the mean ``reward``, ``time`` and ``cpu``), ``dev_outputs/``, ``test_outputs.txt``,
``results.json`` (with the reward curve), ``curves.png`` and ``reward.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from config import base_arguments
from prompting import answer
from run import RecipeRun
from transformers import TrainerCallback

from bsloss import BERTScoreReward
from bsloss.reward import completion_text

# TRL's log keys kept in log.jsonl, under the recipe's names
LOGGED = {"reward_std": "reward_std", "completions/mean_length": "completion_length",
          "learning_rate": "lr"}  # fmt: skip
TIMER_FILE = "recipe_timer.json"  # in each TRL checkpoint: the log's time and cpu so far


class FirstLineReward:
    """The BERTScore reward of each completion's answer (its first line)."""

    def __init__(self, reward: BERTScoreReward):
        self.reward, self.__name__ = reward, reward.__name__

    def __call__(self, completions, **columns) -> list[float]:
        texts = [answer(completion_text(c, i)) for i, c in enumerate(completions)]
        return self.reward(completions=texts, **columns)


class RecipeCallback(TrainerCallback):
    """The recipe's side of TRL's loop: each logged step into ``log.jsonl``, the dev evaluation
    every ``train.eval_every`` steps, the timer saved with each checkpoint, ``--stop_after``."""

    def __init__(self, run: RecipeRun, start_step: int):
        self.run, self.start_step = run, start_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        run, step = self.run, state.global_step
        entry = {"loss": logs.get("loss"), "reward": logs["reward"]}
        entry |= {ours: logs[theirs] for theirs, ours in LOGGED.items() if theirs in logs}
        run.log.write(kind="train", step=step, time=run.timer(), cpu=run.timer.cpu(), **entry)
        if run.train.eval_every and step % run.train.eval_every == 0:
            run.validate(step)

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        timer = {"time": self.run.timer(), "cpu": self.run.timer.cpu()}
        (folder / TIMER_FILE).write_text(json.dumps(timer))

    def on_step_end(self, args, state, control, **kwargs):
        stop_after = self.run.args.stop_after
        if stop_after is not None and state.global_step - self.start_step >= stop_after:
            control.should_training_stop = True


def grpo_settings(run: RecipeRun, checkpoints: Path):
    """TRL's ``GRPOConfig`` from the recipe config's ``train``, ``rl`` and ``data`` sections."""
    from trl import GRPOConfig

    train, rl = run.train, run.config.rl  # checked for GRPO at load (config.check_grpo)
    mixed = run.args.mixed_precision or train.mixed_precision
    return GRPOConfig(
        output_dir=str(checkpoints),
        max_steps=train.steps,
        per_device_train_batch_size=train.batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        learning_rate=train.learning_rate,
        lr_scheduler_type=train.lr_scheduler_type,
        warmup_steps=train.lr_warmup_steps,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm or 0.0,
        seed=train.seed,
        data_seed=train.seed,
        gradient_checkpointing=train.gradient_checkpointing,
        bf16=mixed == "bf16",
        fp16=mixed == "fp16",
        use_cpu=run.args.cpu or not torch.cuda.is_available(),
        num_generations=rl.num_generations,
        temperature=rl.temperature,
        beta=rl.beta,
        max_completion_length=run.config.data.max_target_length,
        logging_steps=1,
        save_strategy="steps" if train.save_every else "no",
        save_steps=train.save_every or 1,
        save_total_limit=train.checkpoints_total_limit,
        report_to="none",
        disable_tqdm=True,
        # the recipe's Accelerator (RecipeRun) is TRL's too: without this the arguments would
        # reset its state, and the recipe's evaluation would lose its device
        accelerator_config={"use_configured_state": True},
    )


def last_checkpoint(checkpoints: Path) -> Path:
    saved = sorted(checkpoints.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if not saved:
        raise FileNotFoundError(f"--resume: no checkpoint under {checkpoints}")
    return saved[-1]


def main(argv: list[str] | None = None) -> dict:
    import datasets
    from trl import GRPOTrainer

    args = base_arguments(__doc__.splitlines()[0]).parse_args(argv)
    run = RecipeRun(args, gradient_accumulation=False, grpo=True)
    if run.config.model.kind == "seq2seq" or getattr(run.model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"model.generator {run.config.model.generator!r} is an encoder-decoder; GRPO here "
            "is for decoder-only LMs"
        )
    checkpoints = run.output_dir / "checkpoints"
    settings = grpo_settings(run, checkpoints)
    run.log_setup(num_generations=run.config.rl.num_generations)
    run.unwrapped = run.model  # TRL prepares it; the recipe evaluates the same module
    start, resume_from = 0, None
    if args.resume:
        resume_from = last_checkpoint(checkpoints)
        start = int(resume_from.name.split("-")[1])
        run.log.truncate_after(start)
        timer = json.loads((resume_from / TIMER_FILE).read_text())
        run.timer.continue_from(timer["time"], timer["cpu"])
    run.begin(start)
    train = [
        {"prompt": run.collator.prompt(e.source), "reference": e.target} for e in run.data["train"]
    ]
    trainer = GRPOTrainer(
        model=run.model,
        reward_funcs=FirstLineReward(BERTScoreReward(scorer=run.scorer)),
        args=settings,
        train_dataset=datasets.Dataset.from_list(train),
        processing_class=run.tokenizer,
        callbacks=[RecipeCallback(run, start)],
    )
    if resume_from is not None and start >= settings.max_steps:
        # stopped after its last checkpoint, before the final evaluation: transformers' Trainer,
        # resumed at max_steps, would still take one more optimizer step (it checks the step
        # count only after a step), so the checkpoint's weights go straight to the evaluation
        trainer._load_from_checkpoint(str(resume_from))
        last_step = start
    else:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        last_step = trainer.state.global_step
    curve = [
        {"step": e["step"], "reward": e["reward"], "reward_std": e.get("reward_std")}
        for e in run.log.entries()
        if e.get("kind") == "train" and "reward" in e
    ]
    results = run.finish(last_step, f"GRPO: {args.config.name}", reward_curve=curve)
    if curve and "after" in results:
        plot_reward_curve(curve, run.output_dir / "reward.png", f"GRPO: {args.config.name}")
    return results


def plot_reward_curve(curve: list[dict], path: Path, title: str, window: int = 5) -> Path:
    """The mean reward of each step's completions, and its running mean over ``window`` steps
    (one step's few prompts make the raw curve noisy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps = np.array([c["step"] for c in curve])
    rewards = np.array([c["reward"] for c in curve])
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.plot(steps, rewards, lw=0.8, alpha=0.5, label="per step")
    if len(rewards) >= window:
        smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, lw=2, label=f"mean of {window} steps")
    ax.set(xlabel="step", ylabel="mean reward (F_BERT)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
