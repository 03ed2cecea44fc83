"""The recipes' support for a two-stage study (issue 25): a dev split disjoint from test and
train, early stopping with patience that keeps the best model, a stage 2 started from it
(``--init_from``, refused when it is another model), and frozen embeddings for the budget."""

from __future__ import annotations

import csv
import json
import re
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from _models import scorer_vocabulary_tokenizer, tiny_gpt2
from config import DataConfig, ModelConfig, TrainConfig, load_config
from examples import SPLITS, check_dev_split, load_splits
from generators import check_init_from, freeze_embeddings, load_generator
from run import EarlyStopping
from test_recipe_pieces import recipe_optimizer
from test_recipes import TINY, TRANSLATION, read_log, run_recipe

from bsloss.integrations.lm_head import token_cross_entropy

REPO = Path(__file__).resolve().parents[1]
BIBLE = REPO / "recipes/data/bible-es-en-sample.tsv"


# --- the dev split ----------------------------------------------------------------------------


def _bible_rows() -> list[dict]:
    with open(BIBLE, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))


def _bible_sample(per_split: int) -> list[dict]:
    """The first ``per_split`` rows of each split of the vendored sample (train, dev, test)."""
    rows = _bible_rows()
    return [r for split in SPLITS for r in [r for r in rows if r["split"] == split][:per_split]]


def _write_tsv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, rows[0].keys(), delimiter="\t", quoting=csv.QUOTE_NONE)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _spec(path: Path, **caps) -> DataConfig:
    return DataConfig(path=str(path), source="spanish", target="english", id="ref", **caps)


def test_the_vendored_dev_split_is_disjoint_and_ids_are_read():
    splits = load_splits(_spec(BIBLE))
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [2000, 200, 200]
    assert splits["test"][0].id == next(r["ref"] for r in _bible_rows() if r["split"] == "test")
    check_dev_split(splits)  # no error


@pytest.mark.parametrize(
    ("other", "shared", "message"),
    [
        ("test", "ref", "shares 1 example.* with the test split"),
        ("test", "spanish", "shares 1 example.* with the test split"),
        ("train", "spanish", "shares 1 example.* with the train split"),
    ],
)
def test_a_dev_split_sharing_an_example_is_refused(tmp_path, other, shared, message):
    rows = _bible_sample(20)
    dev = next(r for r in rows if r["split"] == "validation")
    donor = next(r for r in rows if r["split"] == other)
    check_dev_split(load_splits(_spec(_write_tsv(tmp_path / "ok.tsv", rows))))
    dev[shared] = donor[shared]  # the same verse (ref) or the same source text
    splits = load_splits(_spec(_write_tsv(tmp_path / "bad.tsv", rows)))
    with pytest.raises(ValueError, match=f"data: the validation split .*{message}.*data.id"):
        check_dev_split(splits)
    # the recipe refuses it before loading any model, when it evaluates on the dev split
    from finetune import main

    argv = ["--config", str(TRANSLATION), "--output_dir", str(tmp_path / "run"),
            "--set", f"data.path={tmp_path / 'bad.tsv'}", "--set", "data.id=ref",
            "--set", "train.eval_every=1"]  # fmt: skip
    with pytest.raises(ValueError, match=message):
        main(argv)


def test_a_repeated_target_is_not_an_overlap(tmp_path):
    rows = _bible_sample(5)
    assert (rows[5]["split"], rows[-1]["split"]) == ("validation", "test")
    rows[5]["english"] = rows[-1]["english"]  # "And the LORD spake unto Moses, saying" repeats
    check_dev_split(load_splits(_spec(_write_tsv(tmp_path / "d.tsv", rows))))


def test_a_missing_data_file_is_refused_naming_the_setting_and_how_to_build_it(tmp_path):
    missing = tmp_path / "runs" / "data" / "xsum-study.jsonl"
    how = r"data\.path=.*xsum-study\.jsonl.*make_samples\.py"
    with pytest.raises(FileNotFoundError, match=how):
        load_splits(_spec(missing))
    # the recipe refuses it before loading any model
    from finetune import main

    argv = ["--config", str(TRANSLATION), "--output_dir", str(tmp_path / "run"),
            "--set", f"data.path={missing}"]  # fmt: skip
    with pytest.raises(FileNotFoundError, match="data.path="):
        main(argv)


