"""The recipes' library pieces: config sections as dataclasses (unknown keys named, defaults in
one place, ``--set`` overrides), transformers' learning-rate schedules, and transformers' seq2seq
collator giving the decoder inputs the recipes used to build by hand."""

from __future__ import annotations

import importlib
import io
import json
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from config import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    RecipeConfig,
    TrainConfig,
    load_config,
    section,
)
from examples import Example, check_dev_split, load_splits
from finetune import recipe_loss_settings
from generators import load_generator
from seq2seq import Collator

from bsloss.integrations.lm_head import token_cross_entropy

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "recipes/configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_loads_into_the_dataclasses(path):
    script = "grpo.py" if path.stem.endswith("-grpo") else "finetune.py"
    config = load_config(path, [], script=script)
    assert isinstance(config, RecipeConfig) and isinstance(config.train, TrainConfig)
    # GRPO's config keeps its committed run's linear decay (TRL's default); the others are constant
    expected = "linear" if path.stem.endswith("-grpo") else "constant_with_warmup"
    assert config.train.lr_scheduler_type == expected
    assert isinstance(config.loss, dict) and "matching" in config.loss


def test_the_documented_recipe_config_is_the_study_arm_it_reports():
    """docs/recipes.md recommends bible-es-en-gemma-sampled.yaml for the figures of the study's
    `sampled` arm: the file must be that arm (stage-2 config + the arm's overrides of
    recipes/study/arms.yaml), but that it saves the trained adapter."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("arms", REPO / "recipes/study/arms.py")
    arms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arms)
    arm = arms.load_arms(REPO / "recipes/study/arms.yaml")["sampled"]
    measured = load_config(
        REPO / "recipes/configs/bible-es-en-gemma-stage2.yaml",
        [*arms.overrides(arm), "train.save_model=true"],
    )
    documented = load_config(REPO / "recipes/configs/bible-es-en-gemma-sampled.yaml", [])
    assert documented == measured
    assert documented.loss["candidates"] == "sample" and documented.loss["weighting"] == "balanced"


@pytest.mark.parametrize("stage", ["stage1", "stage2"])
def test_the_xsum_study_configs_are_the_es_en_ones_but_for_the_task_and_its_data(stage):
    """The efficacy study's second task changes what it is trained on, nothing of how."""
    import dataclasses

    xsum = load_config(REPO / f"recipes/configs/xsum-gemma-{stage}.yaml", [])
    es_en = load_config(REPO / f"recipes/configs/bible-es-en-gemma-{stage}.yaml", [])
    assert (xsum.task, es_en.task) == ("summarization", "translation")
    assert xsum.data.path == "runs/data/xsum-study.jsonl"
    assert (xsum.data.max_validation, xsum.data.max_test) == (
        es_en.data.max_validation, es_en.data.max_test)  # fmt: skip
    assert dataclasses.replace(xsum, task=es_en.task, data=es_en.data) == es_en


def test_the_xsum_study_file_splits_every_article_once(tmp_path):
    """make_samples.py --xsum-study: all of XSum's 1,001 articles, 701/100/200, each in one
    split, and the recipes load it (the dev split disjoint from the others)."""
    import json

    from _tokenizers import data_file, xsum_study_file

    source = data_file("xsum-test.jsonl")
    study = xsum_study_file(tmp_path)
    rows = [json.loads(line) for line in study.read_text(encoding="utf-8").splitlines()]
    originals = {json.loads(line)["id"] for line in source.read_text(encoding="utf-8").splitlines()}
    assert {r["id"] for r in rows} == originals and len(rows) == len(originals) == 1001
    counts = {
        name: sum(r["split"] == name for r in rows) for name in ("train", "validation", "test")
    }
    assert counts == {"train": 701, "validation": 100, "test": 200}
    config = load_config(REPO / "recipes/configs/xsum-gemma-stage1.yaml", [f"data.path={study}"])
    splits = load_splits(config.data)
    assert [len(splits[name]) for name in ("train", "validation", "test")] == [701, 100, 200]
    check_dev_split(splits)  # raises if a dev article is also a train or test one


