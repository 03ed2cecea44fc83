"""A recipe run inside a transformers ``Trainer`` (finetune.py's, TRL's ``GRPOTrainer`` in
grpo.py): the trainer's arguments from the config's ``train`` section, the callback that keeps the
run's log, dev evaluations and early stopping, ``--stop_after``, and resuming from the trainer's
own checkpoints (``checkpoints/checkpoint-N``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import torch
from config import base_arguments
from evaluation import TokenProgress
from examples import batch_indices
from run import RecipeRun, check_fresh_output, last_checkpoint
from transformers import PrinterCallback, ProgressCallback, TrainerCallback, TrainingArguments

RECIPE_STATE = "recipe_state.json"  # in each checkpoint: the log's time and cpu, early stopping
REFERENCE_COLUMN = "reference"  # the training examples' target text (the term's reference)


def _trainer_checkpointing_off(arguments_class) -> dict:
    """The trainer's own checkpointing switched off under the name its version reads:
    transformers 5.24 renamed ``gradient_checkpointing`` ``activation_checkpointing`` (the old
    name warns at every run, and is ignored once the new one is set: TRL's ``True`` default
    of it included); earlier versions know only the old name."""
    if "activation_checkpointing" in {field.name for field in fields(arguments_class)}:
        return {"activation_checkpointing": False}
    return {"gradient_checkpointing": False}


def trainer_arguments(run: RecipeRun, arguments_class, **extra):
    """``arguments_class`` (``TrainingArguments``, TRL's ``GRPOConfig``) from the config's
    ``train`` section: optimisation, schedule, precision, a checkpoint every ``save_every``
    steps under ``checkpoints/`` (the last ``checkpoints_total_limit`` kept), a log line every
    step; ``extra``: the trainer's own settings. (The generator's gradient checkpointing is
    :class:`run.RecipeRun`'s, switched on with the model when ``train.gradient_checkpointing``
    asks: the trainer's own switch stays off, which TRL's configs turn on by default.)"""
    train = run.train
    mixed = run.args.mixed_precision or train.mixed_precision
    return arguments_class(
        output_dir=str(run.output_dir / "checkpoints"),
        max_steps=train.steps,
        per_device_train_batch_size=train.batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        learning_rate=train.learning_rate,
        lr_scheduler_type=train.lr_scheduler_type,
        warmup_steps=train.lr_warmup_steps,
        weight_decay=train.weight_decay,
        optim="adamw_torch",
        max_grad_norm=train.max_grad_norm or 0.0,
        seed=train.seed,
        data_seed=train.seed,
        **_trainer_checkpointing_off(arguments_class),
        bf16=mixed == "bf16",
        fp16=mixed == "fp16",
        use_cpu=run.args.cpu or not torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="steps" if train.save_every else "no",
        save_steps=train.save_every or 1,
        save_total_limit=train.checkpoints_total_limit,
        report_to="none",
        # a bar on a terminal (as transformers shows it); a log file gets the run's lines only
        disable_tqdm=not sys.stderr.isatty(),
        # the recipe's Accelerator (RecipeRun) is the trainer's too: without this the arguments
        # would reset its state, and the recipe's evaluation would lose its device
        accelerator_config={"use_configured_state": True},
        **extra,
    )


def training_examples(run: RecipeRun) -> list[dict]:
    """The training examples in the order the recipes have always drawn them
    (:func:`examples.batch_indices`: a seeded permutation per epoch), one batch after another
    for every micro-batch of the run on every process; the trainer reads them in that order
    (under N processes, process p takes batches p, p + N, ...)."""
    train, examples = run.train, run.data["train"]
    batches = batch_indices(len(examples), train.batch_size, train.seed, 0)
    micro_batches = train.steps * train.gradient_accumulation_steps
    rows = []
    for _ in range(micro_batches * run.accelerator.num_processes):
        for index in next(batches):
            example = examples[index]
            rows.append({"source": example.source, "target": example.target,
                         REFERENCE_COLUMN: example.target})  # fmt: skip
    return rows


class RecipeCallback(TrainerCallback):
    """The recipe's side of the trainer's loop: each logged step into ``log.jsonl`` (the
    trainer's keys under the recipe's names, ``logged``), the dev evaluation every
    ``train.eval_every`` steps with early stopping (``best/``), the recipe's state saved with
    each checkpoint, and ``--stop_after``."""

    def __init__(self, run: RecipeRun, start_step: int, logged: dict[str, str], marker: str):
        self.run, self.start_step = run, start_step
        self.logged, self.marker = logged, marker  # marker: the key a training step's log has

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or self.marker not in logs:
            return
        run, step = self.run, state.global_step
        entry = {ours: logs[theirs] for theirs, ours in self.logged.items() if theirs in logs}
        run.record_step(step, **entry)
        if run.validation_turn(step):
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        recipe_state = {
            "time": self.run.timer(),
            "cpu": self.run.timer.cpu(),
            "early_stopping": self.run.early_stopping.state_dict(),
            "stopped_at": self.run.stopped_at,
        }
        (folder / RECIPE_STATE).write_text(json.dumps(recipe_state))

    def on_step_end(self, args, state, control, **kwargs):
        stop_after = self.run.args.stop_after
        if stop_after is not None and state.global_step - self.start_step >= stop_after:
            control.should_training_stop = True


def resume_point(run: RecipeRun) -> tuple[int, Path | None]:
    """(the step to start after, the checkpoint to resume from): ``--resume`` takes the newest
    trainer checkpoint, drops the log's lines written after it and restores the recipe's state
    (the time and CPU counted so far, early stopping)."""
    if not run.args.resume:
        return 0, None
    checkpoint = last_checkpoint(run.output_dir / "checkpoints")
    start = int(checkpoint.name.split("-")[1])
    run.log.truncate_after(start)
    recipe_state = json.loads((checkpoint / RECIPE_STATE).read_text())
    run.timer.continue_from(recipe_state["time"], recipe_state["cpu"])
    run.early_stopping.load_state_dict(recipe_state["early_stopping"])
    run.stopped_at = recipe_state["stopped_at"]
    return start, checkpoint


def train(trainer, run: RecipeRun, start: int, checkpoint: Path | None) -> int:
    """``trainer.train()`` (from ``checkpoint``); returns the last step trained. The recipe's
    own lines replace the trainer's printed log dictionaries."""
    trainer.remove_callback(PrinterCallback)
    if not trainer.args.disable_tqdm:  # the bar stays; its printed log lines go
        trainer.remove_callback(ProgressCallback)
        progress = _QuietProgress()
        trainer.add_callback(progress)
        source = getattr(trainer, "bertscore_candidates", None)
        if getattr(source, "generates", False):  # a step that answers says so on the bar
            streamer = StepProgress(progress, source.max_new_tokens)
            trainer.bertscore_candidates = replace(source, streamer=streamer)
    if checkpoint is not None and (start >= trainer.args.max_steps or run.stopped_at):
        # stopped after its last checkpoint, before the final evaluation: the Trainer, resumed
        # at max_steps, would still take one more optimizer step (it checks the step count
        # only after a step), so the checkpoint's weights go straight to the evaluation
        trainer._load_from_checkpoint(str(checkpoint))
        return start
    began, steps = time.perf_counter(), trainer.args.max_steps

    def status() -> str:  # read from the heartbeat's thread: the step the trainer is past
        return (
            f"training: step {trainer.state.global_step + 1}/{steps} under way, "
            f"{time.perf_counter() - began:.0f} s into this run's training"
        )

    with run.heartbeat(status):
        trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
    return trainer.state.global_step