# --- early stopping ---------------------------------------------------------------------------


def test_early_stopping_counts_evaluations_without_improvement():
    tracker = EarlyStopping("dev_ce", patience=2)
    seen = []
    for step, value in enumerate([5.0, 4.0, 4.5, 3.9, 3.9, 4.1], start=1):
        seen.append((tracker.update(value, step), tracker.exhausted))
    # improves at 1, 2, 4; 3 is one miss; 5 (equal: no gain) and 6 are two: stop at 6
    assert seen == [(True, False), (True, False), (False, False), (True, False),
                        (False, False), (False, True)]  # fmt: skip
    assert (tracker.best, tracker.best_step) == (3.9, 4)
    higher = EarlyStopping("dev_bertscore_f", patience=1)
    assert higher.update(0.5, 1) and higher.update(0.6, 2) and not higher.update(0.55, 3)
    assert higher.exhausted and higher.best_step == 2
    off = EarlyStopping("dev_ce", patience=0)
    for step in range(1, 6):
        off.update(float(step), step)
    assert not off.exhausted and off.since_best == 4
    restored = EarlyStopping("dev_ce", 2)
    restored.load_state_dict(tracker.state_dict())
    assert restored.state_dict() == tracker.state_dict()


def test_early_stopping_settings_are_checked():
    with pytest.raises(ValueError, match="early_stopping_metric must be one of"):
        load_config(TRANSLATION, ["train.early_stopping_metric=dev_bleu"])
    with pytest.raises(ValueError, match="early_stopping_patience needs train.eval_every"):
        load_config(TRANSLATION, ["train.early_stopping_patience=2", "train.eval_every=0"])
    with pytest.raises(ValueError, match="early_stopping_patience.*>= 0"):
        load_config(TRANSLATION, ["train.early_stopping_patience=-1", "train.eval_every=1"])
    config = load_config(TRANSLATION, ["train.early_stopping_patience=3", "train.eval_every=5"])
    assert config.train.early_stopping_metric == "dev_bertscore_f"  # the full evaluation


def test_early_stopping_keeps_the_best_model_and_stage_two_starts_from_it(tmp_path):
    """At a learning rate high enough for the dev CE to go up and down, the run stops after
    `patience` evaluations without a new best; best/ holds the best step's weights (its dev CE
    is the logged best), the test split is scored with them, and --init_from best starts a run
    that records its start."""
    stage1 = tmp_path / "stage1"
    settings = [
        *TINY, "--set", "train.steps=40", "--set", "train.eval_every=1",
        "--set", "train.learning_rate=0.01", "--set", "data.max_validation=4",
        "--set", "train.early_stopping_metric=dev_ce", "--set", "eval.before=false",
        "--set", "data.id=ref",
    ]  # fmt: skip
    run_recipe("finetune.py", "--config", TRANSLATION, "--output_dir", stage1, *settings,
               "--set", "train.early_stopping_patience=2")  # fmt: skip
    log = read_log(stage1)
    dev = [(e["step"], e["ce"]) for e in log if e["kind"] == "eval" and e["split"] == "validation"]
    assert dev[0][0] == 0  # the start, where the held-out curve begins: not a candidate for best/
    dev = dev[1:]
    assert [step for step, _ in dev] == list(range(1, len(dev) + 1))
    # replay the rule on the logged values: where must it stop, which step is the best?
    best, best_step, misses, stop = float("inf"), None, 0, None
    for step, value in dev:
        best, best_step, misses = (
            (value, step, 0) if value < best else (best, best_step, misses + 1)
        )
        if misses == 2:
            stop = step
            break
    assert stop is not None and stop < 40, dev  # it did stop early, at the last evaluation
    assert dev[-1][0] == stop
    assert all(e["step"] <= stop for e in log if e["kind"] == "train")
    results = json.loads((stage1 / "results.json").read_text())
    assert (results["stopped_at"], results["best_step"]) == (stop, best_step)
    assert results["early_stopping_patience"] == 2 and results["best_value"] == best
    assert json.loads((stage1 / "best/best.json").read_text()) == {
        "step": best_step,
        "dev_ce": best,
    }
    assert not (stage1 / "model").exists()  # best/ is the final model
    spec = load_config(TRANSLATION, [s for s in settings if s != "--set"])
    splits = load_splits(spec.data)
    assert _cross_entropy(stage1 / "best", spec, splits["validation"]) == pytest.approx(
        best, abs=1e-4
    )
    assert best < dev[-1][1] - 1e-3  # and not the last step's weights
    # the test split was scored with the best model: its CE is best/'s
    test_ce = results["after"]["ce"]
    assert _cross_entropy(stage1 / "best", spec, splits["test"]) == pytest.approx(test_ce, abs=1e-4)
    # and the log (the curves' test point) puts that score at the best step, not at the stop
    test = [e for e in read_log(stage1) if e["kind"] == "eval" and e["split"] == "test"]
    assert [e["step"] for e in test] == [best_step] and test[0]["ce"] == test_ce

    stage2 = tmp_path / "stage2"
    run_recipe("finetune.py", "--config", TRANSLATION, "--output_dir", stage2, *TINY,
               "--set", "train.eval_every=0", "--set", "eval.before=false",
               "--init_from", stage1 / "best")  # fmt: skip
    results = json.loads((stage2 / "results.json").read_text())
    assert results["init_from"] == str((stage1 / "best").resolve())
    assert "best_step" not in results and (stage2 / "model/config.json").exists()