STAGE2 = REPO / "recipes/configs/bible-es-en-gemma-stage2.yaml"
GRPO = REPO / "recipes/configs/bible-es-en-gemma-grpo.yaml"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading the scorer or the generator fails the test: a config error must come first."""
    import run

    from bsloss.scorer.encoder import ScorerEncoder

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was refused")

    monkeypatch.setattr(ScorerEncoder, "from_pretrained", loaded)
    monkeypatch.setattr(run, "load_generator", loaded)


# (override, the setting, the value as the error gives it, part of what is accepted): values the
# setting's consumer refuses (transformers' schedules as the recipes build and step them, the
# precisions the recipes hand on, the model kinds, prompting.py's chat-template settings,
# LoRA's scale, the split caps, bsloss's matching checks)
REFUSED_AT_LOAD = [
    ("train.lr_scheduler_type=cosine_foo", "train.lr_scheduler_type", "'cosine_foo'",
     "'constant_with_warmup'"),
    ("train.lr_scheduler_type=warmup_stable_decay", "train.lr_scheduler_type",
     "'warmup_stable_decay'", "num_decay_steps"),
    ("train.lr_scheduler_type=reduce_lr_on_plateau", "train.lr_scheduler_type",
     "'reduce_lr_on_plateau'", "metrics"),
    ("train.mixed_precision=fp8", "train.mixed_precision", "'fp8'", "'bf16'"),
    ("model.kind=encoder", "model.kind", "'encoder'", "'seq2seq'"),
    ("data.chat_template=maybe", "data.chat_template", "'maybe'", "auto, true or false"),
    ("train.lora_alpha=0", "train.lora_alpha", "got 0", "> 0"),
    ("data.max_train=0", "data.max_train", "got 0", "> 0"),
    ("loss.temperature=-1", "loss.temperature", "got -1", "> 0"),
    ("loss.matching=cosine", "loss.matching", "'cosine'", "'softmax'"),
    ("loss.sinkhorn_iterations=0", "loss.sinkhorn_iterations", "got 0", ">= 1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("override", "setting", "value", "accepted"),
    REFUSED_AT_LOAD,
    ids=[c[0] for c in REFUSED_AT_LOAD],
)
def test_a_value_its_consumer_refuses_fails_at_load_named(
    tmp_path, no_model_loads, override, setting, value, accepted
):
    import finetune

    with pytest.raises(ValueError) as refused:
        finetune.main(["--config", str(STAGE2), "--output_dir", str(tmp_path), "--set", override])
    message = str(refused.value)
    assert setting in message and value in message and accepted in message, message


@pytest.mark.parametrize("config", ["missing.yaml", "."], ids=["missing", "a-folder"])
def test_config_must_be_a_file(tmp_path, no_model_loads, capsys, config):
    """A missing --config ended in a FileNotFoundError traceback: one line, exit status 2."""
    import finetune

    with pytest.raises(SystemExit) as refused:
        finetune.main(["--config", str(tmp_path / config), "--output_dir", str(tmp_path / "run")])
    assert refused.value.code == 2
    what = "no such file" if config == "missing.yaml" else "a folder, not a file"
    assert f"error: --config {tmp_path / config}: {what}" in capsys.readouterr().err


@pytest.mark.parametrize("steps", ["0", "-2", "two"])
def test_stop_after_takes_a_count_of_steps(tmp_path, no_model_loads, capsys, steps):
    """--stop_after 0 (or -2) ran a step and said 'stopped after step 1': refused now."""
    import finetune

    with pytest.raises(SystemExit) as refused:
        finetune.main(["--config", str(STAGE2), "--output_dir", str(tmp_path),
                       "--stop_after", steps])  # fmt: skip
    assert refused.value.code == 2
    assert f"argument --stop_after: {'not an integer' if steps == 'two' else 'must be >= 1'}" in (
        capsys.readouterr().err
    )


def test_a_balanced_term_without_the_cross_entropy_fails_at_load(tmp_path, no_model_loads):
    """BERTScoreTerm refuses Balanced with ce_weight=0 (nothing to balance against): the
    config says so at load, naming both settings, not at the first step."""
    import finetune

    overrides = ["--set", "loss.weighting=balanced", "--set", "loss.ce_weight=0"]
    overrides += ["--set", "loss.weight=1.0"]
    with pytest.raises(ValueError, match=r"loss.weighting / loss.ce_weight: .*ce_weight=0"):
        finetune.main(["--config", str(STAGE2), "--output_dir", str(tmp_path), *overrides])


def test_grpo_needs_whole_groups_of_completions_at_load(tmp_path, no_model_loads):
    """rl.num_generations must divide train.batch_size for grpo.py (a step's completions are
    whole groups), refused before any model loads; finetune.py does not read it."""
    import grpo

    with pytest.raises(ValueError, match=r"config train.batch_size \(6\) must be a multiple of "
                       r"rl.num_generations \(4\)"):  # fmt: skip
        grpo.main(["--config", str(GRPO), "--output_dir", str(tmp_path),
                   "--set", "train.batch_size=6"])  # fmt: skip
    assert load_config(GRPO, ["train.batch_size=6"]).train.batch_size == 6


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("rl.num_generations=1", "rl.num_generations: .*>= 2, got 1"),
        ("rl.ce_weight=5", "rl.ce_weight: rl_scst.py's setting.*got 5"),
        ("rl.sample_top_k=3", "rl.sample_top_k: rl_scst.py's setting.*got 3"),
        ("loss.candidates=sample", "loss.candidates: finetune.py's setting.*'sample'"),
        ("loss.no_such_key=3", "loss.no_such_key: no setting grpo.py reads"),
    ],
)
def test_grpo_refuses_settings_it_would_run_without(tmp_path, no_model_loads, override, named):
    """grpo.py ran with rl.ce_weight=5, rl.sample_top_k=3 or loss.candidates=sample exactly as
    without them, and took rl.num_generations=1 until TRL refused it after the models loaded:
    each is refused at load now, named."""
    import grpo

    with pytest.raises(ValueError, match=named):
        grpo.main(["--config", str(GRPO), "--output_dir", str(tmp_path), "--set", override])


@pytest.mark.parametrize(
    ("script", "override", "named"),
    [
        ("rl_scst", "loss.weight=10", r"loss.weight: finetune.py's setting, which rl_scst.py "
         r"does not use \(set it to 0.0 or remove it\), got 10"),
        ("rl_scst", "loss.candidates=sample", "loss.candidates: finetune.py's .* got 'sample'"),
        ("rl_scst", "rl.temperature=5", "rl.temperature: grpo.py's setting.*got 5"),
        ("rl_scst", "rl.beta=1", "rl.beta: grpo.py's setting.*got 1"),
        ("rl_scst", "rl.num_generations=8", "rl.num_generations: grpo.py's setting.*got 8"),
        ("rl_scst", "loss.matching=softmax", "loss.matching: a setting of finetune.py's BERT"),
        ("rl_scst", "loss.top_k=32", "rl_scst.py's reward is the metric's hard F_BERT .*got 32"),
        ("rl_scst", "loss.target=precision", r"loss.target: .*rl_scst.py's reward .*\(set it "
         r"to 'f1' or remove it\), got 'precision'"),
        ("rl_scst", "loss.idf=true", "loss.idf: .*rl_scst.py's reward.*got True"),
        ("rl_scst", "loss.gumbel_temperature=0.1", "loss.gumbel_temperature: .*got 0.1"),
        ("rl_scst", "loss.rescale_with_baseline=true", "loss.rescale_with_baseline: .*got True"),
        ("rl_scst", "loss.bridge_mode=average", "loss.bridge_mode: .*got 'average'"),
        # a misspelt key and a BERTScoreLoss keyword no RL script reads ran without a word
        ("rl_scst", "loss.rescale_with_basline=true", "loss.rescale_with_basline: no setting "
         "rl_scst.py reads"),
        ("rl_scst", "loss.long_inputs=window", "loss.long_inputs: no setting rl_scst.py reads"),
        ("finetune", "rl.ce_weight=0.5", "rl.ce_weight: rl_scst.py's setting, which finetune.py"),
        ("finetune", "rl.beta=0.1", "rl.beta: grpo.py's setting, which finetune.py"),
    ],
)  # fmt: skip
def test_each_script_refuses_the_settings_it_would_run_without(
    tmp_path, no_model_loads, script, override, named
):
    """rl_scst.py ran with loss.weight=10, loss.candidates=sample, rl.temperature=5, rl.beta=1
    or rl.num_generations=8 exactly as without them (loss 0.671658, reward 0.141536 in each
    log), and finetune.py with rl_scst.py's and grpo.py's keys: each is refused at load, named
    with the script that reads it. A script's own settings load. The RL scripts' reward is the
    metric's F1 without idf or baseline, on the text: the term's target, idf, Gumbel noise,
    baseline and bridge were run without, silently (temperature and Sinkhorn iterations are
    inert under the hard matching they keep, as in finetune.py)."""
    module = importlib.import_module(script)
    with pytest.raises(ValueError, match=named):
        module.main(["--config", str(STAGE2), "--output_dir", str(tmp_path), "--set", override])
    own = {"rl_scst": ["rl.ce_weight=0.5", "rl.sample_top_k=3"], "finetune": ["loss.weight=1"]}
    assert load_config(STAGE2, own[script], script=f"{script}.py").task == "translation"
    # the config recipes/README.md runs rl_scst.py with
    load_config(REPO / "recipes/configs/xsum-bert2bert.yaml", [], script="rl_scst.py")
    with pytest.raises(ValueError, match="loss.straight_through: .*grpo.py's reward"):
        load_config(GRPO, ["loss.straight_through=true"], script="grpo.py")


def test_init_from_a_missing_folder_is_one_line(tmp_path, capsys, no_model_loads):
    """One line naming --init_from and the path, no traceback with the hub's repo-id message,
    before any model loads."""
    import finetune

    missing = tmp_path / "stage1" / "best"
    with pytest.raises(SystemExit) as exited:
        finetune.main(["--config", str(STAGE2), "--output_dir", str(tmp_path / "run"),
                       "--init_from", str(missing)])  # fmt: skip
    assert exited.value.code == 2
    prog, line = capsys.readouterr().err.split(": error: ")  # prog: the script, or pytest's
    assert "\n" not in prog and line == (
        f"--init_from {missing}: no such folder (a saved generator folder: a run's model/ or "
        "best/)\n"
    )


@pytest.mark.parametrize("option", ["--config", "--init_from"])
def test_answer_py_names_a_missing_path_in_one_line(tmp_path, capsys, no_model_loads, option):
    """answer.py took --config and --init_from as plain paths: a missing one was a
    FileNotFoundError or the hub's repo-id message in a traceback (exit 1), where the training
    scripts give one line and exit 2."""
    import answer

    missing = tmp_path / "missing"
    arguments = {"--config": str(STAGE2), "--init_from": None, option: str(missing)}
    argv = [word for key, value in arguments.items() if value for word in (key, value)]
    with pytest.raises(SystemExit) as exited:
        answer.main(argv, lines=["hola"])
    assert exited.value.code == 2
    kind = "file" if option == "--config" else "folder"
    assert f"{option} {missing}: no such {kind}" in capsys.readouterr().err


def test_unknown_key_names_the_section_and_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"config train: unknown key 'lerning_rate' \(known: .*"):
        load_config(CONFIGS[0], ["train.lerning_rate=1e-4"])
    broken = tmp_path / "broken.yaml"
    broken.write_text(CONFIGS[0].read_text().replace("  num_beams:", "  num_beam:"))
    with pytest.raises(ValueError, match="config eval: unknown key 'num_beam'"):
        load_config(broken, [])
    broken.write_text(CONFIGS[0].read_text().replace("eval:", "evaluation:"))
    with pytest.raises(ValueError, match=r"unknown section\(s\) \['evaluation'\]"):
        load_config(broken, [])
    with pytest.raises(ValueError, match="config data: missing key 'target'"):
        section(DataConfig, "data", {"source": "document"})
    with pytest.raises(KeyError, match="no config section 'trian'"):
        load_config(CONFIGS[0], ["trian.steps=3"])
    with pytest.raises(KeyError, match="--set steps: expected task or section.key"):
        load_config(CONFIGS[0], ["steps=3"])
    # a prompt shaped like the tasks' own formats: a bare YAML ParserError naming neither
    with pytest.raises(ValueError, match=r"--set data.prompt_format: .* is not a YAML value"):
        load_config(CONFIGS[0], ["data.prompt_format=Spanish: {source} English:"])
    quoted = load_config(CONFIGS[0], ['data.prompt_format="Spanish: {source}\\nEnglish:"'])
    assert quoted.data.prompt_format == "Spanish: {source}\nEnglish:"
    # no generator passed the load and reached the hub client as a model named "None"
    with pytest.raises(ValueError, match="config model.generator: a model's hub name.*None"):
        load_config(CONFIGS[0], ["model.generator=null"])
    assert load_config(CONFIGS[0], ["task=summarization"]).task == "summarization"
    with pytest.raises(
        ValueError, match=r"config task must be one of \['summarization', 'translation'\]"
    ):
        load_config(CONFIGS[0], ["task=dialogue"])


def test_overrides_and_defaults(tmp_path):
    config = load_config(
        REPO / "recipes/configs/xsum-bert2bert.yaml",
        ["train.learning_rate=2e-4", "train.lr_scheduler_type=cosine", "rl.ce_weight=0.5",
         "data.max_test=null", "loss.idf=true"],
    )  # fmt: skip
    assert config.train.learning_rate == 2e-4  # YAML reads 2e-4 as text; --set means a number
    assert config.train.lr_scheduler_type == "cosine"
    assert config.rl.ce_weight == 0.5 and config.data.max_test is None
    assert config.loss["idf"] is True  # the loss section is BERTScoreLoss's keywords, as given
    # a file without the optional sections and keys gets the dataclasses' defaults
    minimal = tmp_path / "minimal.yaml"
    minimal.write_text(
        "task: translation\n"
        "data: {path: recipes/data/bible-es-en-sample.tsv, source: spanish, target: english}\n"
        "train: {steps: 2, batch_size: 2, learning_rate: 1.0e-5}\n"
    )
    config = load_config(minimal, ["rl.sample_top_k=5"])
    assert config.eval == EvalConfig() and config.loss == {}
    assert config.train.lr_warmup_steps == 0 and config.train.checkpoints_total_limit == 2
    assert config.rl.sample_top_k == 5
    assert recipe_loss_settings(config.loss) == {
        "weight": 0.0, "weighting": "fixed", "ce_weight": 1.0, "warmup_steps": 0,
        "candidates": "teacher_forced", "answer_rows": None, "answer_every": 1,
    }  # fmt: skip
    assert len(load_splits(config.data)["test"]) == 200


def recipe_optimizer(model, train: TrainConfig, output_dir: Path):
    """The optimizer and schedule the recipes' trainer builds for ``model`` from ``train``
    (:func:`trainer_run.trainer_arguments`)."""
    from types import SimpleNamespace

    from accelerate import PartialState
    from trainer_run import trainer_arguments
    from transformers import Trainer, TrainingArguments

    PartialState(cpu=True)  # the recipe's accelerator state, which the arguments use
    run = SimpleNamespace(
        train=train, output_dir=output_dir, args=SimpleNamespace(mixed_precision=None, cpu=True)
    )
    trainer = Trainer(model=model, args=trainer_arguments(run, TrainingArguments))
    trainer.create_optimizer_and_scheduler(num_training_steps=train.steps)
    return trainer.optimizer, trainer.lr_scheduler


def _learning_rates(scheduler_type: str, warmup: int, steps: int) -> list:
    import tempfile

    train = TrainConfig(
        steps=steps, batch_size=1, learning_rate=1.0, lr_warmup_steps=warmup,
        lr_scheduler_type=scheduler_type,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        optimizer, scheduler = recipe_optimizer(torch.nn.Linear(2, 2), train, Path(folder))
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_learning_rate_schedules_are_transformers():
    assert _learning_rates("constant_with_warmup", 2, 4) == [0.0, 0.5, 1.0, 1.0]
    assert _learning_rates("constant_with_warmup", 0, 3) == [1.0, 1.0, 1.0]
    assert _learning_rates("linear", 2, 6) == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])
    cosine = _learning_rates("cosine", 0, 4)
    assert cosine == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466])
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        _learning_rates("cosin", 0, 2)
    # every schedule the config accepts is one the recipes' trainer builds and steps
    from config import usable_lr_schedulers

    assert {"linear", "cosine", "constant_with_warmup"} <= set(usable_lr_schedulers())
    for name in usable_lr_schedulers():
        assert len(_learning_rates(name, 1, 3)) == 3


EXAMPLES = [
    Example("the cat sat on the mat all day long and then it slept", "a cat sat"),
    Example("rain", "it rained in the north of the country today"),
    Example("dogs ran in the park", "dogs ran"),
]


def _seq2seq(kind: str, scorer):
    """(model, tokenizer): the recipe's own BERT2BERT, or a tiny BART or T5 on the scorer's
    vocabulary with its [CLS] as the decoder start."""
    import transformers

    if kind == "bert2bert":
        return load_generator(ModelConfig(generator="bert2bert-minilm"), None, scorer.encoder)
    tokenizer = scorer.encoder.tokenizer
    ids = {
        "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.sep_token_id, "decoder_start_token_id": tokenizer.cls_token_id,
    }  # fmt: skip
    torch.manual_seed(0)
    if kind == "bart":
        config = transformers.BartConfig(
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
            max_position_embeddings=64, forced_eos_token_id=None, **ids,
        )  # fmt: skip
        return transformers.BartForConditionalGeneration(config), tokenizer
    config = transformers.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, **ids)
    return transformers.T5ForConditionalGeneration(config), tokenizer


class _Recorder(torch.nn.Module):
    """Stands in for the model in a forward pass: records its keywords."""

    def forward(self, **inputs):
        self.inputs = inputs
        rows, width = inputs["decoder_input_ids"].shape
        return type("Out", (), {"logits": torch.zeros(rows, width, 5)})()


@pytest.mark.parametrize("kind", ["bert2bert", "bart", "t5"])
def test_seq2seq_collator_pads_and_shifts_as_the_recipes_did(kind, scorer):
    model, tokenizer = _seq2seq(kind, scorer)
    collator = Collator(tokenizer, model, 12, 8)
    pad, eos = tokenizer.pad_token_id, collator.eos
    start = model.config.decoder_start_token_id
    assert start == tokenizer.cls_token_id and eos == tokenizer.sep_token_id
    batch = collator(EXAMPLES)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "decoder_input_ids"}
    # the explicit layout: sources and labels right-padded, labels with -100
    sources = [collator._ids([e.source], "source")[0] for e in EXAMPLES]
    targets = [collator._ids([e.target], "target")[0] for e in EXAMPLES]
    assert collator.truncated == {"source": 1, "target": 1}
    width, span = max(map(len, sources)), max(map(len, targets))
    assert batch["input_ids"].tolist() == [s + [pad] * (width - len(s)) for s in sources]
    assert batch["attention_mask"].tolist() == [
        [1] * len(s) + [0] * (width - len(s)) for s in sources
    ]
    assert batch["labels"].tolist() == [t + [-100] * (span - len(t)) for t in targets]
    assert all(t[-1] == eos for t in targets)
    # decoder inputs: the start token, then the labels shifted right, padding as pad
    expected = [([start] + t + [pad] * (span - len(t)))[:span] for t in targets]
    assert batch["decoder_input_ids"].tolist() == expected
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    # teacher forcing over several label sets uses the same shift (the model's own method)
    other = batch["labels"][:, :3].clone()
    recorder = _Recorder()
    first, second = collator.teacher_forced_logits(recorder, batch, [batch["labels"], other])
    assert first.shape[:2] == batch["labels"].shape and second.shape[:2] == other.shape
    fed = recorder.inputs["decoder_input_ids"]
    assert fed[: len(EXAMPLES)].tolist() == expected
    assert fed[len(EXAMPLES) :].tolist() == [
        ([start] + t[:3] + [pad] * span)[:span] for t in targets
    ]
    # and the real model's CE on the batch is its own loss on the same labels
    model.eval()
    with torch.no_grad():
        (logits,) = collator.teacher_forced_logits(model, batch, [batch["labels"]])
        own = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss
    torch.testing.assert_close(token_cross_entropy(batch["labels"], logits=logits), own)


@pytest.mark.parametrize("has_pad", [True, False])
def test_causal_collator_pads_prompts_left_and_labels_right(has_pad, scorer):
    from _models import scorer_vocabulary_tokenizer, tiny_gpt2
    from causal import CausalCollator

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    model = tiny_gpt2(tokenizer)
    if not has_pad:  # a base LM's tokenizer often has none: eos pads, as in TRL's trainers
        tokenizer.pad_token = None
    collator = CausalCollator(tokenizer, model, "summarization", 32, 6)
    pad = tokenizer.pad_token_id
    assert pad == (0 if has_pad else tokenizer.sep_token_id)
    batch = collator(EXAMPLES)
    prompts = [collator._prompt(e.source) for e in EXAMPLES]
    completions = [collator._completion(e.target) for e in EXAMPLES]
    width, span = max(map(len, prompts)), max(map(len, completions))
    assert batch["prompt_ids"].tolist() == [[pad] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    assert batch["prompt_mask"].tolist() == mask
    assert batch["labels"].tolist() == [c + [-100] * (span - len(c)) for c in completions]
    assert {t.dtype for t in batch.values()} == {torch.int64}


def test_scst_sequence_log_prob_is_the_mean_token_log_probability():
    """rl_scst.py's sequence score: the mean log-probability of each row's labels (``-100``
    excluded), from the package's one cross-entropy."""
    from rl_scst import sequence_log_prob

    logits = torch.randn(2, 4, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[1, 2, 3, -100], [4, -100, -100, -100]])
    log_probs = torch.log_softmax(logits, dim=-1)
    want = torch.stack([log_probs[0, [0, 1, 2], [1, 2, 3]].mean(), log_probs[1, 0, 4]])
    torch.testing.assert_close(sequence_log_prob(logits, labels), want)


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, as a person's screen does."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_evaluation_shows_progress_bars_on_a_terminal_only(terminal, scorer, monkeypatch):
    """Generation (with the decoding step inside a batch), scoring and the teacher-forced CE
    each show a bar when stderr is a terminal; a log file gets none of it."""
    from _models import scorer_vocabulary_tokenizer, tiny_gpt2
    from causal import CausalCollator
    from evaluation import Evaluator

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    model = tiny_gpt2(tokenizer)
    collator = CausalCollator(tokenizer, model, "summarization", 32, 6)
    evaluator = Evaluator("summarization", scorer, EvalConfig(max_new_tokens=4, batch_size=2))
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    metrics, hypotheses = evaluator(model, tokenizer, collator, EXAMPLES, "cpu")
    shown = stderr.getvalue()
    assert len(hypotheses) == len(EXAMPLES) and 0.0 <= metrics["f_bert"] <= 1.0
    if not terminal:
        assert shown == ""
        return
    for bar in ("generating:", "bsloss: encoding:", "teacher-forced CE:"):
        assert f"{bar}   0%" in shown, bar  # each bar drawn at its start
    assert "token 1/4" in shown  # the streamer advances the bar inside a batch


