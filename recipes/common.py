"""Plumbing shared by the recipes: configs, data, generator models, evaluation, logging and
checkpoints. The BERTScore parts are bsloss's own (``BERTScoreLoss``, ``BERTScorer``,
``BERTScoreReward``); nothing here re-implements them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402

RECIPES = Path(__file__).resolve().parent
SPLITS = ("train", "validation", "test")


# ----------------------------------------------------------------------------- config
def base_arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, required=True, help="YAML file in recipes/configs/")
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config entry, e.g. --set loss.weight=0.5 (VALUE is parsed as YAML)",
    )
    parser.add_argument("--init_from", type=Path, help="start from this saved generator folder")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default=None)
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run on the CPU even with a GPU; several CPU processes (gloo): "
        "accelerate launch --multi_gpu --num_processes N <recipe> --cpu",
    )
    parser.add_argument(
        "--stop_after",
        type=int,
        default=None,
        help="stop after this many steps of this invocation, as an interruption would",
    )
    return parser


TASKS = ("summarization", "translation")


@dataclass
class DataConfig:
    """Config section ``data``: where the examples come from and how long they may be."""

    source: str  # the source text's field ("translation.es" reaches into nested rows)
    target: str  # the target text's field
    path: str | None = None  # a local JSONL/TSV with a split column (relative to the repository)
    dataset: str | None = None  # or a Hugging Face datasets name (needs internet)
    dataset_config: str | None = None  # the dataset's configuration name
    splits: dict | None = None  # {train: ..., validation: ..., test: ...}: the dataset's names
    split_column: str = "split"  # the local file's split column
    prompt_format: str | None = None  # decoder-only: a prompt with {source}; None: prompting.py's
    chat_template: bool | str = "auto"  # decoder-only: auto | true | false
    max_source_length: int = 128  # source tokens kept
    max_target_length: int = 40  # target tokens kept, eos included
    max_train: int | None = None  # examples kept per split (None: all)
    max_validation: int | None = None
    max_test: int | None = None


@dataclass
class ModelConfig:
    """Config section ``model``: the generator."""

    generator: str | None = "bert2bert-minilm"  # bert2bert-minilm, a hub name, folder or short name
    kind: str = "auto"  # auto | seq2seq | causal (checked against the model's config)
    generator_config: dict | None = None  # {model_type: t5, ...}: a seq2seq model built at random
    tokenizer: str | None = None  # with generator_config: the tokenizer folder
    init_seed: int = 0  # with generator_config: the seed of the random weights


@dataclass
class ScorerConfig:
    """Config section ``scorer``: the BERTScore encoder of the loss, reward and evaluation."""

    model: str | None = None  # None: the embedded all-MiniLM-L6-v2
    num_layers: int | None = None  # None: the model's default layer


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
    mixed_precision: str = "no"  # no | bf16 | fp16 (--mixed_precision overrides)
    gradient_checkpointing: bool = False  # the generator's
    scorer_gradient_checkpointing: bool = True  # the scorer's, in the loss
    eval_every: int = 0  # validation every N steps (0: never)
    save_every: int = 0  # a checkpoint every N steps (0: never)
    save_model: bool = True  # false: no model/ folder at the end (studies)
    checkpoints_total_limit: int = 2  # checkpoints/checkpoint_N kept (accelerate)


@dataclass
class EvalConfig:
    """Config section ``eval``: held-out generation."""

    num_beams: int = 1  # 1: greedy
    max_new_tokens: int = 48
    batch_size: int = 16
    before: bool = True  # score the test split before training


@dataclass
class RLConfig:
    """Config section ``rl`` (rl_scst.py)."""

    ce_weight: float = 0.0  # + ce_weight * teacher-forced CE
    sample_top_k: int = 0  # 0: sample from the whole distribution


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
    ``BERTScoreLoss`` with the recipe's own (see finetune.py), as a dict. ``config.train`` or
    ``config["train"]``."""

    task: str
    data: DataConfig
    train: TrainConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    loss: dict = field(default_factory=dict)

    def __getitem__(self, section: str):
        return getattr(self, section)


