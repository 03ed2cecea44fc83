"""Round 9: the remaining flags of the public boundary are checked as bools (a truth test read
the string ``"false"`` as true: ``verbose="false"`` printed, ``distributed="no"`` split the
pairs), each named."""

from __future__ import annotations

import pytest
import torch

import bsloss
from bsloss.integrations.huggingface import bertscore_compute_metrics
from bsloss.metric import get_hash


@pytest.mark.parametrize("flag", ["use_fast_tokenizer", "compile", "distributed"])
def test_scorer_flags_are_bools(encoder, flag):
    with pytest.raises(TypeError, match=rf"{flag} must be a bool \(or 0, 1\), got 'false'"):
        bsloss.BERTScorer(encoder=encoder, **{flag: "false"})


@pytest.mark.parametrize("flag", ["verbose", "progress"])
def test_score_flags_are_bools(encoder, flag, capsys):
    scorer = bsloss.BERTScorer(encoder=encoder)
    with pytest.raises(TypeError, match=rf"{flag} must be a bool \(or 0, 1\), got 'false'"):
        scorer.score(["a cat"], ["the cat"], **{flag: "false"})
    assert "calculating scores" not in capsys.readouterr().out  # refused before it printed
    with pytest.raises(TypeError, match=r"progress must be a bool \(or 0, 1\), got 'no'"):
        scorer.embed(["a cat"], progress="no")
    # None (a bar only on a terminal), bools, numpy bools and 0 / 1 still pass
    for value in (None, False, 0):
        assert scorer.score(["a cat"], ["a cat"], progress=value)[2][0] > 0.99


def test_the_functional_score_checks_its_flags():
    for flag in ("verbose", "use_fast_tokenizer", "distributed", "progress"):
        with pytest.raises(TypeError, match=rf"{flag} must be a bool"):
            bsloss.score(["a cat"], ["the cat"], **{flag: "no"})


def test_get_hash_flags_are_bools():
    assert get_hash("roberta-large", 17, 0, True, False, False).startswith(
        "roberta-large_L17_no-idf"
    )
    for position, flag in enumerate(
        ("idf", "rescale_with_baseline", "use_custom_baseline", "use_fast_tokenizer")
    ):
        flags = [False] * 4
        flags[position] = "no"
        with pytest.raises(TypeError, match=rf"{flag} must be a bool"):
            get_hash("roberta-large", 17, *flags)


def test_compute_metrics_flags_are_bools(encoder):
    scorer = bsloss.BERTScorer(encoder=encoder)
    tokenizer = scorer.encoder.tokenizer
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        bertscore_compute_metrics(tokenizer, scorer, causal="no")
    with pytest.raises(TypeError, match=r"teacher_forced must be a bool"):
        bertscore_compute_metrics(tokenizer, scorer, teacher_forced="no")


# ------------------------------------------------ audit h11: the side entry points


@pytest.mark.parametrize(
    "settings",
    [
        {"num_layers": 3},
        {"lang": "en"},
        {"rescale_with_baseline": True},
        {"baseline_path": "b.tsv"},
        {"model_type": "roberta-large"},
        {"use_fast_tokenizer": True},
    ],
)
def test_plot_example_refuses_scorer_settings_beside_a_scorer(encoder, settings):
    """``plot_example(c, r, scorer, 3)`` (bert_score's order, a scorer for model_type) drew
    layer 6 and titled it with layer 6's P/R/F; ``rescale_with_baseline=True`` beside
    ``scorer=`` drew unrescaled scores: every scorer setting beside a scorer was unused,
    silently."""
    pytest.importorskip("matplotlib")
    scorer = bsloss.BERTScorer(encoder=encoder)
    name = next(iter(settings))
    with pytest.raises(TypeError, match=rf"plot_example: {name}=.* is a setting of the scorer"):
        bsloss.plot_example("a cat", "the cat", scorer=scorer, **settings)
    if name != "model_type":  # the scorer in model_type's place, as bert_score's order has it
        with pytest.raises(TypeError, match=rf"{name}=.* is a setting of the scorer"):
            bsloss.plot_example("a cat", "the cat", scorer, **settings)
    with pytest.raises(TypeError, match=r"scorer must be a BERTScorer, got str"):
        bsloss.plot_example("a cat", "the cat", scorer="all-mpnet-base-v2")