def test_decision_recipe_config_values_checked_at_load():
    """--set train.steps=abc and --set loss.weight=-1 passed config loading; decision: every
    section's values are checked against their field's type and range when loaded, named."""
    from config import load_config

    path = REPO / "recipes/configs/xsum-bert2bert.yaml"
    cases = {
        "train.steps=abc": "config train.steps: expected int, got 'abc'",
        "train.steps=0": "config train.steps: expected a finite number > 0",
        "train.learning_rate=-1e-4": "config train.learning_rate: expected a finite number > 0",
        "loss.weight=-1": "config loss.weight: expected a finite number >= 0",
        "loss.weight=nan": "config loss.weight: expected a finite number >= 0",
        "loss.candidates=beam": "config loss.candidates: expected one of",
        "eval.before=3": "config eval.before: expected bool",
        "data.max_train=2.5": "config data.max_train: expected int | None",
    }
    for override, message in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("|", r"\|")):
            load_config(path, [override])
    config = load_config(path, ["train.steps=3", "loss.weight=0.5", "train.max_grad_norm=null"])
    assert config.train.steps == 3 and config.loss["weight"] == 0.5


def test_a_step_that_answers_says_so_on_the_training_bar(monkeypatch):
    """On a terminal, :func:`trainer_run.train` gives the trainer's answer source a streamer
    that writes the decoding token, then the backward phase, into the training bar."""
    import trainer_run

    class Bar:
        mininterval, postfixes = 0.0, []

        def set_postfix_str(self, text):
            self.postfixes.append(text)

    class Progress:
        training_bar = Bar()

    progress = trainer_run.StepProgress(Progress(), max_new_tokens=40)
    for _ in range(3):  # the prompt, then two decoding steps
        progress.put(None)
    progress.end()
    assert Bar.postfixes == [
        "answering, token 1/40",
        "answering, token 2/40",
        "forward and backward",
    ]
    Progress.training_bar = None  # before the bar exists (or off a terminal): nothing, no error
    progress.put(None)
    progress.end()

    from bsloss.integrations.candidates import SampledAnswers

    class Args:
        disable_tqdm, max_steps = False, 1

    class Trainer:
        args, bertscore_candidates, callbacks = Args(), SampledAnswers(rows=2), []

        def remove_callback(self, callback):
            pass

        def add_callback(self, callback):
            self.callbacks.append(callback)

        def train(self, resume_from_checkpoint=None):
            self.state = type("State", (), {"global_step": 1})

    trainer = Trainer()
    run = type("Run", (), {"stopped_at": None, "heartbeat": lambda self, status: nullcontext()})
    trainer_run.train(trainer, run=run(), start=0, checkpoint=None)
    assert isinstance(trainer.bertscore_candidates.streamer, trainer_run.StepProgress)
    assert trainer.bertscore_candidates == SampledAnswers(rows=2)
    assert trainer.bertscore_candidates.streamer.progress is trainer.callbacks[0]


