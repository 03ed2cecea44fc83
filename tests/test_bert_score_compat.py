"""bsloss as a drop-in for bert_score 0.3.13: the examples of bert_score's README and demo run
with only the import changed, and give bert_score's numbers.

The Hugging Face hub is unreachable here, so ``lang="en"`` (roberta-large) cannot be loaded by
either package: every example names the embedded scorer's local folder instead
(``model_type=FOLDER, num_layers=6``; bert_score reads a local folder the same way) and, for
rescaling, bsloss's shipped baseline file. The same substitution is made for both packages.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys

import pytest
import torch

import bsloss
from bsloss.baseline import shipped_baseline_path
from bsloss.cli import main
from bsloss.scorer.default import DEFAULT_MODEL_NAME, embedded_model_path

bert_score = pytest.importorskip("bert_score")

EXAMPLES = bsloss.__file__.replace("__init__.py", "examples/")
FOLDER = embedded_model_path()
BASELINE = str(shipped_baseline_path(DEFAULT_MODEL_NAME))
N = 12  # lines of bsloss/examples/candidates.txt
OFFLINE_MODEL = f'model_type="{FOLDER}", num_layers=6, baseline_path="{BASELINE}", lang="en"'

# bert_score's README / example/demo.py / example/Demo.ipynb usage (MIT licence), with lang="en"
# replaced by OFFLINE_MODEL (see the module docstring).
README_EXAMPLES = {
    "demo_py": """
from bert_score import score

with open("hyps.txt") as f:
    cands = [line.strip() for line in f]

with open("refs.txt") as f:
    refs = [line.strip() for line in f]

(P, R, F), hashname = score(cands, refs, lang="en", return_hash=True)
print(f"{hashname}: P={P.mean().item():.6f} R={R.mean().item():.6f} F={F.mean().item():.6f}")
""",
    "function_verbose": """
from bert_score import score

with open("hyps.txt") as f:
    cands = [line.strip() for line in f]
with open("refs.txt") as f:
    refs = [line.strip() for line in f]
P, R, F = score(cands, refs, lang="en", verbose=True)
print(f"System level F1 score: {F.mean():.3f}")
""",
    "scorer_rescaled": """
from bert_score import BERTScorer

with open("hyps.txt") as f:
    cands = [line.strip() for line in f]
with open("refs.txt") as f:
    refs = [line.strip() for line in f]
scorer = BERTScorer(lang="en", rescale_with_baseline=True)
P, R, F = scorer.score(cands, refs)
print(scorer.hash, F.mean())
""",
    "multi_reference_idf": """
from bert_score import score

with open("hyps.txt") as f:
    cands = [line.strip() for line in f]
with open("refs.txt") as f:
    refs = [line.strip() for line in f]
multi = [[ref, cand.upper()] for cand, ref in zip(cands, refs)]
P, R, F = score(cands, multi, lang="en", idf=True)
""",
    "plot_example": """
from bert_score import plot_example

with open("hyps.txt") as f:
    cands = [line.strip() for line in f]
with open("refs.txt") as f:
    refs = [line.strip() for line in f]
