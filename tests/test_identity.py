"""A scorer recognised by what its folder holds (issue 24): the embedded model's own folder, a
converted offline model and a copy under another name get the model's layer and shipped
baseline, in Python and on the command line; a fine-tuned copy is not taken for the original.
And the command line's errors name its own flags and what to install."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

import bsloss
from bsloss.cli import main
from bsloss.scorer.default import DEFAULT_MODEL_NAME, embedded_model_path
from bsloss.scorer.identity import KNOWN_MODELS, recognise, weights_fingerprint

EXAMPLES = Path(bsloss.__file__).parent / "examples"
CANDS = ["The cat sat on the mat.", "A dog is running in the park."]
REFS = ["A cat was sitting on the mat.", "The dog runs in a park."]


def linked_copy(source: Path, target: Path) -> Path:
    """A folder of links to ``source``'s files: the same model under another path and name."""
    target.mkdir()
    for item in Path(source).iterdir():
        (target / item.name).symlink_to(item)
    return target


def test_embedded_folder_gets_its_layer_and_baseline(scorer):
    """What an offline bert_score user passes: the embedded model's folder as model_type, no
    num_layers, rescale_with_baseline=True; the same scores as the default scorer."""
    folder = embedded_model_path()
    by_folder = bsloss.BERTScorer(model_type=folder, rescale_with_baseline=True, device="cpu")
    default = bsloss.BERTScorer(rescale_with_baseline=True, device="cpu")
    assert by_folder.num_layers == 6 and by_folder.model_type == DEFAULT_MODEL_NAME
    for got, want in zip(by_folder.score(CANDS, REFS), default.score(CANDS, REFS), strict=True):
        torch.testing.assert_close(got, want)
    P, R, F = bsloss.score(CANDS, REFS, model_type=folder, rescale_with_baseline=True)
    torch.testing.assert_close(F, default.score(CANDS, REFS)[2])


def test_a_copy_under_another_name_is_recognised(tmp_path):
    copy = linked_copy(Path(embedded_model_path()), tmp_path / "my-scorer")
    scorer = bsloss.BERTScorer(model_type=str(copy), rescale_with_baseline=True, device="cpu")
    assert scorer.model_type == DEFAULT_MODEL_NAME and scorer.num_layers == 6
    assert scorer.hash.startswith("sentence-transformers/all-MiniLM-L6-v2_L6_no-idf")


def test_converted_offline_folder_gets_its_layer():
    from bsloss.pretrained import pretrained_folder

    try:
        folder = pretrained_folder("all-mpnet-base-v2")
    except ImportError as error:
        pytest.skip(str(error))
    scorer = bsloss.BERTScorer(model_type=str(folder), device="cpu")
    assert scorer.model_type == "sentence-transformers/all-mpnet-base-v2"
    assert scorer.num_layers == 12
    by_name = bsloss.BERTScorer("all-mpnet-base-v2", device="cpu")
    torch.testing.assert_close(scorer.score(CANDS, REFS)[2], by_name.score(CANDS, REFS)[2])


def test_fingerprints_match_the_installed_models():
    from transformers import AutoModel

    model = AutoModel.from_pretrained(embedded_model_path())
    shape, fingerprint = KNOWN_MODELS[DEFAULT_MODEL_NAME]
    assert weights_fingerprint(model) == fingerprint
    assert recognise(model) == DEFAULT_MODEL_NAME


def saved_copy(folder: Path, change=None) -> Path:
    """The embedded model saved again into ``folder`` (``change(model)`` applied first), with
    its tokenizer files."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(embedded_model_path())
    if change is not None:
        change(model)
    model.save_pretrained(folder)
    source = Path(embedded_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)
    return folder


@torch.no_grad()
def _shift_first_embedding_row(model):
    model.get_input_embeddings().weight[0] += 1


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """The embedded model with one embedding row changed: same architecture, other weights."""
    return saved_copy(tmp_path_factory.mktemp("fine-tuned"), _shift_first_embedding_row)


def _three_adamw_steps(model):
    """Issue 43's fine-tuning: three AdamW steps at the Trainer's defaults (lr 5e-5, no weight
    decay), which leave the first embedding rows ([PAD], [unused*]) as they were."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    batch = tokenizer(CANDS + REFS, padding=True, return_tensors="pt")
    first_rows = model.get_input_embeddings().weight[:16].detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0)
    model.train()
    for _ in range(3):
        loss = model(**batch).last_hidden_state.pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(model.get_input_embeddings().weight[:16], first_rows)


