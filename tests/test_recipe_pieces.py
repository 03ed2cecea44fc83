"""The recipes' library pieces: config sections as dataclasses (unknown keys named, defaults in
one place, ``--set`` overrides), transformers' learning-rate schedules, and transformers' seq2seq
collator giving the decoder inputs the recipes used to build by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from common import (
    DataConfig,
    EvalConfig,
    RecipeConfig,
    TrainConfig,
    load_config,
    load_splits,
    section,
)
from finetune import build_optimizer, recipe_loss_settings

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "recipes/configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_loads_into_the_dataclasses(path):
    config = load_config(path, [])
    assert isinstance(config, RecipeConfig) and isinstance(config.train, TrainConfig)
    assert config.train.lr_scheduler_type == "constant_with_warmup"
    assert config["data"] is config.data  # sections by name too
    assert isinstance(config.loss, dict) and "matching" in config.loss


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
        "weight": 0.0, "warmup_steps": 0, "candidates": "teacher_forced",
    }  # fmt: skip
    assert len(load_splits(config.data)["test"]) == 200


def _learning_rates(scheduler_type: str, warmup: int, steps: int, processes: int = 1) -> list:
    train = TrainConfig(
        steps=steps, batch_size=1, learning_rate=1.0, lr_warmup_steps=warmup,
        lr_scheduler_type=scheduler_type,
    )  # fmt: skip
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), train, processes)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        for _ in range(processes):  # accelerate steps a prepared scheduler once per process
            scheduler.step()
    return rates


def test_learning_rate_schedules_are_transformers():
    assert _learning_rates("constant_with_warmup", 2, 4) == [0.0, 0.5, 1.0, 1.0]
    assert _learning_rates("constant_with_warmup", 0, 3) == [1.0, 1.0, 1.0]
    assert _learning_rates("linear", 2, 6) == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])
    cosine = _learning_rates("cosine", 0, 4)
    assert cosine == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466])
    # over 2 processes, the schedule is still over train.steps optimizer steps
    assert _learning_rates("linear", 2, 6, processes=2) == _learning_rates("linear", 2, 6)
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        _learning_rates("cosin", 0, 2)