def section(cls, name: str, values: dict | None):
    """``cls(**values)``; a key that is not a field, or a missing required one, fails naming the
    section and the key."""
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
    return cls(**values)


def load_config(path: Path, overrides: list[str]) -> RecipeConfig:
    """The YAML file's sections as dataclasses, after ``--set section.key=value`` overrides (the
    value parsed as YAML)."""
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
        node[leaf] = _number_or_value(yaml.safe_load(value))
    known = ["task", "loss", *SECTIONS]
    unknown = [name for name in raw if name not in known]
    if unknown:
        raise ValueError(f"config: unknown section(s) {unknown} (known: {', '.join(known)})")
    if raw.get("task") not in TASKS:
        raise ValueError(f"config task must be summarization or translation: {raw.get('task')}")
    loss = raw.get("loss") or {}
    if not isinstance(loss, dict):
        raise ValueError(f"config loss: expected a mapping of keys, got {loss!r}")
    return RecipeConfig(
        task=raw["task"],
        loss=dict(loss),
        **{name: section(cls, name, raw.get(name)) for name, cls in SECTIONS.items()},
    )


def _number_or_value(value: Any) -> Any:
    """YAML 1.1 reads ``2e-4`` (no dot) as a string; on the command line it means a number."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# ----------------------------------------------------------------------------- data
@dataclass
class Example:
    source: str
    target: str


def _resolve(path: str) -> Path:
    candidate = Path(path)
    return candidate if candidate.is_absolute() or candidate.exists() else RECIPES.parent / path


def load_splits(spec: DataConfig | dict) -> dict[str, list[Example]]:
    """Train/validation/test examples from a local JSONL/TSV with a split column, or from a
    Hugging Face ``datasets`` name (needs internet). ``spec``: the ``data`` section (a dict is
    read as one)."""
    if isinstance(spec, dict):
        spec = section(DataConfig, "data", spec)
    source, target = spec.source, spec.target
    if spec.dataset:
        import datasets

        loaded = datasets.load_dataset(spec.dataset, spec.dataset_config)
        names = spec.splits or {s: s for s in SPLITS}
        out = {}
        for split in SPLITS:
            rows = loaded[names[split]]
            out[split] = [
                _example(r, source, target, f"{spec.dataset} {split} row {i}")
                for i, r in enumerate(rows)
            ]
        return _cap(out, spec)
    if not spec.path:
        raise ValueError("config data: set path (a local file) or dataset")
    path = _resolve(spec.path)
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
    else:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    out = {split: [] for split in SPLITS}
    column = spec.split_column
    for i, row in enumerate(rows):
        if row.get(column) not in out:
            raise ValueError(f"{path} row {i}: {column}={row.get(column)!r} is not one of {SPLITS}")
        out[row[column]].append(_example(row, source, target, f"{path} row {i}"))
    return _cap(out, spec)


def _example(row: dict, source: str, target: str, where: str) -> Example:
    """One example; an empty source or target (nothing to prompt with, an empty completion to
    learn) is refused, naming the row and the config's column."""
    texts = []
    for setting, name in (("data.source", source), ("data.target", target)):
        value = _field(row, name)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: {setting}={name!r} is empty or not text: {value!r}")
        texts.append(value)
    return Example(*texts)


def _field(row: dict, name: str) -> str:
    # "translation.es" reaches into the nested rows of the wmt datasets
    value: Any = row
    for part in name.split("."):
        value = value[part]
    return value


def _cap(out: dict[str, list[Example]], spec: DataConfig) -> dict[str, list[Example]]:
    for split in SPLITS:
        limit = getattr(spec, f"max_{split}")
        if limit is not None:
            out[split] = out[split][:limit]
        if not out[split]:
            raise ValueError(f"the {split} split is empty")
    return out


