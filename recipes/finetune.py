"""Fine-tune a generator (summarization or translation) against CE + lambda * (1 - F_BERT).

    accelerate launch recipes/finetune.py --config recipes/configs/xsum-bert2bert.yaml \\
        --output_dir runs/xsum [--set loss.weight=1.0 --set loss.matching=softmax] [--resume]

The generator is an encoder-decoder (``xsum-bert2bert.yaml``) or a decoder-only LM prompted with
the source (``xsum-gemma.yaml``: Gemma 3 270M, see :mod:`causal`); CE and the BERTScore term are
over the target (completion) tokens only. The step's loss is the library's training term
(:class:`bsloss.integrations.huggingface.BERTScoreTerm`, the one a ``Trainer`` uses): CE and
the term from one chunked pass over the LM head, the term the token-weighted mean of each
target's ``1 - F``, its weight fixed or balanced (``loss.weighting``).

The task, data, generator, scorer, loss and schedule come from the YAML config (see
``recipes/configs/``); ``--set key=value`` overrides an entry. Candidate distributions are the
teacher-forced next-token distributions (``loss.candidates: teacher_forced``), or the model's own
greedy or sampled output re-scored under teacher forcing (``greedy`` / ``sample``). Writes
``log.jsonl``, ``curves.png``, ``checkpoints/checkpoint_N`` (for ``--resume``), ``model/``,
``test_outputs.txt`` and ``results.json`` (test metrics before and after; ``"complete": false``
until the run has finished) under ``--output_dir``.
"""

from __future__ import annotations

import torch
from config import (
    CANDIDATE_LABELS,
    CANDIDATE_MODES,
    RECIPE_LOSS_KEYS,
    TERM_WEIGHTS,
    RecipeConfig,
    TrainConfig,
    base_arguments,
    recipe_loss_settings,
)
from run import RecipeRun, check_fresh_output, linear_warmup

from bsloss import BERTScoreLoss
from bsloss.integrations.huggingface import BERTScoreTerm
from bsloss.integrations.lm_head import lm_head_inputs, token_cross_entropy
from bsloss.scorer.encoder import ScorerEncoder

__all__ = ["CANDIDATE_MODES", "build_loss", "build_optimizer", "main", "recipe_loss_settings"]


def build_loss(config: RecipeConfig, encoder: ScorerEncoder, generator_tokenizer) -> BERTScoreLoss:
    options = {k: v for k, v in config.loss.items() if k not in RECIPE_LOSS_KEYS}
    same_vocabulary = generator_tokenizer.get_vocab() == encoder.tokenizer.get_vocab()
    try:
        return BERTScoreLoss(
            encoder=encoder,
            generator_tokenizer=None if same_vocabulary else generator_tokenizer,
            gradient_checkpointing=config.train.scorer_gradient_checkpointing,
            **options,
        )
    except TypeError as error:
        raise TypeError(f"config section loss: {error}") from error


def build_optimizer(model, train: TrainConfig, num_processes: int = 1):
    """AdamW and the learning-rate schedule ``train.lr_scheduler_type`` of transformers
    (``get_scheduler``: linear, cosine, constant_with_warmup, ...) over ``train.steps`` optimizer
    steps, ``train.lr_warmup_steps`` of them warm-up. accelerate steps a prepared scheduler once
    per process at each optimizer step, so its step counts are scaled by ``num_processes``."""
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],  # train.freeze_embeddings
        lr=train.learning_rate,
        weight_decay=train.weight_decay,
    )
    # the name is one the recipes can run, checked at load (config.check_lr_scheduler_type)
    scheduler = get_scheduler(
        train.lr_scheduler_type,
        optimizer,
        num_warmup_steps=train.lr_warmup_steps * num_processes,
        num_training_steps=train.steps * num_processes,
    )
    return optimizer, scheduler