def _cross_entropy(folder: Path, spec, examples) -> float:
    """The teacher-forced CE of a saved BERT2BERT on ``examples``, as the recipe evaluates it."""
    from evaluation import Evaluator
    from seq2seq import Collator
    from transformers import AutoTokenizer, EncoderDecoderModel

    model = EncoderDecoderModel.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    collator = Collator(tokenizer, model, spec.data.max_source_length, spec.data.max_target_length)
    return Evaluator(spec.task, None, spec.eval).cross_entropy(model, collator, examples, "cpu")


# --- a checkpoint that is not the configured model --------------------------------------------


def test_init_from_another_model_is_refused(tmp_path, scorer):
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    configured = tiny_gpt2(tokenizer)
    configured.save_pretrained(tmp_path / "configured")
    tokenizer.save_pretrained(tmp_path / "configured")
    model_spec = ModelConfig(generator=str(tmp_path / "configured"))
    # a fine-tuned copy of the configured model is accepted
    tuned = tiny_gpt2(tokenizer)
    with torch.no_grad():
        tuned.transformer.h[0].mlp.c_fc.weight.add_(1.0)
    tuned.save_pretrained(tmp_path / "tuned")
    tokenizer.save_pretrained(tmp_path / "tuned")
    loaded, _ = load_generator(model_spec, tmp_path / "tuned", scorer.encoder)
    torch.testing.assert_close(loaded.transformer.h[0].mlp.c_fc.weight,
                               tuned.transformer.h[0].mlp.c_fc.weight)  # fmt: skip
    # deeper, or over another vocabulary: refused, naming --init_from and model.generator
    deeper = GPT2LMHeadModel(GPT2Config(**{**configured.config.to_dict(), "n_layer": 2}))
    deeper.save_pretrained(tmp_path / "deeper")
    with pytest.raises(
        ValueError,
        match=r"--init_from .*deeper is not the configured model "
        r"\(model.generator .*configured.*\): num_hidden_layers 2 \(configured: 1\)",
    ):
        load_generator(model_spec, tmp_path / "deeper", scorer.encoder)  # fmt: skip
    smaller = GPT2LMHeadModel(GPT2Config(**{**configured.config.to_dict(), "vocab_size": 500}))
    smaller.save_pretrained(tmp_path / "smaller")
    with pytest.raises(ValueError, match=r"vocab_size 500 \(configured: 30522\)"):
        check_init_from(model_spec, tmp_path / "smaller")
    # another model type than the recipe's BERT2BERT
    with pytest.raises(ValueError, match=r"model.generator 'bert2bert-minilm'.*model_type 'gpt2'"):
        check_init_from(ModelConfig(generator="bert2bert-minilm"), tmp_path / "tuned")
    with pytest.raises(ValueError, match="--init_from .*nowhere: not a saved generator folder"):
        check_init_from(model_spec, tmp_path / "nowhere")


# --- frozen embeddings ------------------------------------------------------------------------