def batch_indices(n: int, batch_size: int, seed: int, start_step: int) -> Iterator[list[int]]:
    """Batches of a fresh seeded permutation each epoch; a resumed run gets the same batches."""
    # Kept rather than a DataLoader with torch's RandomSampler (and accelerate's
    # skip_first_batches on resume): their permutation comes from torch's generator, not
    # Python's random.Random, so the examples' order, and the committed results/, would change.
    per_epoch = max(1, n // batch_size)
    step = start_step
    while True:
        epoch, offset = divmod(step, per_epoch)
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        yield order[offset * batch_size : (offset + 1) * batch_size]
        step += 1


# ----------------------------------------------------------------------------- models
MODEL_KINDS = ("auto", "seq2seq", "causal")


def _pretrained(path: str, kind: str, setting: str):
    """(model, tokenizer) of a folder or hub name, loaded as what its config says it is: an
    encoder-decoder (seq2seq) or a decoder-only (causal) LM. ``kind`` (``model.kind``) checks it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    found = (
        "seq2seq"
        if getattr(AutoConfig.from_pretrained(path), "is_encoder_decoder", False)
        else "causal"
    )
    if kind not in MODEL_KINDS:
        raise ValueError(f"model.kind must be one of {MODEL_KINDS}, got {kind!r}")
    if kind != "auto" and kind != found:
        raise ValueError(
            f"model.kind is {kind!r} but {setting} is a {found} model; "
            f"set model.kind: {found} (or auto)"
        )
    loader = AutoModelForSeq2SeqLM if found == "seq2seq" else AutoModelForCausalLM
    return loader.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def load_generator(model_spec: ModelConfig, init_from: Path | None, scorer_encoder):  # noqa: C901
    """(model, tokenizer): a seq2seq or causal generator. ``generator: bert2bert-minilm``
    warm-starts a BERT2BERT model from the embedded scorer's weights; a hub name, folder or offline
    name (:mod:`bsloss.pretrained`, e.g. ``gemma-3-270m``) loads that model as the kind its config
    says; with ``generator_config`` a seq2seq model is built at random from a config and
    ``tokenizer``."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

    from bsloss.pretrained import resolve_model

    kind = model_spec.kind
    if init_from is not None:
        return _pretrained(str(init_from), kind, f"--init_from {init_from}")
    name = model_spec.generator
    if model_spec.generator_config:
        if not model_spec.tokenizer:
            raise ValueError("config model: generator_config needs model.tokenizer (a folder)")
        options = dict(model_spec.generator_config)
        tokenizer = AutoTokenizer.from_pretrained(_resolve(model_spec.tokenizer))
        options.setdefault("vocab_size", len(tokenizer))
        options.setdefault("pad_token_id", tokenizer.pad_token_id)
        options.setdefault("eos_token_id", tokenizer.eos_token_id)
        options.setdefault("decoder_start_token_id", tokenizer.pad_token_id)
        config = AutoConfig.for_model(options.pop("model_type"), **options)
        torch.manual_seed(model_spec.init_seed)
        return AutoModelForSeq2SeqLM.from_config(config), tokenizer
    if name == "bert2bert-minilm":
        from transformers import EncoderDecoderModel

        from bsloss.scorer.default import embedded_model_path

        path = embedded_model_path()
        import transformers

        # the decoder's cross-attention and LM-head transform are new: the load report that
        # lists them is expected, so it is kept quiet
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            model = EncoderDecoderModel.from_encoder_decoder_pretrained(
                path, path, encoder_add_pooling_layer=False
            )
        finally:
            transformers.logging.set_verbosity(verbosity)
        tokenizer = copy.deepcopy(scorer_encoder.tokenizer)
        tokenizer.bos_token, tokenizer.eos_token = tokenizer.cls_token, tokenizer.sep_token
        model.config.decoder_start_token_id = tokenizer.cls_token_id
        model.config.eos_token_id = tokenizer.sep_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.vocab_size = model.config.decoder.vocab_size
        for config in (model.generation_config,):
            config.decoder_start_token_id = tokenizer.cls_token_id
            config.eos_token_id = tokenizer.sep_token_id
            config.pad_token_id = tokenizer.pad_token_id
            config.bos_token_id = tokenizer.cls_token_id
        return model, tokenizer
    return _pretrained(resolve_model(name), kind, f"model.generator {name!r}")


def special_ids(model, tokenizer) -> tuple[int, int]:
    """(pad, eos) of a seq2seq generator."""
    config = model.config
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
    return pad, eos


class Collator:
    """Source ids (truncated to ``max_source_length``) and label ids ``[target pieces, eos]``.
    Each text is tokenised once per run; ``truncated`` counts the distinct texts the length
    limits cut. Padding (sources with the tokenizer's pad, labels with ``-100``, on the right)
    and the ``decoder_input_ids`` (the model's ``prepare_decoder_input_ids_from_labels``) are
    transformers' ``DataCollatorForSeq2Seq``."""

    def __init__(self, tokenizer, model, max_source_length: int, max_target_length: int):
        from transformers import DataCollatorForSeq2Seq

        self.tokenizer, self.model = tokenizer, model
        self.pad, self.eos = special_ids(model, tokenizer)
        self.max_source, self.max_target = max_source_length, max_target_length
        self.truncated = {"source": 0, "target": 0}
        self._cache: dict[str, dict[str, list[int]]] = {"source": {}, "target": {}}
        if tokenizer.padding_side != "right":  # the collator pads labels on the tokenizer's side
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.padding_side = "right"
        self.padding = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)

    def _ids(self, texts: list[str], side: str) -> list[list[int]]:
        cache = self._cache[side]
        missing = [t for t in dict.fromkeys(texts) if t not in cache]
        if missing:
            source = side == "source"
            encoded = self.tokenizer(missing, add_special_tokens=source)["input_ids"]
            for text, ids in zip(missing, encoded, strict=True):
                if source and len(ids) > self.max_source:
                    ids = ids[: self.max_source - 1] + [ids[-1]]  # keep the closing special
                    self.truncated[side] += 1
                if not source:
                    if len(ids) > self.max_target - 1:
                        ids = ids[: self.max_target - 1]
                        self.truncated[side] += 1
                    ids = ids + [self.eos]
                cache[text] = ids
        return [cache[t] for t in texts]

    def __call__(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``labels`` and ``decoder_input_ids``."""
        sources = self._ids([e.source for e in examples], "source")
        labels = self._ids([e.target for e in examples], "target")
        features = [
            {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": target}
            for ids, target in zip(sources, labels, strict=True)
        ]
        return dict(self.padding(features))

    def content_mask(self, labels: torch.Tensor) -> torch.Tensor:
        """Positions that hold a target token (not padding, not the final eos)."""
        return (labels != -100) & (labels != self.eos) & (labels != self.pad)

    def teacher_forced_logits(self, model, batch, label_sets: list[torch.Tensor]) -> list:
        return teacher_forced_logits(model, batch, label_sets, self)

    def generate(self, model, batch, max_new_tokens: int, **options) -> torch.Tensor:
        """The model's own output as labels-style ids."""
        sequences = generate_ids(
            model, batch["input_ids"], batch["attention_mask"], max_new_tokens, **options
        )
        return generated_labels(sequences, self.pad, self.eos)

    def decode(self, labels: torch.Tensor) -> list[str]:
        return decode_texts(self.tokenizer, labels.clamp_min(0).masked_fill(labels < 0, self.pad))


def pad_labels(label_sets: list[torch.Tensor]) -> list[torch.Tensor]:
    width = max(labels.shape[1] for labels in label_sets)
    return [torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-100) for x in label_sets]


