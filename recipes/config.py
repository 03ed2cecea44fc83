"""A recipe's command line and YAML config: ``--config FILE --set section.key=value``, each
section but ``loss`` a dataclass holding its keys' defaults (an unknown key fails, named); the
``loss`` section goes to ``BERTScoreLoss`` as its keywords.
"""

from __future__ import annotations

import argparse
import functools
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from prompting import chat_template_setting
from tasks import get_task

from bsloss.cli import int_at_least
from bsloss.functional.matching import SHORTHANDS, check_iterations, check_temperature
from bsloss.integrations.term_weights import Balanced, Fixed, check_balance

# train.mixed_precision and --mixed_precision: what every recipe hands on (grpo.py to TRL's bf16 /
# fp16 flags, which have no fp8; accelerate's fp8 also needs a backend the recipes do not set up)
MIXED_PRECISIONS = ("no", "bf16", "fp16")
MODEL_KINDS = ("auto", "seq2seq", "causal")  # model.kind


def check_choice(where: str, value: Any, accepted: Sequence) -> None:
    """``value`` is one of ``accepted``, or an error naming the setting ``where``, the value and
    the accepted ones."""
    if value not in accepted:
        raise ValueError(f"config {where}: expected one of {tuple(accepted)}, got {value!r}")


class _ExistingPath(argparse.Action):
    """A path of the kind ``is_kind`` checks, else one line naming the option and the path (exit
    status 2, as argparse's errors), before any model is loaded: not a traceback."""

    kind, other, hint = "", "", ""

    def is_kind(self, path: Path) -> bool:
        raise NotImplementedError

    def __call__(self, parser, namespace, values, option_string=None):
        path = Path(values)
        if not self.is_kind(path):
            what = f"a {self.other}, not a {self.kind}" if path.exists() else f"no such {self.kind}"
            message = f"{option_string} {values}: {what} ({self.hint})"
            parser.exit(2, f"{parser.prog}: error: {message}\n")
        setattr(namespace, self.dest, path)


class ExistingFolder(_ExistingPath):
    """``--init_from``: a folder that exists (not the hub's repo-id message in a traceback)."""

    kind, other, hint = "folder", "file", "a saved generator folder: a run's model/ or best/"

    def is_kind(self, path: Path) -> bool:
        return path.is_dir()


class ExistingFile(_ExistingPath):
    """``--config``: a file that exists (not a ``FileNotFoundError`` traceback)."""

    kind, other, hint = "file", "folder", "a YAML file, as in recipes/configs/"

    def is_kind(self, path: Path) -> bool:
        return path.is_file()


# each script's --help example of --set: a setting that script reads
SET_EXAMPLES = {
    "finetune.py": "loss.weight=0.5",
    "rl_scst.py": "rl.ce_weight=0.1",
    "grpo.py": "rl.beta=0.04",
}


def base_arguments(description: str, script: str | None = None) -> argparse.ArgumentParser:
    """Every training script's flags. ``description``: the script's docstring, whose first
    paragraph (not its first line, which may end mid-sentence) heads ``--help``."""
    summary = " ".join(description.strip().split("\n\n")[0].split())
    summary = re.sub(r":\w+:`~?([^`]+)`", r"\1", summary).replace("``", "")  # reST as text
    example = SET_EXAMPLES.get(script, "train.steps=100")
    parser = argparse.ArgumentParser(description=summary)
    parser.add_argument(
        "--config", action=ExistingFile, required=True, help="YAML file in recipes/configs/"
    )
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config entry, e.g. --set {example} (VALUE is parsed as YAML)",
    )
    parser.add_argument(
        "--init_from", action=ExistingFolder, help="start from this saved generator folder"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --output_dir (without it, a second run there is refused)",
    )
    parser.add_argument("--mixed_precision", choices=MIXED_PRECISIONS, default=None)
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run on the CPU even with a GPU; several CPU processes (gloo): "
        "accelerate launch --multi_gpu --num_processes N <recipe> --cpu",
    )
    parser.add_argument(
        "--stop_after",
        type=int_at_least(1),  # a step is the least a run can stop after (0 ran one step)
        default=None,
        help="stop after this many steps (>= 1) of this invocation, as an interruption would",
    )
    return parser


