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

from pathlib import Path

from config import base_arguments
from prompting import answer
from run import RecipeRun, end_processes
from trainer_run import (
    RecipeCallback,
    checked_arguments,
    resume_point,
    train,
    trainer_arguments,
)

from bsloss import BERTScoreReward
from bsloss.reward import completion_text

# TRL's log keys kept in log.jsonl, under the recipe's names
LOGGED = {"loss": "loss", "reward": "reward", "reward_std": "reward_std",
          "completions/mean_length": "completion_length", "learning_rate": "lr"}  # fmt: skip


class FirstLineReward:
    """The BERTScore reward of each completion's answer (its first line)."""

    def __init__(self, reward: BERTScoreReward):
        self.reward, self.__name__ = reward, reward.__name__

    def __call__(self, completions, **columns) -> list[float]:
        texts = [answer(completion_text(c, i)) for i, c in enumerate(completions)]
        return self.reward(completions=texts, **columns)


def grpo_settings(run: RecipeRun):
    """TRL's ``GRPOConfig``: the recipes' trainer arguments, and the ``rl`` section's."""
    from trl import GRPOConfig

    rl = run.config.rl  # checked for GRPO at load (config.check_grpo, check_script_settings)
    return trainer_arguments(
        run,
        GRPOConfig,
        num_generations=rl.num_generations,
        temperature=rl.temperature,
        beta=rl.beta,
        max_completion_length=run.config.data.max_target_length,
    )


def main(argv: list[str] | None = None) -> dict:
    import datasets
    from trl import GRPOTrainer

    args = checked_arguments(base_arguments(__doc__, "grpo.py"), argv)
    run = RecipeRun(args, script="grpo.py")
    if run.config.model.kind == "seq2seq" or getattr(run.model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"model.generator {run.config.model.generator!r} is an encoder-decoder; GRPO here "
            "is for decoder-only LMs"
        )
    settings = grpo_settings(run)
    run.log_setup(num_generations=run.config.rl.num_generations)
    run.unwrapped = run.model  # TRL prepares it; the recipe evaluates the same module
    start, checkpoint = resume_point(run)
    run.begin(start)
    train_rows = [
        {"prompt": run.collator.prompt(e.source), "reference": e.target} for e in run.data["train"]
    ]
    trainer = GRPOTrainer(
        model=run.model,
        reward_funcs=FirstLineReward(BERTScoreReward(scorer=run.scorer)),
        args=settings,
        train_dataset=datasets.Dataset.from_list(train_rows),
        processing_class=run.tokenizer,
        callbacks=[RecipeCallback(run, start, LOGGED, marker="reward")],
    )
    last_step = train(trainer, run, start, checkpoint)
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
    end_processes()