def test_baseline_pairs_never_pair_a_line_with_its_copy():
    """Repeated lines were paired with their own copies (F = 1, the baseline pulled up: 0.2035
    instead of 0.1833 with one sentence 10 times in 49 lines), and a corpus of one repeated
    sentence wrote a baseline of 1.0 that bsloss then refuses. A corpus without repeats draws
    as before (the shipped baselines reproduce)."""
    from bsloss.baseline_estimation import random_pairs

    corpus = ["a cat sat", "a cat sat ", "the dog ran", "rain again"]
    cands, refs = random_pairs(corpus, 200, seed=0)
    assert all(c.strip() != r.strip() for c, r in zip(cands, refs, strict=True))
    distinct = [f"sentence {i}" for i in range(30)]
    assert random_pairs(distinct, 50, seed=3) == random_pairs(distinct, 50, seed=3)
    import random

    rng = random.Random(3)  # the draw without repeats: rng.sample as before
    expected = [tuple(rng.sample(range(30), 2)) for _ in range(50)]
    cands, refs = random_pairs(distinct, 50, seed=3)
    assert [
        (distinct.index(c), distinct.index(r)) for c, r in zip(cands, refs, strict=True)
    ] == expected
    with pytest.raises(ValueError, match="at least two distinct non-empty sentences"):
        random_pairs(["same line", "same line", " same line "], 5, seed=0)


def test_the_baseline_command_counts_distinct_lines(tmp_path, capsys):
    from bsloss.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("same line\nsame line\n\nsame line\n")
    assert main(["baseline", "--corpus", str(corpus), "-o", str(tmp_path / "b.tsv")]) == 2
    assert "1 distinct non-empty line(s)" in capsys.readouterr().err


def test_a_baseline_file_with_a_byte_order_mark_is_read(tmp_path):
    """Excel and Notepad save UTF-8 with a byte-order mark; bert_score reads such a file,
    bsloss refused it (its header did not match)."""
    from bsloss.baseline import read_baseline

    path = tmp_path / "baseline.csv"
    rows = "".join(f"{layer},0.8{layer},0.7{layer},0.75\n" for layer in range(7))
    path.write_text("\ufeffLAYER,P,R,F\n" + rows, encoding="utf-8")
    assert read_baseline(path, 6).tolist() == [0.86, 0.76, 0.75]
    # a line of spaces at the end, which pandas (bert_score) skips (audit h29: "the layer
    # [' '] is not a number")
    path.write_text("LAYER,P,R,F\n" + rows + "   \n", encoding="utf-8")
    assert read_baseline(path, 6).tolist() == [0.86, 0.76, 0.75]


def test_plot_without_an_extension_names_the_file_it_wrote(tmp_path):
    """``bsloss plot -o NAME`` wrote NAME.png (matplotlib adds the extension) and printed
    ``wrote NAME``."""
    pytest.importorskip("matplotlib")
    from bsloss.plot import check_image_path

    assert check_image_path(tmp_path / "figure") == tmp_path / "figure.png"
    assert check_image_path(tmp_path / "figure.pdf") == tmp_path / "figure.pdf"


def test_compute_baseline_is_one_pass_equal_to_a_scorer_per_layer():
    """One ``all_layers`` pass (was: one scorer per layer, 1 + 2 + ... + L layer passes, 3.7x
    the time on MiniLM) gives each layer's mean P, R, F as that layer's own scorer does."""
    from bsloss.baseline_estimation import compute_baseline, random_pairs

    corpus = ["a cat sat on the mat", "the dog ran home", "rain fell all day", "we met at noon"]
    table = compute_baseline(corpus, num_pairs=6, seed=1)
    assert table.shape == (7, 3) and table.dtype == torch.float64
    cands, refs = random_pairs(corpus, 6, seed=1)
    for layer in (0, 3, 6):
        p, r, f = bsloss.BERTScorer(num_layers=layer, device="cpu").score(cands, refs)
        expected = torch.stack([p.double().mean(), r.double().mean(), f.double().mean()])
        torch.testing.assert_close(table[layer], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model", ["roberta-large", "./no-such-scorer-folder"])
def test_every_scorer_entry_point_explains_an_unloadable_name(model, monkeypatch):
    """``compute_baseline`` (``bsloss baseline -m``) and ``bsloss.utils.get_tokenizer`` gave
    transformers' raw error offline ("We couldn't connect to 'https://huggingface.co'") or for
    a mistyped folder ("Repo id must use alphanumeric chars"), where ``BERTScorer`` explains
    it."""
    from bsloss.baseline_estimation import compute_baseline
    from bsloss.utils import get_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    explained = r"could not load scorer model .* it is not a local folder"
    with pytest.raises(OSError, match=explained):
        compute_baseline(["a b", "c d"], model=model, num_pairs=2)
    with pytest.raises(OSError, match=explained):
        get_tokenizer(model)


# ------------------------------------------------ audit h13: where the loss's options meet


def _padded_ids(encoder, texts, side, width=None):
    tokens = [encoder.tokenizer(t)["input_ids"] for t in texts]
    width = width or max(map(len, tokens))
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.bool)
    for row, t in enumerate(tokens):
        where = slice(0, len(t)) if side == "right" else slice(width - len(t), width)
        ids[row, where], mask[row, where] = torch.tensor(t), True
    return ids, mask