@dataclass
class DataConfig:
    """Config section ``data``: where the examples come from and how long they may be."""

    source: str  # the source text's field ("translation.es" reaches into nested rows)
    target: str  # the target text's field
    id: str | None = None  # the field naming each example (Bible: ref); dev/test overlap check
    path: str | None = None  # a local JSONL/TSV with a split column (relative to the repository)
    dataset: str | None = None  # or a Hugging Face datasets name (needs internet)
    dataset_config: str | None = None  # the dataset's configuration name
    splits: dict | None = None  # {train: ..., validation: ..., test: ...}: the dataset's names
    split_column: str | None = "split"  # the local file's split column (unused with dataset)
    prompt_format: str | None = None  # decoder-only: a prompt with {source}; None: prompting.py's
    chat_template: bool | str = "auto"  # decoder-only: auto | true | false
    max_source_length: int = 128  # source tokens kept
    max_target_length: int = 40  # target tokens kept, eos included
    max_train: int | None = None  # examples kept per split (None: all)
    max_validation: int | None = None
    max_test: int | None = None

    def __post_init__(self):
        chat_template_setting(self.chat_template)  # prompting.py's reading of it, or its error


@dataclass
class ModelConfig:
    """Config section ``model``: the generator."""

    generator: str | None = "bert2bert-minilm"  # bert2bert-minilm, a hub name, folder or short name
    kind: str = "auto"  # auto | seq2seq | causal (checked against the model's config)
    generator_config: dict | None = None  # {model_type: t5, ...}: a seq2seq model built at random
    tokenizer: str | None = None  # with generator_config: the tokenizer folder
    init_seed: int = 0  # with generator_config: the seed of the random weights

    def __post_init__(self):
        check_choice("model.kind", self.kind, MODEL_KINDS)
        if self.generator_config is None and (
            not isinstance(self.generator, str) or not self.generator.strip()
        ):
            # None passed the load and reached the hub client as a model named "None"
            raise ValueError(
                "config model.generator: a model's hub name, folder or short name (or "
                f"model.generator_config for a model built at random), got {self.generator!r}"
            )


@dataclass
class ScorerConfig:
    """Config section ``scorer``: the BERTScore encoder of the loss, reward and evaluation."""

    model: str | None = None  # None: the embedded all-MiniLM-L6-v2
    num_layers: int | None = None  # None: the model's default layer


# early_stopping_metric: the dev split's metric and whether lower is better
DEV_METRICS = ("dev_ce", "dev_bertscore_f")


def _scheduler_refusal(name: str) -> str | None:
    """Why the recipes cannot run transformers' schedule ``name``, or ``None``: tried on a
    one-parameter optimizer as build_optimizer builds it (warm-up and training steps only) and
    stepped without a metric, as the recipes step it (a dev metric feeds no schedule)."""
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=1, num_training_steps=2)
        optimizer.step()
        scheduler.step()
    except (TypeError, ValueError) as error:
        return str(error)
    return None


@functools.cache
def usable_lr_schedulers() -> tuple[str, ...]:
    """transformers' ``SchedulerType`` names the recipes can run (:func:`_scheduler_refusal`)."""
    from transformers import SchedulerType

    return tuple(kind.value for kind in SchedulerType if _scheduler_refusal(kind.value) is None)


def check_lr_scheduler_type(name: str) -> None:
    """``train.lr_scheduler_type`` is one of :func:`usable_lr_schedulers`.

    Raises:
        ValueError: another name, naming the setting and the usable ones (and, for a schedule of
            transformers' that needs more, what it needs).
    """
    from transformers import SchedulerType

    usable = usable_lr_schedulers()
    if name in usable:
        return
    known = name in {kind.value for kind in SchedulerType}
    needs = f" (transformers' {name!r} needs more: {_scheduler_refusal(name)})" if known else ""
    raise ValueError(
        f"config train.lr_scheduler_type: expected one of {usable}, got {name!r}{needs}"
    )


