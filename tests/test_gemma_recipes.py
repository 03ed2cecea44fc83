"""The recipes on a real pretrained decoder-only generator: Gemma 3 270M (262,144-token
vocabulary, not the scorer's), installed and converted from its PyPI packages. Two optimisation
steps of the causal fine-tuning recipe with the BERTScore term through the vocabulary bridge, and
two GRPO steps with BERTScoreReward."""

from __future__ import annotations

import json
import math
import re

import pytest
from _models import tiny_gemma
from test_recipes import read_log, run_recipe

GEMMA_CONFIG = "recipes/configs/xsum-gemma.yaml"
TINY_GEMMA = [
    "--set", "data.max_train=4",
    "--set", "data.max_validation=2",
    "--set", "data.max_test=2",
    "--set", "data.max_source_length=48",
    "--set", "data.max_target_length=16",
    "--set", "eval.max_new_tokens=8",
    "--set", "train.batch_size=2",
    "--set", "train.steps=2",
    "--set", "train.lr_warmup_steps=0",
]  # fmt: skip


def test_causal_recipe_two_steps_with_bertscore_through_the_bridge(gemma_folder, tmp_path):
    out = tmp_path / "run"
    run_recipe(
        "finetune.py", "--config", GEMMA_CONFIG, "--output_dir", out, *TINY_GEMMA,
        "--set", "loss.weight=1.0", "--set", "loss.matching=softmax", timeout=900,
    )  # fmt: skip
    log = read_log(out)
    setup = next(e for e in log if e["kind"] == "setup")
    assert setup["generator"] == "Gemma3ForCausalLM"
    assert setup["bridge"] is not None  # Gemma's vocabulary is not the scorer's
    train = [e for e in log if e["kind"] == "train"]
    assert [e["step"] for e in train] == [1, 2]
    for entry in train:
        assert math.isfinite(entry["ce"]) and 0.0 <= entry["bertscore_loss"] <= 1.0
        assert entry["loss"] == pytest.approx(entry["ce"] + entry["bertscore_loss"], rel=1e-4)
    results = json.loads((out / "results.json").read_text())
    assert 0.0 < results["after"]["f_bert"] <= 1.0 and results["after"]["ce"] > 0
    assert len((out / "test_outputs.txt").read_text().splitlines()) == 2


def test_grpo_two_steps_on_gemma(gemma_folder, tmp_path):
    out = tmp_path / "grpo"
    run_recipe(
        "grpo.py", "--config", "recipes/configs/bible-es-en-gemma-stage2.yaml",
        "--output_dir", out, *TINY_GEMMA, "--set", "rl.num_generations=2",
        "--set", "train.eval_every=0", "--set", "train.save_every=0",
        "--set", "eval.before=true", "--set", "train.lora_rank=0", timeout=900,
    )  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert [c["step"] for c in results["reward_curve"]] == [1, 2]
    assert all(0.0 <= c["reward"] <= 1.0 for c in results["reward_curve"])
    for when in ("before", "after"):
        assert 0.0 < results[when]["f_bert"] <= 1.0
    assert (out / "reward.png").exists()