def test_the_trainers_own_checkpointing_switch_stays_off(tmp_path):
    """TRL's GRPOConfig switches gradient checkpointing on by default, and the recipes' arguments
    never said otherwise: grpo.py checkpointed the generator whatever train.gradient_checkpointing
    said (false in its config). The generator's checkpointing is RecipeRun's, switched on with
    the model when the config asks; the trainer's own switch is off in every recipe."""
    from types import SimpleNamespace

    import trl
    from accelerate import PartialState
    from trainer_run import trainer_arguments
    from transformers import TrainingArguments

    PartialState(cpu=True)
    run = SimpleNamespace(
        train=TrainConfig(steps=1, batch_size=8, learning_rate=1e-4, gradient_checkpointing=False),
        output_dir=tmp_path,
        args=SimpleNamespace(mixed_precision=None, cpu=True),
    )
    default = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert default.gradient_checkpointing  # TRL's default
    for arguments in (TrainingArguments, trl.GRPOConfig):
        # under the name the installed transformers reads: transformers 5.24 warns of the old
        # one at every run (a FutureWarning), and later versions drop it
        with warnings.catch_warnings():
            warnings.filterwarnings("error", ".*gradient_checkpointing.*", FutureWarning)
            made = trainer_arguments(run, arguments)
        assert made.gradient_checkpointing is False
        assert getattr(made, "activation_checkpointing", False) is False