@dataclass
class TrainConfig:
    """Config section ``train``: optimisation, checkpoints and validation."""

    steps: int  # optimizer steps
    batch_size: int  # examples per step and process, before accumulation
    learning_rate: float  # AdamW's
    gradient_accumulation_steps: int = 1
    lr_scheduler_type: str = "constant_with_warmup"  # transformers' get_scheduler name
    lr_warmup_steps: int = 0  # steps of learning-rate warm-up
    weight_decay: float = 0.0  # AdamW's
    max_grad_norm: float | None = None  # gradient-norm clipping (None or 0: off)
    seed: int = 0  # the batches' order and the run's RNG
    mixed_precision: str = "no"  # MIXED_PRECISIONS (--mixed_precision overrides)
    gradient_checkpointing: bool = False  # the generator's
    scorer_gradient_checkpointing: bool = True  # the scorer's, in the loss
    eval_every: int = 0  # validation every N steps (0: never)
    # what a validation evaluation computes: dev_bertscore_f (generation, F_BERT, BLEU/ROUGE, CE)
    # or dev_ce (teacher-forced CE only: no generation); early stopping watches it
    early_stopping_metric: str = "dev_bertscore_f"
    early_stopping_patience: int | None = None  # stop after N evaluations without gain (0: off)
    freeze_embeddings: bool = False  # freeze the input embedding and LM head (tied in Gemma)
    lora_rank: int = 0  # > 0: LoRA adapters of this rank (peft) on every linear layer but the head
    lora_alpha: float | None = None  # > 0: LoRA's scale alpha / rank (None: 2 * rank)
    save_every: int = 0  # a checkpoint every N steps (0: never)
    save_model: bool = True  # false: no model/ folder at the end (studies)
    checkpoints_total_limit: int = 2  # checkpoints/checkpoint_N kept (accelerate)

    def __post_init__(self):
        if self.early_stopping_metric not in DEV_METRICS:
            raise ValueError(
                f"config train: early_stopping_metric must be one of {DEV_METRICS}, "
                f"got {self.early_stopping_metric!r}"
            )
        check_choice("train.mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        check_lr_scheduler_type(self.lr_scheduler_type)
        if self.early_stopping_patience and not self.eval_every:
            raise ValueError(
                "config train: early_stopping_patience needs train.eval_every > 0 "
                "(the evaluations it counts)"
            )
        if self.lora_rank < 0:
            raise ValueError(f"config train: lora_rank must be >= 0 (0: off), got {self.lora_rank}")
        if self.early_stopping_patience is not None and self.early_stopping_patience < 0:
            raise ValueError(
                "config train: early_stopping_patience must be >= 0 (0 or null: off), "
                f"got {self.early_stopping_patience}"
            )


@dataclass
class EvalConfig:
    """Config section ``eval``: held-out generation."""

    num_beams: int = 1  # 1: greedy
    max_new_tokens: int = 48
    batch_size: int = 16
    before: bool = True  # score the test split before training


@dataclass
class RLConfig:
    """Config section ``rl``: rl_scst.py's (ce_weight, sample_top_k) and grpo.py's
    (num_generations, temperature, beta; TRL's GRPOConfig keys of the same names)."""

    ce_weight: float = 0.0  # + ce_weight * teacher-forced CE
    sample_top_k: int = 0  # 0: sample from the whole distribution
    num_generations: int = 4  # GRPO: completions per prompt (its group); divides train.batch_size
    temperature: float = 1.0  # GRPO: sampling temperature
    beta: float = 0.0  # GRPO: KL weight to the starting model (0: none, no reference copy)


SECTIONS = {
    "data": DataConfig,
    "model": ModelConfig,
    "scorer": ScorerConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "rl": RLConfig,
}


@dataclass
class RecipeConfig:
    """A recipe's YAML config: ``task``, a dataclass per section, and ``loss``, the keywords of
    ``BERTScoreLoss`` with the recipe's own (see finetune.py), as a dict."""

    task: str
    data: DataConfig
    train: TrainConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    loss: dict = field(default_factory=dict)


# Numeric keys that must be > 0 (every other number must be >= 0): lora_alpha 0 scales the
# adapters' output, and so their gradient, to 0; a split capped at 0 examples is empty.
POSITIVE_KEYS = {
    "lora_alpha",
    "max_train",
    "max_validation",
    "max_test",
    "steps",
    "batch_size",
    "learning_rate",
    "gradient_accumulation_steps",
    "checkpoints_total_limit",
    "max_source_length",
    "max_target_length",
    "num_beams",
    "max_new_tokens",
    "num_generations",
    "temperature",
}
_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "None": type(None)}