@pytest.fixture(scope="module")
def tiny_gemma_folder(gemma_tokenizer, tmp_path_factory):
    """A randomly initialised two-layer Gemma 3 with the real 262,144-token tokenizer: the causal
    layout and the bridge at full vocabulary, at a fraction of the real model's cost."""
    model = tiny_gemma(
        gemma_tokenizer, hidden_size=16, intermediate_size=32, num_hidden_layers=2, head_dim=8,
        max_position_embeddings=512, eos_token_id=gemma_tokenizer.eos_token_id,
        bos_token_id=gemma_tokenizer.bos_token_id,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-gemma")
    model.save_pretrained(folder)
    gemma_tokenizer.save_pretrained(folder)
    return folder


def test_rl_scst_two_steps_on_a_causal_lm(tiny_gemma_folder, tmp_path):
    out = tmp_path / "scst"
    run_recipe(
        "rl_scst.py", "--config", GEMMA_CONFIG, "--output_dir", out, *TINY_GEMMA,
        "--set", f"model.generator={tiny_gemma_folder}", "--set", "rl.ce_weight=0.1",
        timeout=600,
    )  # fmt: skip
    train = [e for e in read_log(out) if e["kind"] == "train"]
    assert [e["step"] for e in train] == [1, 2]
    for entry in train:
        assert 0.0 <= entry["reward"] <= 1.0 and 0.0 <= entry["greedy_reward"] <= 1.0
        assert math.isfinite(entry["loss"]) and entry["ce"] > 0
    assert len((out / "test_outputs.txt").read_text().splitlines()) == 2


def test_causal_own_outputs_with_generator_checkpointing(tiny_gemma_folder, tmp_path):
    # candidates decoded by the model itself (a second label set in the same forward pass) and
    # the generator's gradient checkpointing on: CE stays the reference labels' CE
    out = tmp_path / "greedy"
    run_recipe(
        "finetune.py", "--config", GEMMA_CONFIG, "--output_dir", out, *TINY_GEMMA,
        "--set", f"model.generator={tiny_gemma_folder}", "--set", "loss.weight=0.5",
        "--set", "loss.candidates=greedy", "--set", "train.gradient_checkpointing=true",
        "--set", "eval.before=false", timeout=600,
    )  # fmt: skip
    train = [e for e in read_log(out) if e["kind"] == "train"]
    assert [e["step"] for e in train] == [1, 2]
    for entry in train:
        assert 0.0 <= entry["bertscore_loss"] <= 1.0
        assert entry["loss"] == pytest.approx(entry["ce"] + 0.5 * entry["bertscore_loss"], rel=1e-4)


def test_lora_stage_one_then_stage_two_from_its_adapter(tiny_gemma_folder, tmp_path):
    """LoRA with the BERTScore term on the fused LM-head path through the bridge (the study's
    stages): stage 1 stops early and keeps its best step's adapter; stage 2 starts from exactly
    that adapter (its step-0 dev CE is stage 1's best) and trains only the adapter."""
    common = [
        *TINY_GEMMA, "--set", f"model.generator={tiny_gemma_folder}", "--set", "data.id=ref",
        "--set", "train.lora_rank=2", "--set", "loss.weight=0.5",
        "--set", "loss.matching=softmax", "--set", "eval.before=false",
        "--set", "train.early_stopping_metric=dev_ce", "--set", "train.eval_every=1",
    ]  # fmt: skip
    stage1 = tmp_path / "stage1"
    run_recipe(
        "finetune.py", "--config", "recipes/configs/bible-es-en-gemma.yaml", "--output_dir",
        stage1, *common, "--set", "train.steps=6", "--set", "train.learning_rate=0.3",
        "--set", "train.early_stopping_patience=1", timeout=600,
    )  # fmt: skip
    log = read_log(stage1)
    setup = next(e for e in log if e["kind"] == "setup")
    assert setup["generator"] == "PeftModelForCausalLM" and setup["bridge"] is not None
    assert 0 < setup["trainable_parameters"] < setup["parameters"] / 100
    train = [e for e in log if e["kind"] == "train"]
    assert all(0.0 <= e["bertscore_loss"] <= 1.0 and math.isfinite(e["ce"]) for e in train)
    results = json.loads((stage1 / "results.json").read_text())
    best = stage1 / "best"
    assert (best / "adapter_model.safetensors").exists() and not (
        best / "model.safetensors"
    ).exists()
    assert json.loads((best / "best.json").read_text())["step"] == results["best_step"]

    stage2 = tmp_path / "stage2"
    run_recipe(
        "finetune.py", "--config", "recipes/configs/bible-es-en-gemma.yaml", "--output_dir",
        stage2, *common, "--set", "train.steps=1", "--set", "train.learning_rate=1e-3",
        "--init_from", best, timeout=600,
    )  # fmt: skip
    start = next(e for e in read_log(stage2) if e["kind"] == "eval" and e["split"] == "validation")
    assert start["step"] == 0
    assert start["ce"] == pytest.approx(results["best_value"], abs=1e-4)
    assert (stage2 / "model/adapter_model.safetensors").exists()


def test_grpo_on_the_recipe_stack_resumes_and_refuses_bad_settings(tiny_gemma_folder, tmp_path):
    """grpo.py reads the recipes' YAML + --set, trains a LoRA adapter from --init_from with TRL's
    GRPOTrainer, logs each step's reward with its time and cpu, evaluates the dev split every
    eval_every steps (answers in dev_outputs/), and resumes from its checkpoint with the log and
    the cpu count going on; settings it cannot honour are refused by name."""
    config = "recipes/configs/bible-es-en-gemma-stage2.yaml"
    common = [
        *TINY_GEMMA, "--set", f"model.generator={tiny_gemma_folder}", "--set", "train.steps=3",
        "--set", "train.batch_size=4", "--set", "rl.num_generations=2",
        "--set", "train.lora_rank=2", "--set", "train.eval_every=1", "--set", "train.save_every=1",
        "--set", "eval.before=true",
    ]  # fmt: skip
    out = tmp_path / "grpo"
    run_recipe("grpo.py", "--config", config, "--output_dir", out, *common,
               "--stop_after", "2", timeout=900)  # fmt: skip
    assert not (out / "results.json").exists() or "after" not in json.loads(
        (out / "results.json").read_text()
    )
    first = [e for e in read_log(out) if e["kind"] == "train"]
    assert [e["step"] for e in first] == [1, 2]
    run_recipe("grpo.py", "--config", config, "--output_dir", out, *common, "--resume",
               timeout=900)  # fmt: skip
    log = read_log(out)
    setup = next(e for e in log if e["kind"] == "setup")
    assert setup["generator"] == "PeftModelForCausalLM"
    train = [e for e in log if e["kind"] == "train"]
    assert [e["step"] for e in train] == [1, 2, 3]
    assert all(0.0 <= e["reward"] <= 1.0 and e["completion_length"] > 0 for e in train)
    assert train[2]["cpu"] > train[1]["cpu"]  # counted on from the step-2 checkpoint
    dev = [e["step"] for e in log if e["kind"] == "eval" and e["split"] == "validation"]
    assert dev == [0, 1, 2, 3]
    assert len((out / "dev_outputs/step_3.txt").read_text().splitlines()) == 2
    results = json.loads((out / "results.json").read_text())
    assert [c["step"] for c in results["reward_curve"]] == [1, 2, 3]
    for when in ("before", "after"):
        assert 0.0 < results[when]["f_bert"] <= 1.0 and "bleu" in results[when]
    assert len((out / "test_outputs.txt").read_text().splitlines()) == 2
    assert (out / "reward.png").exists()

    # a run stopped after its last checkpoint but before the final evaluation (a session's end)
    # resumes into that evaluation with the checkpoint's weights, not one more optimizer step
    answers = (out / "test_outputs.txt").read_text()
    (out / "results.json").write_text(json.dumps({"before": results["before"]}))
    (out / "test_outputs.txt").unlink()
    lines = (out / "log.jsonl").read_text().splitlines()
    (out / "log.jsonl").write_text(
        "".join(line + "\n" for line in lines if json.loads(line).get("split") != "test"
                or json.loads(line)["step"] == 0)
    )  # fmt: skip
    run_recipe("grpo.py", "--config", config, "--output_dir", out, *common, "--resume",
               timeout=900)  # fmt: skip
    assert [e["step"] for e in read_log(out) if e["kind"] == "train"] == [1, 2, 3]
    again = json.loads((out / "results.json").read_text())
    assert again["after"]["f_bert"] == pytest.approx(results["after"]["f_bert"], abs=1e-6)
    assert (out / "test_outputs.txt").read_text() == answers

    for override, message in (
        ("train.batch_size=3", r"train.batch_size \(3\) must be a multiple of rl.num_generations"),
        (
            "loss.weight=1.0",
            "config loss.weight: finetune.py's setting, which grpo.py does not "
            r"use \(set it to 0.0 or remove it\), got 1.0",
        ),
    ):
        failed = run_recipe(
            "grpo.py", "--config", config, "--output_dir", tmp_path / "bad", *common,
            "--set", override, "--overwrite", expect_failure=True,
        )  # fmt: skip
        assert re.search(message, failed.stderr), failed.stderr[-2000:]
