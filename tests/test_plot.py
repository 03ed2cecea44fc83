"""The pair heatmap (API and CLI)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")

from bsloss import plot_example  # noqa: E402
from bsloss.cli import main  # noqa: E402
from bsloss.plot import pair_similarity  # noqa: E402


def test_plot_example_marks_each_tokens_best_match(scorer, tmp_path):
    cand, ref = "A man with a hard hat is dancing.", "A man wearing a hard hat is dancing."
    sim, cand_tokens, ref_tokens = pair_similarity(scorer, cand, ref)
    assert sim.shape == (len(cand_tokens), len(ref_tokens)) == (9, 9)
    assert cand_tokens[:2] == ["a", "man"] and "[CLS]" not in cand_tokens
    fig = plot_example(cand, ref, scorer=scorer, fname=tmp_path / "pair.png")
    assert (tmp_path / "pair.png").stat().st_size > 10_000
    precision_marks = fig.axes[0].collections[0].get_offsets()
    assert torch.equal(torch.tensor(precision_marks[:, 0]).long(), sim.argmax(dim=1))
    soft = plot_example(cand, ref, scorer=scorer, temperature=0.05)
    assert "T=0.05" in soft.axes[0].get_title()


def test_plot_cli(tmp_path, capsys):
    out = tmp_path / "cli.png"
    main(["plot", "-c", "a cat sat", "-r", "the cat sits", "-o", str(out)])
    assert out.exists() and "wrote" in capsys.readouterr().out


def test_scorer_method_draws_the_same_pair(scorer, tmp_path):
    """``BERTScorer.plot_example`` (bert_score's method) marks the same best matches."""
    cand, ref = "a cat sat on the mat", "the cat sits on a mat"
    sim, _, _ = pair_similarity(scorer, cand, ref)
    fig = scorer.plot_example(cand, ref, fname=str(tmp_path / "method.png"))
    assert (tmp_path / "method.png").stat().st_size > 10_000
    marks = fig.axes[0].collections[0].get_offsets()
    assert torch.equal(torch.tensor(marks[:, 0]).long(), sim.argmax(dim=1))


def title_scores(figure) -> list[float]:
    import re

    title = figure.axes[0].get_title()
    return [float(re.search(rf"{name}=(-?[0-9.]+)", title).group(1)) for name in "PRF"]


def test_soft_heatmap_title_gives_the_soft_matchings_scores(scorer):
    """The shading is softmax(s / T): the title's P, R, F are the softmax matching's at T (the
    loss's soft score of the same token ids), not the hard ones."""
    import bsloss

    cand, ref = "A man with a hard hat is dancing.", "A man wearing a hard hat is dancing."
    soft_loss = bsloss.BERTScoreLoss(encoder=scorer.encoder, matching="softmax", temperature=0.5)
    ids = scorer.encoder.tokenizer([cand], return_tensors="pt")["input_ids"]
    expected = [x.item() for x in soft_loss.score(candidate_ids=ids, references=[ref])]
    hard = [x.item() for x in scorer.score([cand], [ref])]
    soft_title = title_scores(plot_example(cand, ref, scorer=scorer, temperature=0.5))
    assert soft_title == pytest.approx(expected, abs=1e-3)
    assert min(abs(h - s) for h, s in zip(hard, soft_title, strict=True)) > 0.01  # not the hard
    assert title_scores(plot_example(cand, ref, scorer=scorer)) == pytest.approx(hard, abs=1e-3)


def test_rc14_plot_temperature_zero(scorer):
    pytest.importorskip("matplotlib")
    from bsloss import plot_example

    for temperature in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            plot_example("a dog", "a cat", scorer=scorer, temperature=temperature)


@pytest.mark.parametrize(
    "cand, ref, name",
    [("", "a dog", "candidate"), ("a dog", "  ", "reference"), ("[CLS]", "a dog", "candidate")],
)
def test_rc15_plot_empty_text(scorer, cand, ref, name):
    pytest.importorskip("matplotlib")
    from bsloss import plot_example

    # "[CLS]" is neither empty nor whitespace: the message says why it has no token
    with pytest.raises(ValueError, match=f"{name} has no token to draw: .* special tokens"):
        plot_example(cand, ref, scorer=scorer)
    with pytest.raises(TypeError, match="candidate must be a string"):
        plot_example(None, ref, scorer=scorer)


@pytest.fixture(scope="module")
def every_layer_scorer():
    """The embedded scorer with ``all_layers=True``, rescaled (its P/R/F are ``[7, N]``)."""
    import bsloss

    return bsloss.BERTScorer(device="cpu", all_layers=True, rescale_with_baseline=True)


def test_all_layers_scorer_draws_its_num_layers_layer(every_layer_scorer, tmp_path):
    """With ``all_layers`` the heatmap and the title are those of layer ``num_layers``.

    Before: ``pair_similarity`` summed the 7 layers' cosines (max 6.875) and the title's
    ``.item()`` on a ``[7, 1]`` score crashed (``a Tensor with 7 elements cannot be converted
    to Scalar``), through the method and through ``plot_example(scorer=)``."""
    import bsloss

    cand, ref = "the cat sat", "a cat was sitting"
    one_layer = bsloss.BERTScorer(device="cpu", rescale_with_baseline=True)
    sim, cand_tokens, ref_tokens = pair_similarity(every_layer_scorer, cand, ref)
    expected, expected_c, expected_r = pair_similarity(one_layer, cand, ref)
    assert (cand_tokens, ref_tokens) == (expected_c, expected_r)
    assert (sim - expected).abs().max().item() < 1e-5 and sim.max().item() <= 1 + 1e-6
    figure = every_layer_scorer.plot_example(cand, ref, fname=str(tmp_path / "layers.png"))
    assert (tmp_path / "layers.png").stat().st_size > 10_000
    hard = [x.item() for x in one_layer.score([cand], [ref])]
    assert title_scores(figure) == pytest.approx(hard, abs=1e-3)
    assert hard[2] < 0.9  # rescaled: the layer's baseline, not the raw cosine scores
    soft = plot_example(cand, ref, scorer=every_layer_scorer, temperature=0.5)
    expected_soft = title_scores(plot_example(cand, ref, scorer=one_layer, temperature=0.5))
    assert title_scores(soft) == pytest.approx(expected_soft, abs=1e-3)


def test_saving_a_plot_leaves_the_matplotlib_backend_alone(scorer, tmp_path):
    """Saving to a file keeps the process's backend and opens no pyplot figure.

    Before: ``draw_pair`` called ``matplotlib.use("Agg")`` whenever ``fname`` was given: a
    notebook's ``module://matplotlib_inline.backend_inline`` became ``Agg``."""
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")
        open_figures = plt.get_fignums()
        plot_example("a cat sat", "the cat sits", scorer=scorer, fname=tmp_path / "kept.png")
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == open_figures  # a file-only figure is not kept by pyplot
        assert (tmp_path / "kept.png").stat().st_size > 10_000
        scorer.plot_example("a cat sat", "the cat sits", fname=str(tmp_path / "method.pdf"))
        assert matplotlib.get_backend() == "svg" and (tmp_path / "method.pdf").exists()
    finally:
        matplotlib.use(before)