def _train_a_few_steps(model, trainable_check) -> dict[str, torch.Tensor]:
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    spec = TrainConfig(steps=3, batch_size=2, learning_rate=1e-2, freeze_embeddings=True)
    with tempfile.TemporaryDirectory() as folder:
        optimizer, _ = recipe_optimizer(model, spec, Path(folder))
    trainable_check(optimizer)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        logits = model(input_ids=ids).logits[:, :-1]
        token_cross_entropy(ids[:, 1:], logits=logits).backward()
        optimizer.step()
        optimizer.zero_grad()
    return before


@pytest.mark.parametrize("tied", [True, False])
def test_freeze_embeddings_freezes_the_tied_matrix(scorer, tied):
    tokenizer = scorer_vocabulary_tokenizer(scorer)
    model = tiny_gpt2(tokenizer)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert (embedding is head) == tied
    frozen = freeze_embeddings(model)
    assert frozen == embedding.numel() * (1 if tied else 2)
    assert not embedding.requires_grad and not head.requires_grad

    def not_in_the_optimizer(optimizer):
        kept = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert id(embedding) not in kept and id(head) not in kept
        assert len(kept) == sum(1 for p in model.parameters() if p.requires_grad) > 0

    before = _train_a_few_steps(model, not_in_the_optimizer)
    after = dict(model.named_parameters())
    for name, value in before.items():
        changed = not torch.equal(value, after[name].detach())
        frozen_name = name in ("transformer.wte.weight", "lm_head.weight")
        assert changed != frozen_name, name  # the frozen ones alone are unchanged