def check_value(where: str, annotation: str, value: Any) -> None:
    """``value`` fits the field's annotation (``"int | None"``...; an int is no bool, a float
    may be an int) and, if a number, is finite and >= 0 (> 0 for ``POSITIVE_KEYS``)."""
    kinds = [_TYPES[part.strip()] for part in annotation.split("|")]

    def fits(kind: type) -> bool:
        if kind is float:
            return isinstance(value, numbers.Real) and not isinstance(value, bool)
        if kind is int:
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return isinstance(value, kind)

    if not any(fits(kind) for kind in kinds):
        raise ValueError(f"config {where}: expected {annotation}, got {value!r}")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        key = where.rsplit(".", 1)[-1]
        low = "> 0" if key in POSITIVE_KEYS else ">= 0"
        if not math.isfinite(value) or value < 0 or (key in POSITIVE_KEYS and value == 0):
            raise ValueError(f"config {where}: expected a finite number {low}, got {value!r}")


def section(cls, name: str, values: dict | None):
    """``cls(**values)``; a key that is not a field, or a missing required one, or a value of
    the wrong type or range fails naming the section and the key."""
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ValueError(f"config {name}: expected a mapping of keys, got {values!r}")
    known = [f.name for f in fields(cls)]
    for key in values:
        if key not in known:
            raise ValueError(f"config {name}: unknown key {key!r} (known: {', '.join(known)})")
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING and f.name not in values:
            raise ValueError(f"config {name}: missing key {f.name!r}")
        if f.name in values:
            check_value(f"{name}.{f.name}", f.type, values[f.name])
    return cls(**values)


# How finetune.py uses the BERTScore term, with its defaults; every other key of the config's
# loss section is a keyword of BERTScoreLoss, passed as it is (a misspelt one fails there, named).
RECIPE_LOSS_KEYS = {
    "weight": 0.0,  # lambda in ce_weight * CE + lambda * (1 - F_BERT)
    "weighting": "fixed",  # fixed | balanced (lambda * sg(CE / term): EMO's per-step balance)
    "ce_weight": 1.0,  # 0: the BERTScore term alone (BERTTune's -F_BERT)
    "warmup_steps": 0,  # lambda grows linearly over these steps
    "candidates": "teacher_forced",  # teacher_forced | greedy | sample
    "answer_rows": None,  # greedy / sample: answer this many rows of each batch (None: all)
    "answer_every": 1,  # greedy / sample: answer on every k-th step (the CE alone between)
}
# loss.candidates -> what the term's candidates are, in words (the curves' titles)
CANDIDATE_LABELS = {
    "teacher_forced": "teacher-forced distributions",
    "greedy": "greedy answers",
    "sample": "sampled answers",
}
CANDIDATE_MODES = tuple(CANDIDATE_LABELS)
TERM_WEIGHTS = {"fixed": Fixed, "balanced": Balanced}  # loss.weighting -> the term's weight


