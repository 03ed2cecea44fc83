"""The path users run is the path the study measured: a step of ``recipes/finetune.py`` (a
transformers ``Trainer`` with the library's ``BERTScoreTrainerMixin``) gives the loss and the
gradients of the study's own training step, for each arm of ``recipes/study/arms.yaml`` the
recipe runs (``ce``, ``balanced``, ``sampled``, ``berttune``), on a tiny causal generator.

The study's step (``study_step``) is the training loop of ``recipes/finetune.py`` as the efficacy
study ran it (commit f93f0e7 and before), kept here as the reference: the recipe's own layout
(left-padded prompts, explicit position ids, ``logits_to_keep``), its own generation of the
answers and its own teacher-forced pass over both label sets, then the library's term.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from _models import scorer_vocabulary_tokenizer, tiny_gpt2
from config import TERM_WEIGHTS, base_arguments, recipe_loss_settings
from examples import Example
from run import RecipeRun

from bsloss.integrations.huggingface import BERTScoreTerm
from bsloss.integrations.lm_head import lm_head_inputs, token_cross_entropy

REPO = Path(__file__).resolve().parents[1]
STAGE2 = REPO / "recipes/configs/bible-es-en-gemma-stage2.yaml"
ARMS = ("ce", "balanced", "sampled", "berttune")


def study_arms() -> dict[str, dict]:
    spec = importlib.util.spec_from_file_location("arms", REPO / "recipes/study/arms.py")
    arms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arms)
    loaded = arms.load_arms(REPO / "recipes/study/arms.yaml")
    return {name: arms.overrides(loaded[name]) for name in ARMS}


@pytest.fixture(scope="module")
def tiny_generator(scorer, tmp_path_factory) -> Path:
    """A one-layer GPT-2 over the scorer's vocabulary, saved as a generator folder."""
    folder = tmp_path_factory.mktemp("tiny-generator")
    tokenizer = scorer_vocabulary_tokenizer(scorer)
    tiny_gpt2(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def recipe_run(generator: Path, output_dir: Path, overrides: list[str]) -> RecipeRun:
    """The stage-2 config (the study's) with the tiny generator, a batch of 4, no evaluation."""
    settings = [
        "model.generator=" + str(generator), "model.kind=causal", "data.max_train=8",
        "data.max_validation=2", "data.max_test=2", "data.max_source_length=24",
        "data.max_target_length=10", "train.batch_size=4", "train.steps=2",
        "train.eval_every=0", "train.save_every=0", "eval.before=false", *overrides,
    ]  # fmt: skip
    words = ["--config", str(STAGE2), "--output_dir", str(output_dir), "--cpu"]
    for setting in settings:
        words += ["--set", setting]
    args = base_arguments("test").parse_args(words)
    run = RecipeRun(args)
    for module in run.model.modules():  # GPT-2's dropout (Gemma and the LoRA have none)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return run


def study_step(run: RecipeRun, loss_fn, examples) -> torch.Tensor:
    """One training step's loss as the study computed it (f93f0e7's recipes/finetune.py loop),
    its backward pass done."""
    config, collator, model = run.config, run.collator, run.model
    settings = recipe_loss_settings(config.loss)
    weight, mode = settings["weight"], settings["candidates"]
    term = BERTScoreTerm(loss_fn, run.tokenizer, ce_weight=settings["ce_weight"], causal=False)
    if weight > 0:
        term.weight = TERM_WEIGHTS[settings["weighting"]](weight)
    batch = collator(examples)
    label_sets = [batch["labels"]]
    if weight > 0 and mode != "teacher_forced":
        label_sets.append(
            collator.generate(model, batch, config.data.max_target_length, sample=mode == "sample")
        )
    if weight > 0:
        with lm_head_inputs(model) as head:
            hidden = collator.teacher_forced_logits(model, batch, label_sets)
        own = {}
        if len(label_sets) > 1:
            own = {"candidate_outputs": {"logits": hidden[1]}, "candidate_labels": label_sets[1]}
        references = [e.target for e in examples]
        loss = term({"logits": hidden[0]}, batch["labels"], None, references, training=True,
                    head=head, **own)  # fmt: skip
    else:
        logits = collator.teacher_forced_logits(model, batch, label_sets)
        loss = token_cross_entropy(batch["labels"], logits=logits[0])
    loss.backward()
    return loss.detach()


def recipe_batch(trainer) -> tuple[dict, torch.Tensor]:
    """The recipe trainer's first batch and its token count, as its loop draws them (the
    dataloader's iterator draws a seed from torch's generator: taken before the step's own
    draws are seeded)."""
    batches = iter(trainer.get_train_dataloader())
    (inputs,), num_items = trainer.get_batch_samples(batches, 1, trainer.args.device)
    return inputs, num_items


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.fixture
def noise_by_token(monkeypatch):
    """Gumbel noise as a function of the token alone: the study's step and the recipe's lay a
    batch out differently (the completions alone; prompt and completion), so the same draw
    lands on other positions (the noise is addressed by position in the batch). The arms use
    the one library function either way; with its position left out both paths see the same
    noise, and the rest of the Gumbel straight-through path is compared exactly."""
    from bsloss.functional import gumbel_noise as module

    drawn = module.gumbel_noise

    def by_token(seed, rows, tokens, dtype):
        return drawn(seed, torch.zeros_like(rows), tokens, dtype)

    monkeypatch.setattr(module, "gumbel_noise", by_token)


@pytest.mark.parametrize("arm", ARMS)
def test_a_recipe_step_is_the_study_step(arm, tiny_generator, tmp_path, noise_by_token):
    import finetune
    import trainer_run

    run = recipe_run(tiny_generator, tmp_path / arm, study_arms()[arm])
    trainer = finetune.build_trainer(run)
    assert isinstance(trainer, finetune.RecipeTrainer)
    batch_size = run.train.batch_size
    first = trainer_run.training_examples(run)[:batch_size]
    examples = [Example(row["source"], row["target"]) for row in first]
    torch.manual_seed(1234)  # the sampled answers: the same draws on both paths
    expected = study_step(run, trainer.bertscore_term.loss, examples)
    expected_grads = gradients(run.model)
    inputs, num_items = recipe_batch(trainer)
    torch.manual_seed(1234)
    trainer.model.train()
    measured = trainer.training_step(trainer.model, inputs, num_items).detach()
    measured_grads = gradients(run.model)

    assert torch.isfinite(expected) and expected > 0
    assert measured.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert expected_grads.keys() == measured_grads.keys() and len(expected_grads) > 0
    for name, grad in expected_grads.items():
        torch.testing.assert_close(measured_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    logged = trainer.bertscore_term.pop_metrics()
    if arm == "ce":  # the CE alone: nothing scored, no answers generated
        assert set(logged) == {"ce"}
    else:
        assert {"ce", "bertscore_f", "bertscore_loss"} <= set(logged)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"answer_rows": 2, "answer_every": 4}, {"rows": 2, "every": 4}),
        ({}, {"rows": None, "every": 1}),
    ],
)
def test_the_cheaper_answers_reach_the_mixin_from_the_config(keys, expected, tiny_generator,
                                                             tmp_path):  # fmt: skip
    """loss.answer_rows / loss.answer_every become the mixin's SampledAnswers(rows, every)."""
    import finetune

    overrides = study_arms()["sampled"] + [f"loss.{k}={v}" for k, v in keys.items()]
    trainer = finetune.build_trainer(recipe_run(tiny_generator, tmp_path / "run", overrides))
    source = trainer.bertscore_candidates
    assert type(source).__name__ == "SampledAnswers"
    assert (source.rows, source.every, source.max_new_tokens) == (
        expected["rows"], expected["every"], 10,
    )  # fmt: skip


