"""Benchmark data loaders: STS-B dev sentence pairs and XSum (summary, document) pairs.

The files live in ``../shared/data/`` relative to the repository root, or in the folder named by
``$BSLOSS_DATA_DIR`` (see ``../shared/data/README.md`` for their sources and licences).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

__all__ = ["data_dir", "load_stsb", "load_stsb_dev", "load_xsum"]

REPO_ROOT = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    """``$BSLOSS_DATA_DIR`` if set, else ``<repo>/../shared/data``."""
    env = os.environ.get("BSLOSS_DATA_DIR")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data"


def _require(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; set BSLOSS_DATA_DIR to the folder holding it")
    return path


def load_stsb_dev(limit: int | None = None) -> tuple[list[str], list[str]]:
    """STS-B dev as ``(sentence1 list, sentence2 list)`` (1,500 pairs; the first ``limit``)."""
    path = _require(data_dir() / "stsb-dev.tsv")
    cands: list[str] = []
    refs: list[str] = []
    with open(path, newline="", encoding="utf-8") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows)
        if header[:3] != ["score", "sentence1", "sentence2"]:
            raise ValueError(f"unexpected STS-B header in {path}: {header}")
        for row in rows:
            if not row:
                continue
            if limit is not None and len(cands) >= limit:
                break
            cands.append(row[1])
            refs.append(row[2])
    return cands, refs


def load_stsb(split: str) -> tuple[list[float], list[str], list[str]]:
    """STS-B ``split`` ("train" or "dev") as (human scores 0-5, sentence1, sentence2)."""
    path = _require(data_dir() / f"stsb-{split}.tsv")
    scores, first, second = [], [], []
    with open(path, newline="", encoding="utf-8") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(rows)
        for row in rows:
            if len(row) >= 3:
                scores.append(float(row[0]))
                first.append(row[1])
                second.append(row[2])
    return scores, first, second


def load_xsum(limit: int | None = 200) -> tuple[list[str], list[str]]:
    """XSum test as ``(summaries, documents)``: candidates are the one-sentence summaries,
    references the full BBC articles (long inputs); the first ``limit`` records."""
    path = _require(data_dir() / "xsum-test.jsonl")
    cands: list[str] = []
    refs: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if limit is not None and len(cands) >= limit:
                break
            if not line.strip():
                continue
            record = json.loads(line)
            cands.append(record["summary"])
            refs.append(record["document"])
    return cands, refs