def recipe_loss_settings(loss_section: dict) -> dict:
    """The recipe's own keys of the loss section (``RECIPE_LOSS_KEYS``), defaults filled in and
    checked (named)."""
    settings = {key: loss_section.get(key, default) for key, default in RECIPE_LOSS_KEYS.items()}
    check_value("loss.weight", "float", settings["weight"])
    check_value("loss.ce_weight", "float", settings["ce_weight"])
    check_value("loss.warmup_steps", "int", settings["warmup_steps"])
    check_choice("loss.weighting", settings["weighting"], tuple(TERM_WEIGHTS))
    if settings["weight"] == 0 and settings["ce_weight"] == 0:
        raise ValueError("config loss.weight and loss.ce_weight are both 0: nothing to train")
    try:  # the trainer's own rule, at load rather than at the first step
        check_balance(TERM_WEIGHTS[settings["weighting"]](1.0), settings["ce_weight"])
    except ValueError as error:
        raise ValueError(f"config loss.weighting / loss.ce_weight: {error}") from None
    check_choice("loss.candidates", settings["candidates"], CANDIDATE_MODES)
    if settings["answer_rows"] is not None:
        check_value("loss.answer_rows", "int", settings["answer_rows"])
    check_value("loss.answer_every", "int", settings["answer_every"])
    for key in ("answer_rows", "answer_every"):
        if settings[key] is not None and settings[key] < 1:
            raise ValueError(f"config loss.{key} must be >= 1, got {settings[key]}")
    answering = settings["answer_rows"] is not None or settings["answer_every"] != 1
    if answering and settings["candidates"] == "teacher_forced":
        raise ValueError(
            "config loss.answer_rows / loss.answer_every are for the model's own answers "
            "(loss.candidates: sample or greedy), not the teacher-forced candidates"
        )
    return settings


def check_loss_matching(loss_section: dict) -> None:
    """The loss section's matching keywords of ``BERTScoreLoss`` (``matching``, ``temperature``,
    ``sinkhorn_iterations``), checked by bsloss's own checks under their setting's name."""
    if "matching" in loss_section:
        check_choice("loss.matching", loss_section["matching"], tuple(sorted(SHORTHANDS)))
    if loss_section.get("temperature") is not None:
        check_temperature(loss_section["temperature"], "config loss.temperature")
    if loss_section.get("sinkhorn_iterations") is not None:
        check_iterations(loss_section["sinkhorn_iterations"], "config loss.sinkhorn_iterations")


# The loss section's keys that finetune.py turns into BERTScoreLoss's objects (the matching, the
# candidate transforms, the bridge's mode); the other keys are the loss's own keywords
LOSS_OBJECT_KEYS = (
    "matching",
    "temperature",
    "sinkhorn_iterations",
    "top_k",
    "straight_through",
    "gumbel_temperature",
    "bridge_mode",
)
# BERTScoreLoss's keywords the recipe sets itself (the scorer section, the objects above)
LOSS_SET_BY_RECIPE = (
    "model",
    "matching",
    "bridge",
    "candidate_transforms",
    "gradient_checkpointing",
)


@dataclass
class LossOptions:
    """The loss section as BERTScoreLoss takes it: the matching object, the candidate
    transforms, the bridge's mode and the loss's other keywords (the recipe's own keys out)."""

    matching: Any
    transforms: list
    bridge_mode: str | None
    keywords: dict


def loss_options(loss_section: dict) -> LossOptions:
    """The loss section's BERTScoreLoss settings, each built and checked where it is loaded,
    before any model (a bad ``top_k`` or a misspelt key failed after the scorer, the
    generator and, for Gemma, its vocabulary bridge had loaded; audit h32), named
    ``config loss.<key>``.

    Raises:
        ValueError, TypeError: naming the key.
    """
    import inspect

    from bsloss import BERTScoreLoss
    from bsloss.bridge import check_bridge_mode
    from bsloss.candidate_transforms import Gumbel, StraightThrough, TopK
    from bsloss.functional.matching import resolve_matching
    from bsloss.inputs import check_flag

    options = {k: v for k, v in loss_section.items() if k not in RECIPE_LOSS_KEYS}
    known = [
        name
        for name, parameter in inspect.signature(BERTScoreLoss).parameters.items()
        if parameter.kind is not parameter.VAR_KEYWORD and name not in LOSS_SET_BY_RECIPE
    ]
    unknown = sorted(k for k in options if k not in known and k not in LOSS_OBJECT_KEYS)
    if unknown:
        raise ValueError(
            f"config loss: unknown key(s) {unknown} (known: "
            f"{', '.join([*RECIPE_LOSS_KEYS, *LOSS_OBJECT_KEYS, *known])})"
        )
    matching = resolve_matching(  # its keys checked by load_config (check_loss_matching)
        options.pop("matching", "hard"),
        options.pop("temperature", None),
        options.pop("sinkhorn_iterations", None),
    )
    straight_through = options.pop("straight_through", False)
    if not isinstance(straight_through, bool):
        raise TypeError(
            f"config loss.straight_through must be true or false, got {straight_through!r}"
        )

    def transform(key: str, build: Callable) -> list:
        value = options.pop(key, None)
        if value is None:
            return []
        try:
            return [build(value)]
        except (TypeError, ValueError) as error:
            raise type(error)(f"config loss.{key}: {error}") from None

    transforms = transform("top_k", TopK)
    transforms += [StraightThrough()] if straight_through else []
    transforms += transform("gumbel_temperature", Gumbel)
    mode = options.pop("bridge_mode", None)
    check_bridge_mode(mode, "config loss.bridge_mode")
    if "target" in options:
        check_choice("loss.target", options["target"], ("precision", "recall", "f1"))
    for key in ("idf", "center"):
        if key in options:
            check_flag(options[key], f"config loss.{key}")
    return LossOptions(matching, transforms, mode, options)