def teacher_forced_logits(model, batch, label_sets: list[torch.Tensor], collator) -> list:
    """Logits for several label sets of the same sources in one forward pass (one pass keeps
    DistributedDataParallel to one reduction per step)."""
    padded = pad_labels(label_sets)
    labels = torch.cat(padded)
    repeat = len(label_sets)
    logits = model(
        input_ids=batch["input_ids"].repeat(repeat, 1),
        attention_mask=batch["attention_mask"].repeat(repeat, 1),
        decoder_input_ids=collator.model.prepare_decoder_input_ids_from_labels(labels=labels),
    ).logits
    return [part[:, : x.shape[1]] for part, x in zip(logits.chunk(repeat), label_sets, strict=True)]


class _Head(torch.nn.Module):
    """The LM head's weight and bias (references, not copies), as BERTScoreLoss takes them, and
    the model's final logit soft-cap (Gemma 2's 30; ``None`` for most models)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None):
        super().__init__()
        self.weight, self.bias, self.softcap = weight, bias, softcap


class _PassThrough(torch.nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@contextlib.contextmanager
def lm_head_inputs(model) -> Iterator[_Head]:
    """Within the block the model's ``.logits`` are the LM head's input ``[B, L, d]``, not
    ``[B, L, V]``: the output-embedding module is swapped for a pass-through (and BART's
    ``final_logits_bias`` for 0). Yields the head (weight, bias) to give ``BERTScoreLoss``
    with ``hidden_states=``, so the step never materialises the logits."""
    head = model.get_output_embeddings()
    parent, name = next(
        (module, child_name)
        for module in model.modules()
        for child_name, child in module.named_children()
        if child is head
    )
    bias = head.bias
    extra = getattr(model, "final_logits_bias", None)  # BART adds it after the head
    if isinstance(extra, torch.Tensor):
        bias = extra[0] if bias is None else bias + extra[0]
        model.final_logits_bias = torch.zeros_like(extra[:, :1])
    # A soft-capping model applies its cap after the head: off here, given to the loss instead.
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap is not None:
        model.config.final_logit_softcapping = None
    setattr(parent, name, _PassThrough())
    try:
        yield _Head(head.weight, bias, softcap)
    finally:
        setattr(parent, name, head)
        if softcap is not None:
            model.config.final_logit_softcapping = softcap
        if isinstance(extra, torch.Tensor):
            model.final_logits_bias = extra


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), labels, ignore_index=-100
    )


def token_cross_entropy_from_hidden(
    hidden: torch.Tensor, head, labels: torch.Tensor
) -> torch.Tensor:
    """:func:`token_cross_entropy` from the LM head's input, chunked (no ``[B, L, V]``)."""
    from bsloss.functional.fused_expectation import fused_token_log_likelihood

    log_likelihood = fused_token_log_likelihood(hidden.flatten(0, 1), head, labels.flatten())
    return -log_likelihood.sum() / (labels != -100).sum().clamp_min(1)


