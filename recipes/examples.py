"""Training and held-out examples: ``(source, target)`` pairs from a local JSONL/TSV with a split
column or a Hugging Face dataset, and the seeded order in which training batches take them.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config import DataConfig

RECIPES = Path(__file__).resolve().parent


SPLITS = ("train", "validation", "test")


@dataclass
class Example:
    source: str
    target: str
    id: str | None = None  # the row's data.id field (Bible: its ref), when the config names one


def repository_path(path: str) -> Path:
    candidate = Path(path)
    return candidate if candidate.is_absolute() or candidate.exists() else RECIPES.parent / path


def load_splits(spec: DataConfig) -> dict[str, list[Example]]:
    """Train/validation/test examples from a local JSONL/TSV with a split column, or from a
    Hugging Face ``datasets`` name (needs internet). ``spec``: the ``data`` section."""
    if spec.dataset:
        import datasets

        loaded = datasets.load_dataset(spec.dataset, spec.dataset_config)
        names = spec.splits or {s: s for s in SPLITS}
        out = {}
        for split in SPLITS:
            rows = loaded[names[split]]
            out[split] = [
                _example(r, spec, f"{spec.dataset} {split} row {i}") for i, r in enumerate(rows)
            ]
        return _cap(out, spec)
    if not spec.path:
        raise ValueError("config data: set path (a local file) or dataset")
    path = repository_path(spec.path)
    if not path.is_file():
        # the study's split files (runs/data/...) are built, not vendored: say how, not a traceback
        raise FileNotFoundError(
            f"config data.path={spec.path!r}: no such file ({path}); the split files under "
            "runs/data are built by recipes/data/make_samples.py (the XSum study's by "
            "`python recipes/data/make_samples.py --xsum-study runs/data/xsum-study.jsonl`)"
        )
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
        out[row[column]].append(_example(row, spec, f"{path} row {i}"))
    return _cap(out, spec)


def _example(row: dict, spec: DataConfig, where: str) -> Example:
    """One example; an empty source or target (nothing to prompt with, an empty completion to
    learn) is refused, naming the row and the config's column."""
    texts = []
    for setting, name in (("data.source", spec.source), ("data.target", spec.target)):
        value = _field(row, name, setting, where)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: {setting}={name!r} is empty or not text: {value!r}")
        texts.append(value)
    identifier = None if spec.id is None else str(_field(row, spec.id, "data.id", where))
    return Example(*texts, id=identifier)


def check_dev_split(splits: dict[str, list[Example]]) -> None:
    """Refuse a dev (validation) split that shares an example with the test split or the train
    split used: the same source text, or the same ``data.id`` (a Bible ref). Targets may repeat
    (the Bible says "And the LORD spake unto Moses, saying" many times), sources may not."""
    dev = splits["validation"]
    for other in ("test", "train"):
        texts = {e.source for e in splits[other]}
        ids = {e.id for e in splits[other] if e.id is not None}
        shared = [
            i for i, e in enumerate(dev) if e.source in texts or (e.id is not None and e.id in ids)
        ]
        if shared:
            first = dev[shared[0]]
            raise ValueError(
                f"data: the validation split (the dev split of train.eval_every) shares "
                f"{len(shared)} example(s) with the {other} split (same data.source text or "
                f"data.id), the first its example {shared[0]} ({first.id or first.source[:60]!r});"
                f" make the splits of data.path / data.dataset disjoint"
            )


def _field(row: dict, name: str, setting: str, where: str) -> str:
    """``row``'s field ``name`` ("translation.es" reaches into the nested rows of the wmt
    datasets); a field the row lacks is refused naming the config's ``setting``, the row and the
    fields it has (it was a bare ``KeyError: 'documnt'``; audit h32)."""
    value: Any = row
    for depth, part in enumerate(name.split(".")):
        if not isinstance(value, dict) or part not in value:
            reached = ".".join(name.split(".")[:depth]) or "the row"
            has = sorted(value) if isinstance(value, dict) else f"a {type(value).__name__}"
            raise ValueError(
                f"{where}: {setting}={name!r}: {reached} has no field {part!r} ({has})"
            )
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