# The training scripts, and the settings only one of them reads: under another script such a
# setting (not at its default) is refused at load, named, where it would be run without, silently.
SCRIPTS = ("finetune.py", "rl_scst.py", "grpo.py")
SCRIPT_SETTINGS = {
    **{f"loss.{key}": "finetune.py" for key in RECIPE_LOSS_KEYS},
    "rl.ce_weight": "rl_scst.py",
    "rl.sample_top_k": "rl_scst.py",
    "rl.num_generations": "grpo.py",
    "rl.temperature": "grpo.py",
    "rl.beta": "grpo.py",
}
# BERTScoreLoss keywords of the loss section that shape finetune.py's term, at the values that
# leave the RL scripts' reward as it is (the metric's hard F1 of the text, without idf or
# baseline): other values are refused there. temperature and sinkhorn_iterations are inert under
# the hard matching, as in finetune.py.
TERM_SETTINGS = {
    "matching": "hard",
    "target": "f1",
    "idf": False,
    "rescale_with_baseline": False,
    "center": False,
    "top_k": None,
    "straight_through": False,
    "gumbel_temperature": None,
    "bridge_mode": None,
}

# What the RL scripts accept in the loss section (every shipped config's keys): the recipe's own,
# the term's at their neutral values, and the two settings inert under the hard matching. Any
# other key (a misspelt one, or a BERTScoreLoss keyword such as long_inputs) is refused there,
# as finetune.py's BERTScoreLoss refuses it, not run without.
RL_READABLE_LOSS_KEYS = frozenset(
    [*RECIPE_LOSS_KEYS, *TERM_SETTINGS, "temperature", "sinkhorn_iterations"]
)


def check_script_settings(config: RecipeConfig, script: str) -> None:
    """Refuse the settings of :data:`SCRIPT_SETTINGS` that another script reads, set away
    from their defaults, under ``script`` (one of :data:`SCRIPTS`); under the RL scripts, the
    term's :data:`TERM_SETTINGS` away from the values their hard reward has.

    Raises:
        ValueError: naming the setting, the script that reads it, and its value.
    """
    check_choice("script", script, SCRIPTS)
    defaults = {f"loss.{key}": value for key, value in RECIPE_LOSS_KEYS.items()}
    defaults |= {f"rl.{f.name}": getattr(RLConfig(), f.name) for f in fields(RLConfig)}
    for setting, owner in SCRIPT_SETTINGS.items():
        section, key = setting.split(".")
        value = config.loss.get(key) if section == "loss" else getattr(config.rl, key)
        if owner == script or value is None or value == defaults[setting]:
            continue
        raise ValueError(
            f"config {setting}: {owner}'s setting, which {script} does not use (set it to "
            f"{defaults[setting]!r} or remove it), got {value!r}"
        )
    if script == "finetune.py":
        return  # the rest of the loss section are BERTScoreLoss's keywords, refused there
    unread = [key for key in config.loss if key not in RL_READABLE_LOSS_KEYS]
    if unread:
        raise ValueError(
            f"config loss.{unread[0]}: no setting {script} reads (its reward is the metric's "
            f"hard F_BERT of the text; the loss section takes {sorted(RL_READABLE_LOSS_KEYS)} "
            "there, at the values finetune.py's term leaves the reward as it is); remove it"
        )
    for key, neutral in TERM_SETTINGS.items():
        value = config.loss.get(key, neutral)
        if value != neutral:
            raise ValueError(
                f"config loss.{key}: a setting of finetune.py's BERTScore term; {script}'s reward "
                f"is the metric's hard F_BERT of the text, its F1 without idf or baseline (set "
                f"it to {neutral!r} or remove it), got {value!r}"
            )