def trainer_inputs(run: RecipeRun, data_collator: Callable) -> dict:
    """A transformers ``Trainer``'s model, arguments and data for ``run``: the training
    examples in the recipes' order (sequential sampling: :func:`training_examples` draws the
    order), every column kept for ``data_collator``."""
    arguments = trainer_arguments(
        run, TrainingArguments, train_sampling_strategy="sequential", remove_unused_columns=False
    )
    return {
        "model": run.model,
        "args": arguments,
        "train_dataset": training_examples(run),
        "data_collator": data_collator,
        "processing_class": run.tokenizer,
    }


def checked_arguments(parser, argv: list[str] | None = None):
    """The parsed arguments, with an ``--output_dir`` that holds a run (or, with ``--resume``,
    none) refused in one line as argparse prints, before any model loads (RecipeRun checks
    it again)."""
    args = parser.parse_args(argv)
    try:
        check_fresh_output(args.output_dir, args.resume, args.overwrite)
    except (FileExistsError, FileNotFoundError) as refused:
        parser.error(str(refused))
    return args


def train_from_command_line(
    script: str, description: str, build_trainer: Callable, argv: list[str] | None = None
) -> tuple[RecipeRun, object, int]:
    """A trainer recipe's run from its command line: the arguments (an ``--output_dir`` that
    holds a run refused in one line before any model loads), the run (its config checked
    against what ``script`` reads), its trainer
    (``build_trainer(run, start)``) resumed where ``--resume`` says, the scores before
    training, then the training. Returns (the run, the trainer, the last step trained)."""
    args = checked_arguments(base_arguments(description, script), argv)
    run = RecipeRun(args, script=script)  # the trainer accumulates the gradients
    start, checkpoint = resume_point(run)
    trainer = build_trainer(run, start)
    run.unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    run.begin(start)
    return run, trainer, train(trainer, run, start, checkpoint)


class StepProgress(TokenProgress):
    """Inside a training step that generates its answers, the training bar's postfix:
    ``answering, token 17/40`` as the answers decode, then ``forward and backward`` (a step
    takes tens of seconds on a CPU: the bar says what it is doing). The bar is the trainer's,
    made when training begins."""

    def __init__(self, progress: ProgressCallback, max_new_tokens: int | None = None):
        super().__init__(None, max_new_tokens, "answering, token", "forward and backward")
        self.progress = progress

    def current_bar(self):
        return self.progress.training_bar


class _QuietProgress(ProgressCallback):
    """transformers' bar without its printed log dictionaries (the recipe prints its own)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass
