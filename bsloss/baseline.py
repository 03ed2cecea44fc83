"""Baseline files for rescaling: read, write and look them up (computing one:
:mod:`bsloss.baseline_estimation`).

A baseline is the mean P, R and F of random, unrelated sentence pairs (Zhang et al., 2020, Sec. 3:
1M Common Crawl pairs). The file format is bert_score's: comma-separated, a header
``LAYER,P,R,F`` and one row per layer from 0 (the embedding output) to the last layer, so files
move freely between the two packages.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

__all__ = ["load_baseline", "read_baseline", "shipped_baseline_path", "write_baseline"]

BASELINE_DIR = Path(__file__).parent / "baselines"


def shipped_baseline_path(model_name: str) -> Path:
    return BASELINE_DIR / f"{model_name.replace('/', '__')}.tsv"


_HEADER = ["LAYER", "P", "R", "F"]


def load_baseline(path: str | Path | None, model_name: str, num_layers: int) -> torch.Tensor:
    """``[3]`` float64 baseline of ``model_name``'s layer ``num_layers``: from ``path``, or
    (``None``) from the file bsloss ships for the model.

    Raises:
        FileNotFoundError: no such file, or no shipped baseline for the model (the message says
            how to compute one).
        ValueError: see :func:`read_baseline`.
    """
    if not path:
        path = shipped_baseline_path(model_name)
        if not path.is_file():
            raise FileNotFoundError(
                f"bsloss ships no baseline for {model_name!r}; compute one with "
                "`bsloss baseline --model NAME --corpus sentences.txt -o FILE` and pass "
                "baseline_path=FILE"
            )
    return read_baseline(path, num_layers)


def read_baseline(path: str | Path, num_layers: int) -> torch.Tensor:
    """``[3]`` baseline (P, R, F) of layer ``num_layers`` from a bert_score-format file.

    Raises:
        FileNotFoundError, IsADirectoryError: ``path`` is not a file.
        ValueError: not bert_score's comma-separated ``LAYER,P,R,F`` format (a tab-separated
            file included), no row for the layer, or a value that is not a finite number below 1.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"baseline file {path} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"baseline file {path} is a directory, not a file")
    try:
        return _read_rows(path, num_layers)
    except UnicodeDecodeError as error:  # named, as the corpus's and the texts' files are
        raise ValueError(
            f"baseline file {path} is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None


def _read_rows(path: Path, num_layers: int) -> torch.Tensor:
    """:func:`read_baseline`'s reading of the rows."""
    # utf-8-sig: a byte-order mark (Excel's, Notepad's) is not part of the header
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        header = [cell.strip() for cell in next(reader, [])]
        if header[:4] != _HEADER:
            raise ValueError(
                f"baseline file {path} is not in bert_score's format: the first line must be the "
                f"comma-separated header LAYER,P,R,F, got {','.join(header)[:80]!r}"
                + (" (a tab-separated file?)" if "\t" in "".join(header) else "")
            )
        rows: dict[int, list[str]] = {}
        for line, row in enumerate(reader, start=2):
            if not any(cell.strip() for cell in row):  # a blank line, as pandas skips it
                continue
            try:
                layer = float(row[0])
            except (ValueError, IndexError):
                raise ValueError(
                    f"baseline file {path}, line {line}: the layer {row[:1]} is not a number"
                ) from None
            # bert_score reads a layer's row by its position: the LAYER column must say the
            # same (a layer 1.7, or a second row for one layer, was read as another's)
            if layer != len(rows):
                raise ValueError(
                    f"baseline file {path}, line {line}: the layer {row[0]!r} is not "
                    f"{len(rows)}, this row's place (rows go layer 0, 1, 2, ... in order)"
                )
            rows[len(rows)] = row
    if num_layers not in rows:
        raise ValueError(
            f"baseline file {path} has no row for layer {num_layers} (layers {sorted(rows)})"
        )
    row = rows[num_layers]
    try:
        values = torch.tensor([float(x) for x in row[1:4]], dtype=torch.float64)
    except ValueError:
        raise ValueError(
            f"baseline file {path}: layer {num_layers} has a value that is not a number: {row}"
        ) from None
    # below 1 in float32 too, the dtype the loss and the metric rescale in: 0.99999999 is 1.0
    # there, and (x - b) / (1 - b) divides by 0
    below_one = torch.all(values < 1) and torch.all(values.float() < 1)
    if values.numel() != 3 or not torch.isfinite(values).all() or not below_one:
        raise ValueError(
            f"baseline file {path}: layer {num_layers} must have three finite values below 1 "
            f"(P, R, F), got {row[1:]}"
        )
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