def main(argv: list[str] | None = None) -> dict:
    parser = base_arguments(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    try:  # before any model loads, one line as argparse prints (RecipeRun checks it again)
        check_fresh_output(args.output_dir, args.resume, args.overwrite)
    except FileExistsError as refused:
        parser.error(str(refused))
    run = RecipeRun(args)
    config, train_spec = run.config, run.train
    loss_spec = recipe_loss_settings(config.loss)
    mode = loss_spec["candidates"]
    with run.phase("building the loss (the vocabulary bridge when the vocabularies differ)"):
        loss_fn = build_loss(config, run.encoder, run.tokenizer)
    run.log_setup(bridge=None if loss_fn.bridge is None else loss_fn.bridge.fidelity())
    # the library's training term (its weight set each step: loss.warmup_steps); completion
    # logits come aligned with their labels from the collator, hence causal=False
    term = BERTScoreTerm(loss_fn, run.tokenizer, ce_weight=loss_spec["ce_weight"], causal=False)
    optimizer, scheduler = build_optimizer(run.model, train_spec, run.accelerator.num_processes)
    model, optimizer, scheduler, start_step = run.prepare(optimizer, scheduler)

    accelerator, collator = run.accelerator, run.collator
    accumulation = accelerator.gradient_accumulation_steps
    max_target_length = config.data.max_target_length
    batches = run.batches(start_step)
    stop = run.last_step(start_step)
    from tqdm.auto import tqdm

    progress = tqdm(
        total=train_spec.steps,
        initial=start_step,
        disable=None if accelerator.is_main_process else True,  # on a terminal only
        desc="train",
    )
    model.train()
    for step in range(start_step + 1, stop + 1):
        weight = linear_warmup(loss_spec["weight"], loss_spec["warmup_steps"], step)
        if weight > 0:
            term.weight = TERM_WEIGHTS[loss_spec["weighting"]](weight)
        totals = {"loss": 0.0, "ce": 0.0}
        if weight > 0:
            totals.update(bertscore_loss=0.0, term_weight=0.0)
        for _ in range(accumulation):
            examples = next(batches)
            batch = run.collate(examples)
            with accelerator.accumulate(model), accelerator.autocast():
                label_sets = [batch["labels"]]
                if weight > 0 and mode != "teacher_forced":
                    label_sets.append(
                        collator.generate(
                            run.unwrapped, batch, max_target_length, sample=mode == "sample"
                        )
                    )
                if weight > 0:
                    # The LM head's input and weight instead of [B, L, V] logits: the library's
                    # term takes the CE and the BERTScore term from one chunked pass over them.
                    with lm_head_inputs(run.unwrapped) as head:
                        hidden = collator.teacher_forced_logits(model, batch, label_sets)
                    own = {}
                    if len(label_sets) > 1:  # the model's own outputs are the candidates
                        own = {"candidate_outputs": {"logits": hidden[1]},
                               "candidate_labels": label_sets[1]}  # fmt: skip
                    references = [e.target for e in examples]
                    loss = term({"logits": hidden[0]}, batch["labels"], None, references,
                                training=True, head=head, **own)  # fmt: skip
                    logged = term.pop_metrics()
                    parts = {
                        "ce": logged["ce"],
                        "bertscore_loss": logged["bertscore_loss"],
                        "term_weight": logged.get("bertscore_weight", weight),
                    }
                else:
                    logits = collator.teacher_forced_logits(model, batch, label_sets)
                    loss = token_cross_entropy(batch["labels"], logits=logits[0])
                    parts = {"ce": loss.item()}
                accelerator.backward(loss)
                if accelerator.sync_gradients and train_spec.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), train_spec.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            totals["loss"] += loss.item() / accumulation
            for key, value in parts.items():
                totals[key] += value / accumulation
        progress.update(1)
        progress.set_postfix(loss=f"{totals['loss']:.3f}")
        if run.end_of_step(step, weight=weight, lr=scheduler.get_last_lr()[0], **totals):
            break  # early stopping
    progress.close()
    term_label = f"{loss_fn.matching.name} matching, {CANDIDATE_LABELS[mode]}"
    return run.finish(stop, f"{config.task}: {args.config.name}", term=term_label)


if __name__ == "__main__":
    main()