def test_the_cheaper_answers_are_refused_where_nothing_answers(tiny_generator, tmp_path):
    from config import load_config

    for keys, message in (
        (["loss.answer_every=2"], "loss.candidates: sample or greedy"),
        (["loss.candidates=sample", "loss.answer_rows=0"], "loss.answer_rows must be >= 1"),
        (["loss.candidates=sample", "loss.answer_every=1.5"], "loss.answer_every"),
    ):
        with pytest.raises((ValueError, TypeError), match=message):
            recipe_loss_settings(load_config(STAGE2, keys).loss)


def scst_loop_step(run: RecipeRun, reward, examples, ce_weight: float, top_k: int) -> torch.Tensor:
    """One step of ``recipes/rl_scst.py``'s former own loop (before its trainer, a2cd957 and
    earlier): the recipe's layout, its own generation (sampled, then greedy) and one
    teacher-forced pass over the sampled answers and the references; the backward pass done."""
    from rl_scst import sequence_log_prob

    collator, model = run.collator, run.model
    batch = collator(examples)
    max_new = run.config.data.max_target_length
    sampled = collator.generate(model, batch, max_new, sample=True, top_k=top_k)
    greedy = collator.generate(model, batch, max_new)
    references = [e.target for e in examples]
    rewards = torch.tensor(
        reward(
            completions=collator.decode(sampled) + collator.decode(greedy),
            reference=references * 2,
        )
    )
    sampled_reward, greedy_reward = rewards.chunk(2)
    logits = collator.teacher_forced_logits(model, batch, [sampled, batch["labels"]])
    loss = -((sampled_reward - greedy_reward) * sequence_log_prob(logits[0], sampled)).mean()
    loss = loss + ce_weight * token_cross_entropy(batch["labels"], logits=logits[1])
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_scst_trainer_step_is_the_former_loop_step(top_k, tiny_generator, tmp_path):
    """rl_scst.py on a transformers Trainer (its answers from the library's SampledAnswers /
    GreedyAnswers, one forward pass for answers and references) gives its former loop's loss and
    gradients, with the CE beside the policy gradient and with top-k sampling."""
    import rl_scst
    import trainer_run

    overrides = ["rl.ce_weight=0.5", f"rl.sample_top_k={top_k}"]
    run = recipe_run(tiny_generator, tmp_path / "scst", overrides)
    with torch.no_grad():  # the random model's greedy answer would be its end token alone
        run.model.get_output_embeddings().weight[run.collator.eos] = 0.0
    trainer = rl_scst.build_trainer(run)
    first = trainer_run.training_examples(run)[: run.train.batch_size]
    examples = [Example(row["source"], row["target"]) for row in first]
    torch.manual_seed(1234)  # the sampled answers: the same draws on both paths
    expected = scst_loop_step(run, trainer.reward, examples, 0.5, top_k)
    expected_grads = gradients(run.model)
    inputs, num_items = recipe_batch(trainer)
    torch.manual_seed(1234)
    trainer.model.train()
    # set by trainer.train()'s loop: the SCST loss is divided by it (a mean per micro-batch)
    trainer.current_gradient_accumulation_steps = 1
    measured = trainer.training_step(trainer.model, inputs, num_items).detach()
    measured_grads = gradients(run.model)

    assert torch.isfinite(expected) and expected != 0
    assert measured.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert expected_grads.keys() == measured_grads.keys() and len(expected_grads) > 0
    for name, grad in expected_grads.items():
        torch.testing.assert_close(measured_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    logged = {key: values[0] for key, values in trainer._logged.items()}
    assert set(logged) == {"reward", "greedy_reward", "ce"}
    assert logged["greedy_reward"] > 0 and logged["reward"] != logged["greedy_reward"]