def generated_labels(sequences: torch.Tensor, pad: int, eos: int) -> torch.Tensor:
    """``generate()`` output (decoder start first) -> labels-style ids: padding and everything
    after the first eos are ``-100``."""
    labels = sequences[:, 1:].clone()
    ended = (labels == eos).long().cumsum(1)
    after_eos = (ended - (labels == eos).long()) > 0
    labels[after_eos | (labels == pad)] = -100
    return labels


@torch.no_grad()
def generate_ids(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    *,
    sample: bool = False,
    top_k: int = 0,
    num_beams: int = 1,
    **special_ids,
) -> torch.Tensor:
    """``model.generate`` in eval mode (the training mode restored after), greedy or sampled."""
    was_training = model.training
    model.eval()
    try:
        return model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=sample,
            top_k=top_k if sample else None,
            num_beams=num_beams,
            max_new_tokens=max_new_tokens,
            **special_ids,
        )
    finally:
        model.train(was_training)


def decode_texts(tokenizer, sequences: torch.Tensor) -> list[str]:
    return [
        " ".join(t.split()) for t in tokenizer.batch_decode(sequences, skip_special_tokens=True)
    ]


# ----------------------------------------------------------------------------- evaluation
class Evaluator:
    """Held-out generation and scoring: hard F_BERT (exact BERTScorer), ROUGE-1/2/L
    (summarization) or sacreBLEU BLEU and chrF (translation), and teacher-forced CE."""

    def __init__(self, task: str, scorer, config: EvalConfig):
        self.task, self.scorer = task, scorer
        self.num_beams = config.num_beams
        self.max_new_tokens = config.max_new_tokens
        self.batch_size = config.batch_size

    @torch.no_grad()
    def cross_entropy(self, model, collator: Collator, examples, device) -> float:
        total, tokens = 0.0, 0
        for start in range(0, len(examples), self.batch_size):
            batch = collator(examples[start : start + self.batch_size])
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch["labels"]
            mean = token_cross_entropy(
                collator.teacher_forced_logits(model, batch, [labels])[0], labels
            )
            count = int((labels != -100).sum())
            total, tokens = total + mean.item() * count, tokens + count
        return total / max(tokens, 1)

    def metrics(self, hypotheses: list[str], references: list[str], lowercase: bool) -> dict:
        _, _, f = self.scorer.score(hypotheses, references, progress=False)
        result = {"f_bert": float(f.mean())}
        if self.task == "summarization":
            for key, values in rouge_scores(hypotheses, references).items():
                result[key] = sum(values) / len(values)
        else:
            import sacrebleu

            result["bleu"] = sacrebleu.corpus_bleu(
                hypotheses, [references], lowercase=lowercase
            ).score
            result["chrf"] = sacrebleu.corpus_chrf(hypotheses, [references]).score
        result["mean_length"] = sum(len(h.split()) for h in hypotheses) / len(hypotheses)
        return result

    def __call__(self, model, tokenizer, collator, examples, device) -> tuple[dict, list[str]]:
        was_training = model.training
        model.eval()
        hypotheses = generate_answers(
            model, collator, examples, device, self.max_new_tokens, self.batch_size, self.num_beams
        )
        result = self.metrics(hypotheses, [e.target for e in examples], lowercases(tokenizer))
        result["ce"] = self.cross_entropy(model, collator, examples, device)
        model.train(was_training)
        return result, hypotheses