def check_grpo(config: RecipeConfig) -> None:
    """What grpo.py needs of a config beyond every recipe's: whole groups of at least two
    completions per step and no early stopping (the other recipes' settings it does not use:
    :func:`check_script_settings`).

    Raises:
        ValueError: naming the setting and its value.
    """
    train, rl = config.train, config.rl
    model = config.model
    if model.kind == "seq2seq" or (model.kind == "auto" and model.generator == "bert2bert-minilm"):
        raise ValueError(
            f"config model: generator {model.generator!r} (kind {model.kind!r}) is an "
            "encoder-decoder; GRPO here is for decoder-only LMs (model.kind: causal)"
        )
    if rl.num_generations < 2:
        raise ValueError(
            f"config rl.num_generations: GRPO's advantage compares a prompt's completions with "
            f"each other; it needs >= 2, got {rl.num_generations}"
        )
    if train.batch_size % rl.num_generations:
        raise ValueError(
            f"config train.batch_size ({train.batch_size}) must be a multiple of "
            f"rl.num_generations ({rl.num_generations}): a step's completions are whole groups"
        )
    if train.early_stopping_patience:
        raise ValueError(
            "config train.early_stopping_patience: grpo.py runs train.steps steps (no early "
            f"stopping); set it to 0 or null, got {train.early_stopping_patience}"
        )


def load_config(path: Path, overrides: list[str], *, script: str | None = None) -> RecipeConfig:
    """The YAML file's sections as dataclasses, after ``--set section.key=value`` overrides (the
    value parsed as YAML), every value checked against what its consumer accepts, before any
    model is loaded. ``script``: the training script that reads it (one of :data:`SCRIPTS`):
    also refused, the settings it would run without (:func:`check_script_settings`), and for
    grpo.py what GRPO needs (:func:`check_grpo`).

    Raises:
        ValueError, KeyError, TypeError: a bad override, section, key or value, naming the
            setting.
    """
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        if not parents and leaf != "task":
            raise KeyError(f"--set {key}: expected task or section.key")
        if parents and parents[0] in (*SECTIONS, "loss"):
            raw[parents[0]] = raw.get(parents[0]) or {}  # absent or empty in the file
        node = raw
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise KeyError(f"--set {key}: no config section {part!r}")
            node = node[part]
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as error:
            problem = str(error).splitlines()[0]
            raise ValueError(
                f"--set {key}: {value!r} is not a YAML value ({problem}); quote a string as "
                f"YAML does, e.g. --set '{key}=\"...\"'"
            ) from None
        node[leaf] = _number_or_value(parsed)
    known = ["task", "loss", *SECTIONS]
    unknown = [name for name in raw if name not in known]
    if unknown:
        raise ValueError(f"config: unknown section(s) {unknown} (known: {', '.join(known)})")
    get_task(raw.get("task"))  # a task that recipes/tasks.py defines, or a named error
    loss = raw.get("loss") or {}
    if not isinstance(loss, dict):
        raise ValueError(f"config loss: expected a mapping of keys, got {loss!r}")
    recipe_loss_settings(loss)  # the recipe's own keys, checked before any model is loaded
    check_loss_matching(loss)
    config = RecipeConfig(
        task=raw["task"],
        loss=dict(loss),
        **{name: section(cls, name, raw.get(name)) for name, cls in SECTIONS.items()},
    )
    if script == "grpo.py":
        check_grpo(config)
    if script is not None:
        check_script_settings(config, script)  # a setting the script does not read, named first
    loss_options(loss)  # the loss's: its objects built, its keywords' names known
    return config


def _number_or_value(value: Any) -> Any:
    """YAML 1.1 reads ``2e-4`` (no dot) as a string; on the command line it means a number."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value