# ---------------------------------------------------------------- round 17 (audit h32)
XSUM_BERT2BERT = REPO / "recipes/configs/xsum-bert2bert.yaml"


def test_overwrite_removes_every_artefact_of_the_old_run(tmp_path):
    """--overwrite deleted only log.jsonl and results.json: the old run's checkpoints stayed,
    and a later --resume took the newest of them for the new run's own (its results "complete"
    with the old run's weights). The folder's other files are the user's and stay."""
    from run import RUN_FILES, RUN_FOLDERS, check_fresh_output

    for name in RUN_FOLDERS:
        (tmp_path / name / "inner").mkdir(parents=True)
    (tmp_path / "checkpoints" / "checkpoint-4").mkdir()
    for name in RUN_FILES:
        (tmp_path / name).write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already holds a run"):
        check_fresh_output(tmp_path, resume=False, overwrite=False)
    check_fresh_output(tmp_path, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    # a folder holding only the old run's checkpoints is a run too
    (tmp_path / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    with pytest.raises(FileExistsError, match=r"already holds a run \(checkpoints\)"):
        check_fresh_output(tmp_path, resume=False, overwrite=False)


def test_resume_without_a_checkpoint_is_one_line_before_any_model(tmp_path, capsys, no_model_loads):
    """--resume into a folder without a checkpoint loaded the scorer and the generator (a
    download for a hub model), then failed in a traceback."""
    import finetune

    with pytest.raises(SystemExit) as exited:
        finetune.main(["--config", str(XSUM_BERT2BERT), "--output_dir", str(tmp_path), "--resume"])
    assert exited.value.code == 2
    assert "--resume: no checkpoint under" in capsys.readouterr().err


def test_a_resume_with_other_settings_is_refused_named(tmp_path):
    """--resume took another seed, batch size or term weight without a word (two runs in one),
    and dropped a new learning rate (the scheduler comes back from the checkpoint)."""
    from run import RUN_CONFIG, check_same_run, run_record

    def record(*overrides, precision="no"):
        return run_record(load_config(XSUM_BERT2BERT, list(overrides)), "finetune.py",
                          precision, None)  # fmt: skip

    started = record("train.seed=0")
    (tmp_path / RUN_CONFIG).write_text(json.dumps(started))
    # how long it trains, how often it saves or evaluates, may change
    assert check_same_run(tmp_path, record("train.steps=500", "train.save_every=5")) == started
    with pytest.raises(ValueError) as refused:
        check_same_run(tmp_path, record("train.seed=7", "train.learning_rate=0.01",
                                        "loss.weight=2.0"))  # fmt: skip
    message = str(refused.value)
    assert "train.seed 0 -> 7" in message and "loss.weight" in message, message
    assert "train.learning_rate" in message and RUN_CONFIG in message
    with pytest.raises(ValueError, match=r"train.mixed_precision 'no' -> 'bf16'"):
        check_same_run(tmp_path, record(precision="bf16"))
    assert check_same_run(tmp_path / "elsewhere", record()) is None  # a run from before


def test_a_resumed_run_from_before_run_config_is_said_and_kept(tmp_path, capsys):
    """A --resume of a run that started before runs kept run_config.json compared nothing, said
    nothing, and wrote none: every later resume of it went unchecked as well."""
    from run import RUN_CONFIG, check_same_run, keep_run_settings, run_record

    def record(*overrides):
        return run_record(load_config(XSUM_BERT2BERT, list(overrides)), "finetune.py", "no",
                          None)  # fmt: skip

    resumed = record("train.seed=3")
    assert check_same_run(tmp_path, resumed) is None
    keep_run_settings(tmp_path, resumed, resumed=True)
    warning = capsys.readouterr().err
    assert "started before runs kept their settings" in warning and RUN_CONFIG in warning
    with pytest.raises(ValueError, match=r"train.seed 3 -> 4"):  # the next resume is checked
        check_same_run(tmp_path, record("train.seed=4"))
    keep_run_settings(tmp_path / "", record(), resumed=False)  # a new run: no warning
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("loss.top_k=0", r"config loss.top_k: top_k must be >= 1, got 0"),
        ("loss.gumbel_temperature=0", r"config loss.gumbel_temperature: .*> 0, got 0"),
        ("loss.target=f2", r"config loss.target: expected one of .*'f1'.*got 'f2'"),
        ("loss.center=maybe", r"config loss.center must be a bool"),
        ("loss.bridge_mode=avg", r"config loss.bridge_mode must be one of"),
        ("loss.temprature=0.1", r"config loss: unknown key\(s\) \['temprature'\]"),
    ],
)
def test_the_loss_section_is_checked_at_load(tmp_path, no_model_loads, override, named):
    """The loss keywords of BERTScoreLoss were checked by the loss itself, after the scorer, the
    generator and (for Gemma) its vocabulary bridge had loaded, unnamed as config settings."""
    import finetune

    with pytest.raises((ValueError, TypeError), match=named):
        finetune.main(["--config", str(XSUM_BERT2BERT), "--output_dir", str(tmp_path),
                       "--set", override])  # fmt: skip