def generate_answers(
    model, collator, examples, device, max_new_tokens: int, batch_size: int, num_beams: int = 1
) -> list[str]:
    """The model's decoded outputs for ``examples`` (greedy, or beam search), in batches."""
    outputs = []
    for start in range(0, len(examples), batch_size):
        batch = collator(examples[start : start + batch_size])
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs += collator.decode(
            collator.generate(model, batch, max_new_tokens, num_beams=num_beams)
        )
    return outputs


def rouge_scores(hypotheses: list[str], references: list[str]) -> dict[str, list[float]]:
    """Per-example ROUGE-1/2/L F-measures (``rouge-score``, with stemming)."""
    from rouge_score import rouge_scorer

    rouge = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    rows = [rouge.score(r, h) for h, r in zip(hypotheses, references, strict=True)]
    return {key: [row[key].fmeasure for row in rows] for key in ("rouge1", "rouge2", "rougeL")}


def lowercases(tokenizer) -> bool:
    """An uncased generator can't produce capitals: BLEU is then computed lowercased."""
    return tokenizer.decode(tokenizer("Abc", add_special_tokens=False)["input_ids"]) == "abc"


# ----------------------------------------------------------------------------- run state
class RunLog:
    """Append-only JSONL log; on resume, entries after the checkpoint are dropped."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        if not self.enabled or not self.path.exists():
            return
        kept = [
            line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, **entry) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")

    def entries(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]


class Progress:
    """The last completed step, saved in every checkpoint with the model, optimizer, scheduler
    and RNG states (``accelerator.register_for_checkpointing``)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def resume(accelerator, output_dir: Path, log: RunLog, progress: Progress) -> int:
    """Load the newest checkpoint of ``output_dir/checkpoints`` (accelerate's automatic naming)
    and return its step; the log loses the lines written after it."""
    folder = output_dir / "checkpoints"
    saved = sorted(folder.glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[1]))
    if not saved:
        raise FileNotFoundError(f"--resume: no checkpoint under {folder}")
    accelerator.load_state(str(saved[-1]))
    # the next save continues the numbering (accelerate refuses to overwrite a checkpoint)
    accelerator.project_configuration.iteration = int(saved[-1].name.split("_")[1]) + 1
    if accelerator.is_main_process:
        log.truncate_after(progress.step)
    accelerator.wait_for_everyone()
    return progress.step


def linear_warmup(weight: float, warmup_steps: int, step: int) -> float:
    if warmup_steps <= 0:
        return weight
    return weight * min(1.0, step / warmup_steps)