plot_example(cands[0], refs[0], lang="en", fname="out.png")
P = R = F = None
""",
}


@pytest.fixture(scope="module")
def example_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert_score_example")
    with open(EXAMPLES + "candidates.txt", encoding="utf-8") as handle:
        cands = handle.read().splitlines()
    with open(EXAMPLES + "references.txt", encoding="utf-8") as handle:
        refs = handle.read().splitlines()
    (folder / "hyps.txt").write_text("\n".join(cands) + "\n")
    (folder / "refs.txt").write_text("\n".join(refs) + "\n")
    return folder


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+", text)]


def _run(source: str, package: str, folder, monkeypatch) -> tuple[dict, str]:
    code = source.replace('lang="en"', OFFLINE_MODEL)
    if package == "bsloss":
        code = code.replace("from bert_score import", "from bsloss import")
    assert ("bert_score" in code) == (package == "bert_score")
    monkeypatch.chdir(folder)
    out = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"<{package} example>", "exec"), namespace)
    return namespace, out.getvalue()


@pytest.mark.parametrize("name", sorted(README_EXAMPLES))
def test_bert_score_examples_run_unchanged_with_bsloss(name, example_files, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    ours, printed = _run(README_EXAMPLES[name], "bsloss", example_files, monkeypatch)
    theirs, their_print = _run(README_EXAMPLES[name], "bert_score", example_files, monkeypatch)
    if name == "plot_example":
        assert (example_files / "out.png").stat().st_size > 1000
        return
    for key in ("P", "R", "F"):
        assert isinstance(ours[key], torch.Tensor) and ours[key].dtype == torch.float32
        assert ours[key].shape == theirs[key].shape == (N,)
        assert (ours[key] - theirs[key]).abs().max().item() < 1e-5, key
    if name == "demo_py":
        # same hash layout: model_L<layer>_no-idf_version=...(hug_trans=...); bsloss names the
        # model the folder holds (recognised: bsloss.scorer.identity), bert_score the folder
        assert printed.startswith(
            "sentence-transformers/all-MiniLM-L6-v2_L6_no-idf_version=bsloss-"
        )
        assert their_print.startswith(f"{FOLDER}_L6_no-idf_version=")
        assert _numbers(printed.split(": ")[1]) == pytest.approx(
            _numbers(their_print.split(": ")[1]), abs=2e-6
        )
    if name == "function_verbose":
        assert "calculating scores..." in printed and "done in" in printed
        assert _numbers(printed.splitlines()[-1]) == _numbers(their_print.splitlines()[-1])
    if name == "scorer_rescaled":
        assert "-custom-rescaled" in printed and "-custom-rescaled" in their_print


def test_all_layers_matches_bert_score_shapes_and_values(example_files):
    cands = (example_files / "hyps.txt").read_text().splitlines()[:6]
    refs = (example_files / "refs.txt").read_text().splitlines()[:6]
    kwargs = dict(model_type=FOLDER, num_layers=6, all_layers=True)
    ours = bsloss.score(cands, refs, **kwargs, rescale_with_baseline=True, baseline_path=BASELINE)
    theirs = bert_score.score(
        cands, refs, **kwargs, lang="en", rescale_with_baseline=True, baseline_path=BASELINE
    )
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape == (7, 6)  # embeddings + 6 layers, by candidate
        assert (a - b).abs().max().item() < 1e-5
    # row k of all_layers is the score of layer k alone
    every = bsloss.score(cands, refs, model_type=FOLDER, num_layers=6, all_layers=True)[2]
    for layer in (2, 6):
        alone = bsloss.score(cands, refs, model_type=FOLDER, num_layers=layer)[2]
        assert (every[layer] - alone).abs().max().item() < 1e-6


def test_scorer_idf_sents_and_compute_idf(scorer, example_files):
    cands = (example_files / "hyps.txt").read_text().splitlines()
    refs = (example_files / "refs.txt").read_text().splitlines()
    theirs = bert_score.BERTScorer(model_type=FOLDER, num_layers=6, idf=True, idf_sents=refs)
    ours = bsloss.BERTScorer(encoder=scorer.encoder, idf=True, idf_sents=refs)
    assert (ours.score(cands, refs)[2] - theirs.score(cands, refs)[2]).abs().max() < 1e-5
    assert "_idf_" in ours.hash
    # a precomputed idf dict from bert_score's own get_idf_dict
    from bert_score.utils import get_idf_dict

    idf_dict = get_idf_dict(refs[:6], scorer.encoder.tokenizer, nthreads=1)
    ours_dict = bsloss.score(cands, refs, model_type=FOLDER, num_layers=6, idf=idf_dict)[2]
    theirs_dict = bert_score.score(cands, refs, model_type=FOLDER, num_layers=6, idf=idf_dict)[2]
    assert (ours_dict - theirs_dict).abs().max() < 1e-5
    later = bsloss.BERTScorer(encoder=scorer.encoder, idf=True)
    later.compute_idf(refs[:5])
    theirs.compute_idf(refs[:5])
    assert (later.score(cands, refs)[2] - theirs.score(cands, refs)[2]).abs().max() < 1e-5


def test_lang_picks_bert_score_default_and_explains_offline_failure():
    assert bsloss.metric.model_for_lang("EN") == "roberta-large"
    assert bsloss.metric.model_for_lang("fr") == "bert-base-multilingual-cased"
    from bert_score.utils import lang2model

    for lang in ("en", "zh", "tr", "en-sci", "de"):
        assert bsloss.metric.model_for_lang(lang) == lang2model[lang]
    with pytest.raises(OSError, match="roberta-large") as caught:
        bsloss.score(["a"], ["b"], lang="en")
    assert "model_type='/path/to/model_folder'" in str(caught.value)
    assert "model_type=None and no lang" in str(caught.value)


def test_bsloss_names_still_work(scorer):
    cands, refs = ["the cat sat"], ["a cat sat"]
    with_model = bsloss.score(cands, refs, model=None, progress=False)
    with_hub_name = bsloss.score(cands, refs, model_type=DEFAULT_MODEL_NAME)
    assert torch.equal(with_model[2], with_hub_name[2])
    assert torch.equal(with_model[2], scorer.score(cands, refs, progress=False)[2])
    with pytest.raises(ValueError, match="model_type"):
        bsloss.BERTScorer(model_type="a", model="b")


def _cli_lines(argv, capsys) -> list[str]:
    main(argv)
    return capsys.readouterr().out.strip().splitlines()


def test_cli_accepts_bert_score_flags(example_files, capsys, monkeypatch):
    hyps, refs = str(example_files / "hyps.txt"), str(example_files / "refs.txt")
    flags = ["-l", "6", "-b", "8", "--idf", "--rescale_with_baseline", "--baseline_path", BASELINE]
    ours = _cli_lines(
        ["score", "-r", refs, refs, "-c", hyps, "--lang", "en", "-m", FOLDER, *flags, "-s"],
        capsys,
    )
    cli = pytest.importorskip("bert_score_cli.score")
    argv = ["bert-score", "-r", refs, refs, "-c", hyps, "--lang", "en", "-m", FOLDER, *flags]
    monkeypatch.setattr(sys, "argv", [*argv, "-s"])
    cli.main()
    theirs = capsys.readouterr().out.strip().splitlines()
    # the summary line: same hash layout and the same corpus means
    summary = next(line for line in ours if " P: " in line)
    assert summary.startswith("sentence-transformers/all-MiniLM-L6-v2_L6_idf_version=bsloss-")
    assert "-custom-rescaled" in summary
    assert _numbers(summary.split(" P: ")[1]) == pytest.approx(
        _numbers(theirs[0].split(" P: ")[1]), abs=2e-6
    )
    ours_f = [
        float(line.split("\t")[2]) for line in ours if line.count("\t") == 2 and "F" not in line
    ]
    theirs_f = [float(line.split("\t")[2]) for line in theirs[1:]]
    assert (
        len(ours_f) == N and max(abs(a - b) for a, b in zip(ours_f, theirs_f, strict=True)) < 2e-6
    )


def test_cli_lang_without_model_names_the_default(capsys):
    from bsloss.cli import build_parser

    args = build_parser().parse_args(["score", "-c", "x", "-r", "y", "--lang", "zh"])
    assert args.model == "bert-base-chinese" and args.lang == "zh"
    args = build_parser().parse_args(["score", "-c", "x", "-r", "y", "-m", "m", "--lang", "zh"])
    assert args.model == "m"
    args = build_parser().parse_args(["score", "--cand", "x", "--ref", "y", "-v"])
    assert args.progress == "on" and args.candidates == "x" and args.references == ["y"]


def test_plot_command_accepts_bert_score_show_flags(tmp_path):
    """`bert-score-show --lang en -r REF -c CAND -f out.png` spelled with bsloss plot."""
    from bsloss.cli import build_parser

    argv = ["plot", "--lang", "en", "-r", "a ref", "-c", "a cand", "-f", "out.png"]
    args = build_parser().parse_args(argv)
    assert args.model == "roberta-large" and str(args.output) == "out.png"
    out = tmp_path / "pair.png"
    main(["plot", "-m", FOLDER, "-l", "6", "-r", "a cat sat", "-c", "the cat sat", "-f", str(out)])
    assert out.stat().st_size > 1000


def test_model2layers_holds_every_entry_of_bert_score():
    """A script that swaps ``bert_score.utils`` for ``bsloss.utils`` finds every model."""
    from bsloss import utils as ours

    theirs = bert_score.utils.model2layers
    assert len(theirs) == 140
    assert {name: ours.model2layers.get(name) for name in theirs} == dict(theirs)


@pytest.mark.parametrize(
    "name",
    ["roberta-large-mnli", "microsoft/deberta-v3-large", "google/bert_uncased_L-2_H-128_A-2"],
)
def test_default_layer_of_models_only_bert_score_listed(name):
    """The layer a named scorer gets without num_layers is bert_score's (no model loaded)."""
    from bsloss.scorer.layers import default_num_layers

    assert default_num_layers(name) == bert_score.utils.model2layers[name]