def test_a_shared_vocabulary_refuses_a_bridge_mode(scorer):
    """loss.bridge_mode with a generator of the scorer's own vocabulary built no bridge and
    was accepted, unused."""
    from finetune import build_loss

    config = load_config(XSUM_BERT2BERT, ["loss.bridge_mode=average"])
    with pytest.raises(ValueError, match="config loss.bridge_mode='average': the generator shares"):
        build_loss(config, scorer.encoder, scorer.encoder.tokenizer)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("data.max_source_length=1000", "data.max_source_length 1000 exceeds the encoder's 512"),
        ("data.max_target_length=600", "data.max_target_length 600 exceeds the decoder's 512"),
        ("eval.max_new_tokens=512", "eval.max_new_tokens 512 exceeds the decoder's 512 positions "
         "after its start token"),
    ],
)  # fmt: skip
def test_encoder_decoder_lengths_past_its_positions_are_refused(scorer, override, named):
    """XSum's articles reach 723 tokens: data.max_source_length 1000 failed inside BERT's
    embeddings at the first evaluation; eval.max_new_tokens 530 after a minute of generating."""
    from run import make_collator

    config = load_config(XSUM_BERT2BERT, [override])
    model, tokenizer = load_generator(config.model, None, scorer.encoder)
    with pytest.raises(ValueError, match=named):
        make_collator(config, model, tokenizer)


