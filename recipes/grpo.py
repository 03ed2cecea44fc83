"""GRPO (Shao et al., 2024) of a decoder-only LM with a BERTScore reward, through TRL's
``GRPOTrainer`` and :class:`bsloss.BERTScoreReward`.

    accelerate launch recipes/grpo.py --model gemma-3-270m --task summarization \\
        --output_dir runs/grpo-xsum --max_steps 30 --num_generations 4 \\
        --per_device_train_batch_size 4 --max_completion_length 32 --learning_rate 1e-6

Arguments are this script's (``ScriptArguments`` below) and those of ``trl.GRPOConfig``, as in
TRL's own scripts (``--config file.yaml`` works too). The model is a hub name, a folder, or an
offline short name of :mod:`bsloss.pretrained` (``gemma-3-270m``). The reward is the hard F_BERT
of each completion's answer (its first line, :func:`prompting.answer`) against the reference.
Before and after training, greedy answers to held-out prompts are scored with the training scorer,
an independent scorer (all-mpnet-base-v2, when installed) and ROUGE-L; ``results.json`` holds
them and the reward curve, ``reward.png`` plots it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from causal import CausalCollator
from config import DataConfig
from evaluation import generate_answers, rouge_scores
from examples import load_splits
from prompting import answer

from bsloss import BERTScorer, BERTScoreReward
from bsloss.pretrained import resolve_model
from bsloss.reward import completion_text

DATA = {
    "summarization": {
        "path": "recipes/data/xsum-sample.jsonl",
        "source": "document",
        "target": "summary",
    },
    "translation": {
        "path": "recipes/data/bible-es-en-sample.tsv",
        "source": "spanish",
        "target": "english",
    },
}


@dataclass
class ScriptArguments:
    model: str = field(
        default="gemma-3-270m", metadata={"help": "hub name, folder or offline name"}
    )
    task: str = field(default="summarization", metadata={"help": "summarization | translation"})
    prompt_format: str | None = field(default=None, metadata={"help": "with {source}"})
    chat_template: str = field(
        default="auto", metadata={"help": "auto (when the tokenizer has one) | true | false"}
    )
    max_source_tokens: int = field(default=128, metadata={"help": "article lead kept, in tokens"})
    max_train: int | None = None
    max_test: int = 30
    scorer: str | None = field(default=None, metadata={"help": "None: the embedded MiniLM"})
    independent_scorer: str | None = field(
        default="all-mpnet-base-v2", metadata={"help": "held-out only; 'none' to skip"}
    )


class FirstLineReward:
    """The BERTScore reward of each completion's answer (its first line)."""

    def __init__(self, reward: BERTScoreReward):
        self.reward, self.__name__ = reward, reward.__name__

    def __call__(self, completions, **columns) -> list[float]:
        texts = [answer(completion_text(c, i)) for i, c in enumerate(completions)]
        return self.reward(completions=texts, **columns)


def held_out_scores(model, collator, examples, scorers, max_new_tokens, batch_size=8) -> dict:
    """Greedy answers to the examples' prompts, scored against their targets."""
    answers = generate_answers(model, collator, examples, model.device, max_new_tokens, batch_size)
    references = [e.target for e in examples]
    scores = {name: float(s.score(answers, references)[2].mean()) for name, s in scorers.items()}
    rouge_l = rouge_scores(answers, references)["rougeL"]
    scores["rougeL"] = sum(rouge_l) / len(rouge_l)
    return {"scores": scores, "answers": answers}


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


def main(argv: list[str] | None = None) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer, TrlParser

    script, config = TrlParser((ScriptArguments, GRPOConfig)).parse_args_into_dataclasses(argv)
    if script.task not in DATA:
        raise ValueError(f"--task must be one of {sorted(DATA)}, got {script.task!r}")
    path = resolve_model(script.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"--model {script.model!r} is an encoder-decoder; GRPO here is for causal LMs"
        )
    splits = load_splits(
        DataConfig(**DATA[script.task], max_train=script.max_train, max_test=script.max_test)
    )

    # the recipes' decoder-only layout: the same prompts, left-padded generation, answers
    collator = CausalCollator(
        tokenizer, model, script.task, script.max_source_tokens,
        config.max_completion_length + 1, script.prompt_format,
        script.chat_template,
    )  # fmt: skip
    train = [{"prompt": collator.prompt(e.source), "reference": e.target} for e in splits["train"]]
    test = splits["test"]
    scorer = BERTScorer(script.scorer, device=model.device)
    scorers = {"f_bert": scorer}
    if script.independent_scorer and script.independent_scorer.lower() != "none":
        try:
            scorers["f_bert_independent"] = BERTScorer(
                script.independent_scorer, num_layers=12, device=model.device
            )
        except ImportError as error:  # its packages are optional; say so in the results
            print(f"independent scorer skipped: {error}")
    reward = FirstLineReward(BERTScoreReward(scorer=scorer))
    before = held_out_scores(model, collator, test, scorers, config.max_completion_length)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=datasets.Dataset.from_list(train),
        processing_class=tokenizer,
    )
    trainer.train()
    after = held_out_scores(trainer.model, collator, test, scorers, config.max_completion_length)
    curve = [
        {"step": e["step"], "reward": e["reward"], "reward_std": e.get("reward_std")}
        for e in trainer.state.log_history
        if "reward" in e
    ]
    results = {
        "model": script.model,
        "task": script.task,
        "before": before["scores"],
        "after": after["scores"],
        "reward_curve": curve,
        "steps": config.max_steps,
    }
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "test_outputs.jsonl").write_text(
        "".join(
            json.dumps({"reference": r, "before": b, "after": a}) + "\n"
            for r, b, a in zip(
                [e.target for e in test], before["answers"], after["answers"], strict=True
            )
        )
    )
    if curve:
        plot_reward_curve(curve, out / "reward.png", f"GRPO {script.task}, {script.model}")
    print(json.dumps({k: results[k] for k in ("before", "after")}, indent=2))
    return results


if __name__ == "__main__":
    main()