def plot_curves(log: RunLog, path: Path, title: str) -> Path:
    """Training losses and held-out metrics against the step, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = log.entries()
    train = [e for e in entries if e.get("kind") == "train"]
    evals = [e for e in entries if e.get("kind") == "eval" and e.get("split") == "validation"]
    train_keys = [
        k for k in ("loss", "ce", "bertscore_loss", "reward") if any(k in e for e in train)
    ]
    eval_keys = [
        k
        for k in ("f_bert", "rouge1", "rouge2", "rougeL", "bleu", "chrf", "ce")
        if any(k in e for e in evals)
    ]
    panels = len(train_keys) + len(eval_keys)
    columns = min(4, max(panels, 1))
    rows = max(1, math.ceil(panels / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 2.8 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax, key in zip(flat, train_keys, strict=False):
        points = [(e["step"], e[key]) for e in train if key in e]
        ax.plot(*zip(*points, strict=True), lw=0.8)
        ax.set_title(f"train {key}")
    for ax, key in zip(flat[len(train_keys) :], eval_keys, strict=False):
        points = [(e["step"], e[key]) for e in evals if key in e]
        ax.plot(*zip(*points, strict=True), marker="o")
        ax.set_title(f"validation {key}")
    for ax in flat:
        ax.set_xlabel("step")
    for ax in flat[panels:]:
        ax.axis("off")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def summary_table(before: dict, after: dict) -> str:
    keys = [k for k in before if isinstance(before[k], float)]
    lines = ["| metric (test) | before | after |", "|---|---:|---:|"]
    lines += [f"| {k} | {before[k]:.4f} | {after[k]:.4f} |" for k in keys]
    return "\n".join(lines)


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.start, 2)


# ----------------------------------------------------------------------------- a run
class RecipeRun:
    """What every recipe does around its own training step: config, accelerator, data, scorer,
    generator, collator, evaluator; resume and the test score before training; periodic
    validation and checkpoints; the final model, test score, results file and plot."""

    def __init__(self, args: argparse.Namespace, gradient_accumulation: bool = True):
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration, set_seed

        from bsloss import BERTScorer
        from bsloss.scorer.encoder import ScorerEncoder

        self.args = args
        self.config = load_config(args.config, args.overrides)
        self.train = self.config.train
        self.output_dir = args.output_dir
        # checkpoints/checkpoint_N every train.save_every steps, the last few kept
        checkpoints = ProjectConfiguration(
            project_dir=str(self.output_dir),
            automatic_checkpoint_naming=True,
            total_limit=self.train.checkpoints_total_limit,
        )
        self.accelerator = Accelerator(
            mixed_precision=args.mixed_precision or self.train.mixed_precision,
            gradient_accumulation_steps=self.train.gradient_accumulation_steps
            if gradient_accumulation
            else 1,
            cpu=args.cpu,
            project_config=checkpoints,
        )
        self.progress = Progress()
        self.accelerator.register_for_checkpointing(self.progress)
        set_seed(self.train.seed)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.log = RunLog(self.output_dir / "log.jsonl", self.accelerator.is_main_process)
        self.data = load_splits(self.config.data)
        scorer_spec = self.config.scorer
        self.encoder = ScorerEncoder.from_pretrained(
            scorer_spec.model, scorer_spec.num_layers, self.accelerator.device
        )
        # references repeat (validation set, reward): their embeddings are kept across calls
        self.scorer = BERTScorer(encoder=self.encoder, reference_cache_size=100_000)
        self.model, self.tokenizer = load_generator(self.config.model, args.init_from, self.encoder)
        if self.train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            self.model.config.use_cache = False
        data_spec = self.config.data
        if getattr(self.model.config, "is_encoder_decoder", False):
            for setting in ("prompt_format", "chat_template"):
                if getattr(data_spec, setting) not in (None, "auto"):
                    raise ValueError(
                        f"data.{setting} is for decoder-only generators; "
                        "this generator is an encoder-decoder"
                    )
            self.collator = Collator(
                self.tokenizer,
                self.model,
                data_spec.max_source_length,
                data_spec.max_target_length,
            )
        else:
            from causal import CausalCollator

            self.collator = CausalCollator(
                self.tokenizer,
                self.model,
                self.config.task,
                data_spec.max_source_length,
                data_spec.max_target_length,
                data_spec.prompt_format,
                data_spec.chat_template,
            )
        self.evaluator = Evaluator(self.config.task, self.scorer, self.config.eval)
        self.results_path = self.output_dir / "results.json"
        self.results: dict = {}
        self.timer = Timer()

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def prepare(self, *objects):
        """``accelerator.prepare(model, *objects)``, then resume (``--resume``) or score the test
        split before training. Returns the prepared objects and the first step to run."""
        prepared = self.accelerator.prepare(self.model, *objects)
        self.model = prepared[0]
        self.unwrapped = self.accelerator.unwrap_model(self.model)
        start = 0
        if self.args.resume:
            start = resume(self.accelerator, self.output_dir, self.log, self.progress)
        if self.results_path.exists():
            self.results = json.loads(self.results_path.read_text())
        wants_before = self.config.eval.before
        if start == 0 and self.accelerator.is_main_process and wants_before:
            before, hypotheses = self.evaluate("test")
            self.results["before"] = before
            self.write_outputs("test_outputs_before.txt", hypotheses)
            self.results_path.write_text(json.dumps(self.results, indent=2))
            self.log.write(kind="eval", split="test", step=0, **before)
        return (*prepared, start)

    def evaluate(self, split: str) -> tuple[dict, list[str]]:
        return self.evaluator(
            self.unwrapped, self.tokenizer, self.collator, self.data[split], self.device
        )

    def batches(self, start_step: int) -> Iterator[list]:
        """This process's share of each global batch of training examples."""
        accelerator = self.accelerator
        world, rank = accelerator.num_processes, accelerator.process_index
        stream = batch_indices(
            len(self.data["train"]),
            self.train.batch_size * world,
            self.train.seed,
            start_step * accelerator.gradient_accumulation_steps,
        )
        for indices in stream:
            yield [self.data["train"][i] for i in indices[rank::world]]

    def collate(self, examples: list) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in self.collator(examples).items()}

    def last_step(self, start_step: int) -> int:
        steps = self.train.steps
        stop_after = self.args.stop_after
        return steps if stop_after is None else min(steps, start_step + stop_after)

    def end_of_step(self, step: int, **entry) -> None:
        """Log the step; validate and save a checkpoint when their turn comes."""
        if not math.isfinite(entry["loss"]):
            raise FloatingPointError(f"step {step}: the loss is {entry['loss']}")
        self.log.write(kind="train", step=step, time=self.timer(), **entry)
        eval_every = self.train.eval_every
        if eval_every and step % eval_every == 0 and self.accelerator.is_main_process:
            metrics, _ = self.evaluate("validation")
            self.log.write(kind="eval", split="validation", step=step, time=self.timer(), **metrics)
        save_every = self.train.save_every
        if save_every and step % save_every == 0:
            self.progress.step = step
            self.accelerator.save_state()

    def write_outputs(self, name: str, hypotheses: list[str]) -> None:
        """One generated answer per line, in test-set order (for rescoring later)."""
        (self.output_dir / name).write_text("\n".join(hypotheses) + "\n", encoding="utf-8")

    def finish(self, last_step: int, title: str, **extra) -> dict:
        """After the last step: the model, test scores, results.json, outputs and the plot
        (or nothing but a message when ``--stop_after`` cut the run short)."""
        accelerator, steps = self.accelerator, self.train.steps
        accelerator.wait_for_everyone()
        if last_step < steps:
            accelerator.print(f"stopped after step {last_step} of {steps} (--stop_after)")
            return self.results
        if accelerator.is_main_process:
            if self.train.save_model:  # a study's many runs may skip 1 GB each
                self.unwrapped.save_pretrained(self.output_dir / "model")
                self.tokenizer.save_pretrained(self.output_dir / "model")
            after, hypotheses = self.evaluate("test")
            self.log.write(kind="eval", split="test", step=steps, **after)
            self.results.update(
                after=after,
                steps=steps,
                seed=self.train.seed,
                train_seconds=self.timer(),
                truncated=self.collator.truncated,
                command=" ".join(sys.argv),
                **extra,
            )
            self.results_path.write_text(json.dumps(self.results, indent=2))
            self.write_outputs("test_outputs.txt", hypotheses)
            plot = plot_curves(self.log, self.output_dir / "curves.png", title)
            if "before" in self.results:
                print(summary_table(self.results["before"], after))
            print(f"curves: {plot}")
        accelerator.wait_for_everyone()
        return self.results