def test_freeze_embeddings_on_gemma3(gemma_folder):
    """Gemma 3's scaled input embedding and its LM head are one tied Parameter (the real
    262,144-token config, made narrow and one layer deep)."""
    from transformers import AutoConfig, Gemma3ForCausalLM

    config = AutoConfig.from_pretrained(gemma_folder)
    assert config.vocab_size == 262_144 and config.tie_word_embeddings
    config.update({"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                   "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 16,
                   "layer_types": ["full_attention"]})  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    assert model.get_output_embeddings().weight is model.model.embed_tokens.weight
    assert freeze_embeddings(model) == 262_144 * 16

    def not_in_the_optimizer(optimizer):
        kept = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert id(model.model.embed_tokens.weight) not in kept

    before = _train_a_few_steps(model, not_in_the_optimizer)
    assert torch.equal(before["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert not torch.equal(before["model.norm.weight"], model.model.norm.weight)


# --- the study's stage-1 config and driver ----------------------------------------------------


def test_the_stage1_config():
    config = load_config(REPO / "recipes/configs/bible-es-en-gemma-stage1.yaml", [])
    train = config.train
    assert config.loss["weight"] == 0.0  # CE only
    assert train.early_stopping_metric == "dev_ce" and train.early_stopping_patience >= 1
    assert train.lora_rank > 0 and train.save_every == train.eval_every > 0  # a committable start
    assert train.steps >= 10 * train.eval_every  # a cap, not the expected end
    stage2 = load_config(REPO / "recipes/configs/bible-es-en-gemma-stage2.yaml", []).train
    assert stage2.lora_rank == train.lora_rank  # stage 2 trains stage 1's adapter
    assert stage2.learning_rate == pytest.approx(train.learning_rate / 10)
    splits = load_splits(config.data)
    assert [len(splits[s]) for s in SPLITS] == [2000, 100, 200]
    check_dev_split(splits)


def test_the_stage1_driver_resumes_and_skips(tmp_path):
    """Two seeds (two workers, one core), interrupted after step 3 (checkpoint at 2), resumed
    (step 3 redone, logged once), then skipped once done."""
    import os
    import subprocess

    tiny = " ".join(TINY) + " --set train.steps=4 --set train.save_every=2 --set data.id=ref"
    tiny += " --set train.early_stopping_metric=dev_ce --set train.early_stopping_patience=5"
    harness = [sys.executable, str(REPO / "recipes/study/harness.py"), "run", "es-en", "--stage",
               "stage1", "--out", str(tmp_path), "--config", str(TRANSLATION), "--seeds", "0",
               "1", "--cores", "0", "0"]  # fmt: skip

    def driver(extra: str) -> str:
        done = subprocess.run(
            [*harness, f"--extra={extra}"], env={**os.environ, "HF_HUB_OFFLINE": "1"},
            capture_output=True, text=True, timeout=600, cwd=REPO,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    first = driver(tiny + " --stop_after 3")
    assert "stage1-seed0: core 0 (new)" in first and "stage1-seed1: core 0 (new)" in first
    for seed in (0, 1):
        out = tmp_path / f"stage1-seed{seed}"
        assert "stopped after step 3" in (out / "stdout.log").read_text()
        assert (out / "checkpoints").is_dir()
        assert not (out / "results.json").exists() or "after" not in json.loads(
            (out / "results.json").read_text()
        )  # seed 0 scored the test split before training: not done
    second = driver(tiny)
    assert "stage1-seed0: core 0 --resume" in second and "stage1-seed1: core 0 --resume" in second
    for seed in (0, 1):
        out = tmp_path / f"stage1-seed{seed}"
        results = json.loads((out / "results.json").read_text())
        assert ("before" in results) == (seed == 0) and results["seed"] == seed
        assert [e["step"] for e in read_log(out) if e["kind"] == "train"] == [1, 2, 3, 4]
        assert (out / "best/best.json").exists()
    third = driver(tiny)
    assert "stage1-seed0: done" in third and "stage1-seed1: done" in third
    assert "core" not in third


def test_early_stopping_without_an_evaluation_keeps_the_last_model(tmp_path):
    """train.steps before the first evaluation: no best/, so model/ is the final model. A stale
    best/ left in the folder is an old run's: refused, and removed with --overwrite (not
    loaded)."""
    out = tmp_path / "run"
    (out / "best").mkdir(parents=True)
    (out / "best/best.json").write_text(json.dumps({"step": 99, "dev_ce": 0.1}))
    settings = [
        "--config", TRANSLATION, "--output_dir", out, *TINY,
        "--set", "train.eval_every=5", "--set", "train.early_stopping_patience=1",
        "--set", "train.early_stopping_metric=dev_ce", "--set", "eval.before=false",
    ]  # fmt: skip
    refused = run_recipe("finetune.py", *settings, expect_failure=True)
    assert "already holds a run (best)" in refused.stderr
    run_recipe("finetune.py", *settings, "--overwrite")
    results = json.loads((out / "results.json").read_text())
    assert results["best_step"] is None and results["stopped_at"] is None
    assert (out / "model/config.json").exists() and not (out / "best").exists()


def test_stage2_arms_parse_and_build_their_loss(scorer):
    """Every arm of recipes/study/arms.yaml is a valid set of overrides of the stage-2 config:
    the config loads, the recipe's own loss keys check out, and BERTScoreLoss takes the rest."""
    from finetune import build_loss, recipe_loss_settings

    sys.path.insert(0, str(REPO / "recipes/study"))
    from arms import load_arms
    from arms import overrides as arm_overrides

    arms = load_arms(REPO / "recipes/study/arms.yaml")
    assert {"ce", "berttune", "balanced", "sampled", "grpo"} <= set(arms)
    assert arms["grpo"]["script"] == "recipes/grpo.py"
    base = REPO / "recipes/configs/bible-es-en-gemma-stage2.yaml"
    for name, overrides in arms.items():
        config = load_config(base, arm_overrides(overrides))
        spec = recipe_loss_settings(config.loss)
        assert spec["weight"] == overrides.get("loss.weight", 0.0), name
        # the loss the recipe builds from the rest (its generator: the scorer's vocabulary)
        build_loss(config, scorer.encoder, scorer.encoder.tokenizer)
    assert (
        recipe_loss_settings(
            load_config(base, [f"{k}={v}" for k, v in arms["balanced"].items()]).loss
        )["weighting"]
        == "balanced"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.weighting=emo"], "loss.weighting: expected one of"),
        (["loss.ce_weight=-1"], "loss.ce_weight: expected a finite number"),
        (["loss.weight=0", "loss.ce_weight=0"], "nothing to train"),
    ],
)
def test_recipe_loss_keys_refused_named(overrides, message):
    from finetune import recipe_loss_settings

    base = REPO / "recipes/configs/bible-es-en-gemma-stage2.yaml"
    with pytest.raises(ValueError, match=message):
        recipe_loss_settings(load_config(base, overrides).loss)


# --- LoRA: a converged start small enough to commit ------------------------------------------


def test_lora_adapter_saved_reloaded_and_continued(scorer, tmp_path):
    """train.lora_rank puts adapters on every linear layer but the LM head and freezes the rest;
    best/ (save_generator) holds the adapter and the base's config, not the base's weights;
    --init_from that folder rebuilds the configured model with the same adapter (equal logits)
    and trains on it; a rank that is not the saved one, or no LoRA, is refused by name."""
    from generators import load_saved_weights, save_generator, with_lora

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    base = tiny_gpt2(tokenizer)
    base.save_pretrained(tmp_path / "configured")
    tokenizer.save_pretrained(tmp_path / "configured")
    model_spec = ModelConfig(generator=str(tmp_path / "configured"))
    model = with_lora(base, 4, None, None)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert not any("lm_head" in name or "wte" in name for name in trainable)
    assert model.peft_config["default"].lora_alpha == 8  # 2 * rank
    with torch.no_grad():  # an adapter that changes the output (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(5, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model.eval()(input_ids=ids).logits  # eval: GPT-2's dropout off
    untrained = type(base).from_pretrained(tmp_path / "configured").eval()
    assert not torch.allclose(expected, untrained(input_ids=ids).logits, atol=1e-3)

    save_generator(model, tokenizer, tmp_path / "best")
    saved = {p.name for p in (tmp_path / "best").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json"} <= saved
    assert not saved & {"model.safetensors", "pytorch_model.bin"}  # no base weights
    check_init_from(model_spec, tmp_path / "best")  # the base's config: accepted

    loaded, _ = load_generator(model_spec, tmp_path / "best", scorer.encoder)
    loaded = with_lora(loaded, 4, None, tmp_path / "best").eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected)
    assert any(p.requires_grad for name, p in loaded.named_parameters() if "lora_B" in name)
    # best/ restored into a model that trained on past it
    with torch.no_grad():
        for name, p in loaded.named_parameters():
            if "lora_" in name:
                p.add_(1.0)
    assert not torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-3)
    load_saved_weights(loaded, tmp_path / "best")
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected)

    with pytest.raises(ValueError, match=r"train.lora_rank is 8 but --init_from .*best holds a "
                       r"rank-4 adapter"):  # fmt: skip
        with_lora(tiny_gpt2(tokenizer), 8, None, tmp_path / "best")
    with pytest.raises(ValueError, match=r"--init_from .*best holds a LoRA adapter; set "
                       r"train.lora_rank"):  # fmt: skip
        with_lora(tiny_gpt2(tokenizer), 0, None, tmp_path / "best")
    with pytest.raises(ValueError, match="config train: lora_rank must be >= 0"):
        TrainConfig(steps=1, batch_size=1, learning_rate=1e-3, lora_rank=-1)


