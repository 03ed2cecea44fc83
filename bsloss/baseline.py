"""Baseline files for rescaling: read, look up, and compute them for any model and layer.

A baseline is the mean P, R and F of random, unrelated sentence pairs (Zhang et al., 2020, Sec. 3:
1M Common Crawl pairs). The file format is bert_score's: comma-separated, a header
``LAYER,P,R,F`` and one row per layer from 0 (the embedding output) to the last layer, so files
move freely between the two packages.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["read_baseline", "shipped_baseline_path", "write_baseline", "compute_baseline"]

BASELINE_DIR = Path(__file__).parent / "baselines"


def shipped_baseline_path(model_name: str) -> Path:
    return BASELINE_DIR / f"{model_name.replace('/', '__')}.tsv"


def read_baseline(path: str | Path, num_layers: int) -> torch.Tensor:
    """``[3]`` baseline (P, R, F) of layer ``num_layers`` from a bert_score-format file."""
    with open(path, newline="") as handle:
        rows = {int(float(row["LAYER"])): row for row in csv.DictReader(handle)}
    if num_layers not in rows:
        raise ValueError(
            f"baseline file {path} has no row for layer {num_layers} (layers {sorted(rows)})"
        )
    row = rows[num_layers]
    values = torch.tensor([float(row["P"]), float(row["R"]), float(row["F"])], dtype=torch.float64)
    if not torch.all(values < 1):
        raise ValueError(f"baseline file {path}: layer {num_layers} has a value >= 1: {values}")
    return values


def write_baseline(path: str | Path, per_layer: torch.Tensor) -> None:
    """Write ``[num_layers + 1, 3]`` mean (P, R, F) rows in bert_score's format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["LAYER", "P", "R", "F"])
        for layer, (p, r, f) in enumerate(per_layer.tolist()):
            writer.writerow([layer, f"{p:.10f}", f"{r:.10f}", f"{f:.10f}"])


def random_pairs(
    sentences: Sequence[str], num_pairs: int, seed: int
) -> tuple[list[str], list[str]]:
    """``num_pairs`` pairs of distinct, randomly chosen sentences."""
    rng = random.Random(seed)
    pool = [s for s in sentences if s.strip()]
    if len(pool) < 2:
        raise ValueError("a baseline needs a corpus of at least two non-empty sentences")
    cands, refs = [], []
    for _ in range(num_pairs):
        i, j = rng.sample(range(len(pool)), 2)
        cands.append(pool[i])
        refs.append(pool[j])
    return cands, refs


def compute_baseline(
    sentences: Sequence[str],
    model: str | None = None,
    num_pairs: int = 10_000,
    seed: int = 0,
    batch_size: int = 64,
    device: str | None = None,
    progress: bool | None = None,
) -> torch.Tensor:
    """Mean raw P, R, F of random sentence pairs, for every layer ``0..L`` of ``model``.

    Returns ``[L + 1, 3]``. One scorer per layer; each scorer only computes up to its layer.
    """
    from transformers import AutoConfig

    from bsloss.metric import BERTScorer

    cands, refs = random_pairs(sentences, num_pairs, seed)
    total_layers = int(AutoConfig.from_pretrained(_model_path(model)).num_hidden_layers)
    rows = []
    for layer in range(total_layers + 1):
        scorer = BERTScorer(model=model, num_layers=layer, batch_size=batch_size, device=device)
        p, r, f = scorer.score(cands, refs, progress=progress)
        rows.append(torch.stack([p.double().mean(), r.double().mean(), f.double().mean()]))
    return torch.stack(rows)


def _model_path(model: str | None) -> str:
    from bsloss.scorer.default import embedded_model_path

    return embedded_model_path() if model is None else model
