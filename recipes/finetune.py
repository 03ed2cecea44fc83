"""Fine-tune a generator (summarization or translation) against CE + lambda * (1 - F_BERT).

    accelerate launch recipes/finetune.py --config recipes/configs/xsum-bert2bert.yaml \\
        --output_dir runs/xsum [--set loss.weight=1.0 --set loss.matching=softmax] [--resume]

A transformers ``Trainer`` with the library's :class:`~bsloss.integrations.huggingface.
BERTScoreTrainerMixin`, as a user would write it: the mixin's training step (CE and the term from
one chunked pass over the LM head; the model's own greedy or sampled answers as the candidates
with ``loss.candidates: greedy`` / ``sample``), the term's weight fixed or balanced
(``loss.weighting``, :mod:`bsloss.integrations.term_weights`), the trainer's optimiser,
schedule, clipping and checkpoints. Around it the recipe's run (:class:`run.RecipeRun`): the
config, data, scorer and generator, held-out generation and scoring before and after training,
dev evaluations with early stopping (:class:`trainer_run.RecipeCallback`).

The generator is an encoder-decoder (``xsum-bert2bert.yaml``) or a decoder-only LM prompted with
the source (``xsum-gemma.yaml``: Gemma 3 270M, see :mod:`causal`); CE and the term are over the
target (completion) tokens only. The task, data, generator, scorer, loss and schedule come from
the YAML config (``recipes/configs/``); ``--set key=value`` overrides an entry. Writes
``log.jsonl``, ``curves.png``, ``checkpoints/checkpoint-N`` (for ``--resume``), ``model/``,
``test_outputs.txt`` and ``results.json`` (test metrics before and after; ``"complete": false``
until the run has finished) under ``--output_dir``.
"""

from __future__ import annotations

from config import (
    CANDIDATE_LABELS,
    TERM_WEIGHTS,
    RecipeConfig,
    loss_options,
    recipe_loss_settings,
)
from run import RecipeRun, end_processes, linear_warmup
from trainer_run import (
    REFERENCE_COLUMN,
    RecipeCallback,
    train_from_command_line,
    trainer_inputs,
)
from transformers import Trainer, TrainerCallback

from bsloss import BERTScoreLoss
from bsloss.bridge import Bridge
from bsloss.integrations.candidates import GreedyAnswers, SampledAnswers, TeacherForced
from bsloss.integrations.huggingface import BERTScoreTrainerMixin
from bsloss.scorer.encoder import ScorerEncoder

__all__ = ["RecipeTrainer", "build_loss", "build_trainer", "main"]

# the trainer's log keys kept in log.jsonl, under the recipe's names
LOGGED = {"loss": "loss", "ce": "ce", "bertscore_loss": "bertscore_loss",
          "bertscore_f": "bertscore_f", "bertscore_weight": "term_weight",
          "learning_rate": "lr"}  # fmt: skip


class RecipeTrainer(BERTScoreTrainerMixin, Trainer):
    """A ``Trainer`` with the BERTScore term: all of it is the library's."""


def build_loss(config: RecipeConfig, encoder: ScorerEncoder, generator_tokenizer) -> BERTScoreLoss:
    """The config's ``loss`` section (its keys other than the recipe's own) as a
    :class:`~bsloss.BERTScoreLoss` over the run's scorer: ``matching`` with ``temperature`` and
    ``sinkhorn_iterations`` as the matching object, ``top_k`` / ``straight_through`` /
    ``gumbel_temperature`` as the candidate transforms, a vocabulary bridge (``bridge_mode``)
    when the generator's vocabulary is not the scorer's; any other key is the loss's keyword."""
    options = loss_options(config.loss)
    same_vocabulary = generator_tokenizer.get_vocab() == encoder.tokenizer.get_vocab()
    if same_vocabulary and options.bridge_mode is not None:
        raise ValueError(
            f"config loss.bridge_mode={options.bridge_mode!r}: the generator shares the scorer's "
            "vocabulary, so there is no bridge to set; remove it"
        )
    bridge = None if same_vocabulary else Bridge(generator_tokenizer, mode=options.bridge_mode)
    try:
        return BERTScoreLoss(
            encoder,
            matching=options.matching,
            bridge=bridge,
            candidate_transforms=options.transforms,
            gradient_checkpointing=config.train.scorer_gradient_checkpointing,
            **options.keywords,
        )
    except (TypeError, ValueError) as error:
        raise type(error)(f"config section loss: {error}") from error


def candidate_source(settings: dict, max_new_tokens: int):
    """``loss.candidates`` as the mixin's candidate source; answers are as long as the data's
    ``max_target_length`` allows a target to be, for ``loss.answer_rows`` rows of a batch on
    every ``loss.answer_every``-th step."""
    mode = settings["candidates"]
    if mode == "teacher_forced":
        return TeacherForced()
    answers = SampledAnswers if mode == "sample" else GreedyAnswers
    return answers(
        max_new_tokens=max_new_tokens,
        rows=settings["answer_rows"],
        every=settings["answer_every"],
    )


class TermWeightWarmup(TrainerCallback):
    """``loss.warmup_steps``: the term's weight grows linearly to ``loss.weight`` over them,
    set on the trainer's term before each step."""

    def __init__(self, trainer: RecipeTrainer, settings: dict):
        self.trainer, self.settings = trainer, settings

    def on_step_begin(self, args, state, control, **kwargs):
        settings = self.settings
        weight = linear_warmup(settings["weight"], settings["warmup_steps"], state.global_step + 1)
        self.trainer.bertscore_term.weight = TERM_WEIGHTS[settings["weighting"]](weight)


def build_trainer(run: RecipeRun, start: int = 0) -> RecipeTrainer:
    """The recipe's trainer: the config's loss as the mixin's term, the run's collator, the
    training examples in the recipes' order, the callbacks that keep the run's log."""
    config = run.config
    settings = recipe_loss_settings(config.loss)
    with run.phase("building the loss (the vocabulary bridge when the vocabularies differ)"):
        loss_fn = build_loss(config, run.encoder, run.tokenizer)
    run.log_setup(bridge=None if loss_fn.bridge is None else loss_fn.bridge.fidelity())
    # the model's answers end where the collator ends a target; a training forward keeps no
    # cache (generation sets its own)
    run.model.generation_config.eos_token_id = run.collator.eos
    run.model.config.use_cache = False
    trainer = RecipeTrainer(
        **trainer_inputs(run, run.collator.training_batch),
        bertscore_loss=loss_fn,
        bertscore_weight=TERM_WEIGHTS[settings["weighting"]](settings["weight"]),
        bertscore_ce_weight=settings["ce_weight"],
        bertscore_candidates=candidate_source(settings, config.data.max_target_length),
        bertscore_reference_column=REFERENCE_COLUMN,
        callbacks=[RecipeCallback(run, start, LOGGED, marker="loss")],
    )
    if settings["warmup_steps"]:
        trainer.add_callback(TermWeightWarmup(trainer, settings))
    return trainer


def main(argv: list[str] | None = None) -> dict:
    run, trainer, last_step = train_from_command_line("finetune.py", __doc__, build_trainer, argv)
    settings = recipe_loss_settings(run.config.loss)
    term = f"{trainer.bertscore_term.loss.matching.name} matching, "
    term += CANDIDATE_LABELS[settings["candidates"]]
    return run.finish(last_step, f"{run.config.task}: {run.args.config.name}", term=term)


if __name__ == "__main__":
    main()
    end_processes()