def test_answer_py_answers_with_bert2bert():
    """answer.py loads the generator without a scorer: bert2bert took its tokenizer from the
    scorer (AttributeError: 'NoneType' object has no attribute 'tokenizer')."""
    import answer

    out = io.StringIO()
    answers = answer.main(["--config", str(XSUM_BERT2BERT), "--set", "eval.max_new_tokens=3"],
                          lines=["The cat sat on the mat."], out=out)  # fmt: skip
    assert len(answers) == 1 and out.getvalue() == answers[0] + "\n"


def test_a_data_field_the_rows_lack_is_named(tmp_path):
    """data.source=documnt was a bare KeyError: 'documnt'."""
    config = load_config(XSUM_BERT2BERT, ["data.source=documnt"])
    with pytest.raises(ValueError, match=r"row 0: data.source='documnt': the row has no field "
                       r"'documnt' \(\[.*'document'"):  # fmt: skip
        load_splits(config.data)
    config = load_config(XSUM_BERT2BERT, ["data.id=meta.ref"])
    with pytest.raises(ValueError, match="data.id='meta.ref': the row has no field 'meta'"):
        load_splits(config.data)


def test_grpo_refuses_a_used_folder_and_an_encoder_decoder_before_any_model(
    tmp_path, capsys, no_model_loads
):
    """grpo.py gave a used --output_dir as a traceback and refused bert2bert only after loading
    it; its --help stopped mid-sentence ("... through TRL's") and showed --set loss.weight=0.5,
    a setting it refuses."""
    import grpo

    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(SystemExit) as exited:
        grpo.main(["--config", str(GRPO), "--output_dir", str(tmp_path)])
    assert exited.value.code == 2 and "already holds a run" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match="config model: generator 'bert2bert-minilm'.*decoder-only"
    ):
        grpo.main(["--config", str(GRPO), "--output_dir", str(tmp_path / "new"), "--set",
                   "model.generator=bert2bert-minilm", "--set", "model.kind=auto"])  # fmt: skip
    with pytest.raises(SystemExit):
        grpo.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "through TRL's GRPOTrainer and" in shown and "--set rl.beta=0.04" in shown


def test_a_long_phase_says_where_it_is_when_no_bar_shows(monkeypatch, capsys):
    """With its output in a file (make demo > log, CI, nohup) tqdm draws no bar: a training
    step that answers, building the loss or an evaluation was silent for minutes (315 s on a
    loaded machine). A line every HEARTBEAT_SECONDS now; on a terminal the bars say it."""
    import time
    from types import SimpleNamespace

    import run

    monkeypatch.setattr(run, "HEARTBEAT_SECONDS", 0.05)
    recipe = run.RecipeRun.__new__(run.RecipeRun)
    recipe.accelerator, recipe.timer = SimpleNamespace(is_main_process=True), run.Timer()
    with recipe.phase("building the loss"):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("building the loss ...") and "done in" in lines[-1]
    beats = [line for line in lines if "s so far" in line]
    assert len(beats) >= 2, lines
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with recipe.heartbeat(lambda: "beat"):
        time.sleep(0.2)
    assert "beat" not in capsys.readouterr().out