@pytest.fixture(scope="module")
def trained_copy(tmp_path_factory):
    return saved_copy(tmp_path_factory.mktemp("trained"), _three_adamw_steps)


def test_a_trained_copy_is_not_taken_for_the_original(trained_copy):
    """Three AdamW steps: no known name, no default layer, no shipped baseline."""
    from transformers import AutoModel

    assert recognise(AutoModel.from_pretrained(trained_copy)) is None
    with pytest.raises(ValueError, match="architecture of sentence-transformers/all-MiniLM-L6-v2"):
        bsloss.BERTScorer(model_type=str(trained_copy), device="cpu")
    scorer = bsloss.BERTScorer(model_type=str(trained_copy), num_layers=6, device="cpu")
    assert scorer.model_type == str(trained_copy)
    assert not scorer.hash.startswith(DEFAULT_MODEL_NAME)
    with pytest.raises(FileNotFoundError, match="ships no baseline"):
        bsloss.BERTScorer(
            model_type=str(trained_copy), num_layers=6, rescale_with_baseline=True, device="cpu"
        )


def test_one_middle_layer_tensor_changed_is_not_recognised():
    """A step's worth of change to one tensor of layer 3 alone is another model."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(embedded_model_path())
    assert recognise(model) == DEFAULT_MODEL_NAME
    weight = model.encoder.layer[3].attention.self.query.weight
    with torch.no_grad():
        weight += 5e-5 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    assert recognise(model) is None


def test_a_saved_again_copy_is_recognised(tmp_path):
    """save_pretrained of the unchanged model (other files, the same weights): still the model."""
    copy = saved_copy(tmp_path / "resaved")
    scorer = bsloss.BERTScorer(model_type=str(copy), rescale_with_baseline=True, device="cpu")
    assert scorer.model_type == DEFAULT_MODEL_NAME and scorer.num_layers == 6


def test_fine_tuned_copy_is_not_taken_for_the_original(fine_tuned):
    with pytest.raises(ValueError, match="architecture of sentence-transformers/all-MiniLM-L6-v2"):
        bsloss.BERTScorer(model_type=str(fine_tuned), device="cpu")
    scorer = bsloss.BERTScorer(model_type=str(fine_tuned), num_layers=6, device="cpu")
    assert scorer.model_type == str(fine_tuned)
    with pytest.raises(FileNotFoundError, match="ships no baseline"):
        bsloss.BERTScorer(
            model_type=str(fine_tuned), num_layers=6, rescale_with_baseline=True, device="cpu"
        )


def cli(capsys, *argv) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


FILES = ("-c", str(EXAMPLES / "candidates.txt"), "-r", str(EXAMPLES / "references.txt"))


def test_cli_scores_the_embedded_folder_with_its_baseline(capsys):
    status, out, _ = cli(
        capsys, "score", "-m", embedded_model_path(), "--rescale_with_baseline", *FILES
    )
    _, default_out, _ = cli(capsys, "score", "--rescale_with_baseline", *FILES)
    assert status == 0 and "all-MiniLM-L6-v2_L6_no-idf" in out and "-rescaled" in out
    assert out.split("P:")[1] == default_out.split("P:")[1]


def test_cli_refuses_the_baseline_of_a_trained_copy(capsys, trained_copy):
    status, out, err = cli(capsys, "score", "-m", str(trained_copy), "--rescale", *FILES)
    assert status == 2 and out == "" and "Pass -l N" in err
    status, out, err = cli(capsys, "score", "-m", str(trained_copy), "-l", "6", "--rescale", *FILES)
    assert status == 2 and out == "" and "--baseline_path FILE" in err


def test_cli_errors_name_the_cli_flags(capsys, fine_tuned):
    status, _, err = cli(capsys, "score", "-m", str(fine_tuned), *FILES)
    assert status == 2 and "Pass -l N" in err and "num_layers=N" not in err
    status, _, err = cli(capsys, "score", "-m", str(fine_tuned), "-l", "6", "--rescale", *FILES)
    assert status == 2 and "--baseline_path FILE" in err and "baseline_path=FILE" not in err


def test_cli_plot_without_matplotlib_says_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    status, _, err = cli(
        capsys, "plot", "-c", "a cat", "-r", "a cat", "-o", str(tmp_path / "p.png")
    )
    assert status == 2 and 'pip install "bsloss[plot]"' in err