@pytest.mark.parametrize("width", [None, 600])
def test_left_padded_reference_ids_score_as_their_text(encoder, width):
    """``reference_ids`` padded on the left (``padding_side="left"``, decoder-only pipelines)
    were encoded at shifted positions: a reference's loss 0.4369 where its text, its
    right-padded ids and the metric give 0.3817; and a left-padded batch wider than 512 columns
    of short rows was refused as "tokens past position 512"."""
    refs = ["a cat is on the mat", "the dog runs"]
    cands = ["the cat sat on the mat", "a dog ran in the park"]
    ids, mask = _padded_ids(encoder, cands, "right")
    logits = 8.0 * torch.nn.functional.one_hot(ids, encoder.input_embeddings.num_embeddings)
    logits = logits.float().requires_grad_()
    loss = bsloss.BERTScoreLoss(encoder, reduction="none")
    by_text = loss(bsloss.Logits(logits), refs, candidate_mask=mask)
    (text_grad,) = torch.autograd.grad(by_text.sum(), logits)
    for side in ("right", "left"):
        ref_ids, ref_mask = _padded_ids(encoder, refs, side, width)
        by_ids = loss(
            bsloss.Logits(logits), candidate_mask=mask, reference_ids=ref_ids,
            reference_mask=ref_mask,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(by_ids.sum(), logits)
        torch.testing.assert_close(by_ids, by_text, rtol=0, atol=1e-6)
        torch.testing.assert_close(grad, text_grad, rtol=0, atol=1e-7)


# ------------------------------------------------ audit h12: several processes


def test_the_same_inputs_check_tells_every_different_input_apart():
    """``distributed=True`` compares a digest of each process's inputs; its fields were joined
    by ``\\0`` / ``\\1`` / ``\\2``, which texts may hold: a group of two references and their
    ``\\1``-joined single reference, or ``["a\\0b"] / ["c"]`` and ``["a"] / ["b\\0c"]``, passed
    the check, and a process got scores for pairs it did not pass."""
    from bsloss.metric import _inputs_digest

    pairs = [
        ((["x"], [["a cat was on the mat", "rain fell all day"]]),
         (["x"], [["a cat was on the mat\x01rain fell all day"]])),
        ((["a\x00b"], [["c"]]), (["a"], [["b\x00c"]])),
        ((["a", "b"], [["c"], ["d"]]), (["a"], [["c", "b"]])),
    ]  # fmt: skip
    for one, other in pairs:
        assert _inputs_digest(*one) != _inputs_digest(*other), (one, other)
        assert _inputs_digest(*one) == _inputs_digest(*one)


def test_baseline_pairs_take_an_integer_seed():
    """``random.Random`` takes any hashable: ``seed="0"`` drew other pairs than ``seed=0`` and
    ``seed=None`` different ones at every call, silently."""
    from bsloss.baseline_estimation import random_pairs

    corpus = [f"sentence {i}" for i in range(10)]
    for seed in ("0", None, 1.0, True):
        with pytest.raises(TypeError, match="seed must be an integer"):
            random_pairs(corpus, 3, seed=seed)
    assert random_pairs(corpus, 3, seed=7) == random_pairs(corpus, 3, seed=7)


@pytest.mark.parametrize("layers", [["0", "1.7", "2"], ["0", "1", "1"], ["1", "0", "2"]])
def test_a_baseline_files_layers_go_in_order(tmp_path, layers):
    """bert_score reads a layer's row by its position; bsloss keyed rows by the LAYER value, so
    a layer "1.7" read as layer 1 and a second row for a layer replaced the first, silently."""
    from bsloss.baseline import read_baseline

    path = tmp_path / "baseline.csv"
    rows = "".join(f"{layer},0.8{i},0.7{i},0.75\n" for i, layer in enumerate(layers))
    path.write_text("LAYER,P,R,F\n" + rows)
    with pytest.raises(ValueError, match=r"line \d: the layer .* is not \d, this row's place"):
        read_baseline(path, 2)