def test_a_compact_adapter_answers_as_the_adapter_it_came_from(scorer, tmp_path):
    """compact_adapter writes a saved adapter in bfloat16 with its configs (half the bytes);
    --init_from it gives the float32 adapter's logits to bfloat16's precision, and answer.py
    answers a source of one's own with it, as with the original."""
    import io

    import answer
    from generators import compact_adapter, save_generator, with_lora

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    base = tiny_gpt2(tokenizer)
    base.save_pretrained(tmp_path / "configured")
    tokenizer.save_pretrained(tmp_path / "configured")
    model = with_lora(base, 4, None, None)
    with torch.no_grad():  # an adapter that changes the output (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    save_generator(model, tokenizer, tmp_path / "best")
    compact = compact_adapter(tmp_path / "best", tmp_path / "compact")
    assert sorted(p.name for p in compact.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "config.json",
    ]  # fmt: skip
    full = (tmp_path / "best/adapter_model.safetensors").stat().st_size
    assert (compact / "adapter_model.safetensors").stat().st_size < 0.6 * full

    model_spec = ModelConfig(generator=str(tmp_path / "configured"))
    ids = torch.randint(5, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name in ("best", "compact"):
        loaded, _ = load_generator(model_spec, tmp_path / name, scorer.encoder)
        loaded = with_lora(loaded, 4, None, tmp_path / name).eval()
        logits[name] = loaded(input_ids=ids).logits
    assert not torch.equal(logits["best"], logits["compact"])  # rounded to bfloat16 ...
    torch.testing.assert_close(logits["compact"], logits["best"], rtol=0.02, atol=0.02)  # only
    with pytest.raises(ValueError, match="holds no LoRA adapter"):
        compact_adapter(tmp_path / "configured", tmp_path / "nothing")

    generator = tmp_path / "configured"
    arguments = ["--config", str(TRANSLATION), "--set", f"model.generator={generator}",
                 "--set", "model.kind=causal", "--set", "train.lora_rank=4",
                 "--set", "eval.max_new_tokens=4", "--set", "data.max_source_length=24",
                 "--set", "data.max_target_length=12"]  # fmt: skip
    printed = io.StringIO()
    answers = answer.main(
        [*arguments, "--init_from", str(compact)], ["el gato", "la casa"], printed
    )
    assert len(answers) == 2 and printed.getvalue().splitlines() == answers
    assert answer.main([*arguments, "--init_from", str(tmp_path / "best")], ["el gato", "la casa"],
                       io.StringIO()) == answers  # fmt: skip


# --- the output folder and the results file ---------------------------------------------------


def test_a_used_output_folder_is_refused_in_one_line_before_anything_loads(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text("{}")
    done = run_recipe(
        "finetune.py", "--config", TRANSLATION, "--output_dir", out, *TINY, expect_failure=True
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    assert "finetune.py: error: --output_dir" in error
    assert "--overwrite" in error and "--resume" in error
    assert not (out / "log.jsonl").exists()  # refused before the run began


def test_results_say_whether_the_run_is_complete(tmp_path):
    """A run stopped after the start's test score leaves results.json with "complete": false;
    finishing it (--resume) makes it true."""
    out = tmp_path / "run"
    settings = [*TINY, "--set", "eval.before=true", "--set", "train.save_every=1"]
    run_recipe("finetune.py", "--config", TRANSLATION, "--output_dir", out, *settings,
               "--stop_after", "1")  # fmt: skip
    stopped = json.loads((out / "results.json").read_text())
    assert "before" in stopped and "after" not in stopped and stopped["complete"] is False
    run_recipe("finetune.py", "--config", TRANSLATION, "--output_dir", out, *settings, "--resume")
    finished = json.loads((out / "results.json").read_text())
    assert finished["complete"] is True and "after" in finished and "before" in finished


# --- what a run prints ------------------------------------------------------------------------


def test_a_run_into_a_log_file_has_no_bars_and_its_lines_give_the_memory(tmp_path):
    """stderr not a terminal (here a pipe, as a log file): no tqdm bar, not even the training
    bar's; the phase and step lines say the process's memory, now and its peak."""
    out = tmp_path / "run"
    done = run_recipe("finetune.py", "--config", TRANSLATION, "--output_dir", out, *TINY,
                      "--set", "eval.before=true")  # fmt: skip
    assert "\r" not in done.stderr and "it/s]" not in done.stderr, done.stderr[-2000:]
    ended = [line for line in done.stdout.splitlines() if ": done in " in line]
    assert len(ended) >= 4  # scorer, generator, loss, the evaluations
    assert all(re.search(r"\(memory \d+\.\d\d GiB, peak \d+\.\d\d GiB\)$", e) for e in ended)
    steps = [line for line in done.stdout.splitlines() if "] step " in line]
    assert steps and all("peak" in line for line in steps)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/proc/self/status").exists(),
    reason="glibc's malloc_trim and /proc",
)
def test_memory_a_phase_freed_is_handed_back():
    """Tensors under glibc's raised mmap threshold (a training step's activations) stay resident
    after they are freed until malloc_trim: the run's lines then show the memory a phase
    holds, not the one it had."""
    from run import release_freed_memory

    def resident_gib() -> float:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 2**20

    freed = torch.ones(6_000_000)  # glibc raises its mmap threshold to a freed chunk's size
    del freed
    tensors = []
    for i in range(100):  # 4 to 12 MB each, each followed by a small one that pins the heap
        tensors += [torch.ones(1_000_000 * (1 + i % 3)), torch.ones(16)]
    held = resident_gib()
    del tensors
    release_freed_memory()
    assert resident_gib() < held - 0.5
