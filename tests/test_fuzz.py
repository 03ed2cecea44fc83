"""Property-based fuzzing of the public API (issue 13): BERTScorer / score, the loss with every
input kind and matching, the reward and the vocabulary bridge.

Properties, for any input hypothesis draws:
- good input: finite scores and finite gradients, batch invariance (a sample scores the same
  alone as in a batch) and order invariance (a permuted batch gives permuted scores);
- bad input: only ``TypeError``/``ValueError``, whose message names the argument;
- a failed call changes no state: the caches hold what they held, and the next good call gives
  what it gave before.

Examples are derandomised (the same in every run, so CI cannot flake) and few per property: the
whole file runs in about a minute on a 2-core CPU.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bsloss import BERTScoreLoss, BERTScorer, BERTScoreReward
from bsloss.functional import MATCHINGS

FUZZ = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TOLERANCE = 1e-5
WORDS = ["the", "a", "dog", "cat", "runs", "sleeps", "on", "mat", "red", "big", "river", "old"]

# text: words, punctuation, spaces, accents, emoji, CJK, control characters; sometimes empty
words = st.lists(
    st.one_of(
        st.sampled_from(WORDS),
        st.sampled_from([".", ",", "!", "  ", "\t", "café", "☕", "東京", "\x00", "\u200b"]),
    ),
    max_size=8,
).map(" ".join)
# (hypothesis's default alphabet leaves out lone surrogates: those are in ``junk``)
good_texts = st.one_of(words, st.text(max_size=12))
reference_groups = st.one_of(good_texts, st.lists(good_texts, min_size=1, max_size=3))

# bad input: anything that is not a list of valid strings
junk = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    st.binary(max_size=4),
    st.just("a string"),
    st.just("a \ud800 surrogate"),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.just(torch.zeros(2)),
)


@contextlib.contextmanager
def quiet():
    """Silence the empty-text and truncation warnings that the drawn texts give."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def assert_names_argument(error: Exception, names: tuple[str, ...]) -> None:
    message = str(error)
    assert any(name in message for name in names), message


# ----------------------------------------------------------------------------- the metric
@pytest.fixture(scope="module")
def cached_scorer(scorer) -> BERTScorer:
    return BERTScorer(encoder=scorer.encoder, reference_cache_size=3)


@FUZZ
@given(pairs=st.lists(st.tuples(good_texts, reference_groups), max_size=5), data=st.data())
def test_metric_finite_batch_and_order_invariant_cache_consistent(
    scorer, cached_scorer, pairs, data
):
    cands = [c for c, _ in pairs]
    refs = [r for _, r in pairs]
    with quiet():
        p, r, f = scorer.score(cands, refs)
        cached = cached_scorer.score(cands, refs)  # its cache carries over between examples
        for got in (p, r, f):
            assert got.shape == (len(pairs),) and torch.isfinite(got).all()
            assert (got.abs() <= 1 + 1e-5).all()
        for got, want in zip(cached, (p, r, f), strict=True):
            torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=0)
        if not pairs:
            return
        order = data.draw(st.permutations(range(len(pairs))))
        permuted = scorer.score([cands[i] for i in order], [refs[i] for i in order])
        for got, want in zip(permuted, (p, r, f), strict=True):
            torch.testing.assert_close(got, want[list(order)], atol=TOLERANCE, rtol=0)
        i = data.draw(st.integers(0, len(pairs) - 1))
        alone = scorer.score([cands[i]], [refs[i]])
        for got, want in zip(alone, (p, r, f), strict=True):
            torch.testing.assert_close(got[0], want[i], atol=TOLERANCE, rtol=0)


@FUZZ
@given(cands=st.one_of(junk, st.lists(st.one_of(good_texts, junk), max_size=3)), refs=st.data())
def test_metric_bad_input_named_and_state_unchanged(cached_scorer, cands, refs):
    refs = refs.draw(st.one_of(junk, st.lists(st.one_of(reference_groups, junk), max_size=3)))
    good = cached_scorer.score(["a dog runs"], ["the dog sleeps"])
    cache = list(cached_scorer._reference_cache)
    try:
        with quiet():
            result = cached_scorer.score(cands, refs)
    except (TypeError, ValueError) as error:
        assert_names_argument(error, ("cands", "refs"))
        assert list(cached_scorer._reference_cache) == cache
    else:
        assert all(torch.isfinite(x).all() for x in result)
    again = cached_scorer.score(["a dog runs"], ["the dog sleeps"])
    for x, y in zip(again, good, strict=True):
        torch.testing.assert_close(x, y, atol=TOLERANCE, rtol=0)


@FUZZ
@given(
    batch_size=st.one_of(st.integers(-3, 3), st.floats(-2, 2), st.booleans(), st.none()),
    chunk_size=st.one_of(st.integers(-3, 3), st.just(1.0)),
)
def test_metric_numbers(scorer, batch_size, chunk_size):
    try:
        variant = BERTScorer(encoder=scorer.encoder, chunk_size=chunk_size)
        got = variant.score(["a dog", "a cat"], ["the dog", "the cat"], batch_size=batch_size)
    except (TypeError, ValueError) as error:
        assert_names_argument(error, ("batch_size", "chunk_size"))
    else:
        want = scorer.score(["a dog", "a cat"], ["the dog", "the cat"])
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, atol=TOLERANCE, rtol=0)


# ----------------------------------------------------------------------------- the loss
@pytest.fixture(scope="module")
def losses(scorer) -> dict[str, BERTScoreLoss]:
    return {
        matching: BERTScoreLoss(
            encoder=scorer.encoder, matching=matching, temperature=0.1, reduction="none"
        )
        for matching in MATCHINGS
    }


@st.composite
def loss_inputs(draw, vocab: int, hidden: int):
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, 5))
    kind = draw(st.sampled_from(["logits", "probs", "candidate_ids", "embeddings"]))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=generator) < draw(st.floats(0.3, 1.0))
    if kind == "logits":
        scale = draw(st.sampled_from([1.0, 30.0, 1e4]))
        x = torch.randn(batch, length, vocab, generator=generator) * scale
    elif kind == "probs":
        x = torch.rand(batch, length, vocab, generator=generator)
        x = torch.where(x > 0.999, x, torch.zeros_like(x))  # sparse, some rows all zero
    elif kind == "candidate_ids":
        x = torch.randint(0, vocab, (batch, length), generator=generator)
    else:
        x = torch.randn(batch, length, hidden, generator=generator)
    if kind != "candidate_ids":
        x.requires_grad_(True)
    if draw(st.booleans()):
        references = draw(st.lists(reference_groups, min_size=batch, max_size=batch))
        target = {"references": references}
    else:
        ref_length = draw(st.integers(1, 6))
        ids = torch.randint(1000, vocab, (batch, ref_length), generator=generator)
        ids[:, 0], ids[:, -1] = 101, 102
        target = {"reference_ids": ids}
    return kind, x, mask, target


def _inputs(kind, x, mask, target, rows=None):
    rows = list(range(x.shape[0])) if rows is None else rows
    picked = {key: value for key, value in target.items()}
    if "references" in picked:
        picked["references"] = [picked["references"][i] for i in rows]
    else:
        picked["reference_ids"] = picked["reference_ids"][rows]
    return {kind: x[rows], "candidate_mask": mask[rows], **picked}


@FUZZ
@given(data=st.data(), matching=st.sampled_from(sorted(MATCHINGS)))
def test_loss_every_input_kind_and_matching(losses, scorer, data, matching):
    vocab = scorer.encoder.input_embeddings.num_embeddings
    kind, x, mask, target = data.draw(loss_inputs(vocab, scorer.encoder.hidden_size))
    loss = losses[matching]
    with quiet():
        value = loss(**_inputs(kind, x, mask, target))
        assert value.shape == (x.shape[0],) and torch.isfinite(value).all()
        if x.requires_grad:
            value.sum().backward()
            assert torch.isfinite(x.grad).all()
        batch = x.shape[0]
        order = data.draw(st.permutations(range(batch)))
        permuted = loss(**_inputs(kind, x.detach(), mask, target, rows=list(order)))
        torch.testing.assert_close(permuted, value.detach()[list(order)], atol=1e-4, rtol=0)
        i = data.draw(st.integers(0, batch - 1))
        alone = loss(**_inputs(kind, x.detach(), mask, target, rows=[i]))
        torch.testing.assert_close(alone[0], value.detach()[i], atol=1e-4, rtol=0)


@FUZZ
@given(data=st.data())
def test_loss_bad_tensors_named_and_state_unchanged(losses, scorer, data):
    vocab = scorer.encoder.input_embeddings.num_embeddings
    loss = losses["softmax"]
    good = {"logits": torch.zeros(1, 2, vocab), "references": ["a dog"]}
    before = loss(**good)
    cache = list(loss.reference_cache)
    kind = data.draw(st.sampled_from(["logits", "probs", "candidate_ids", "embeddings"]))
    shape = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.long, torch.bool]))
    bad = torch.zeros(*shape, dtype=dtype)
    if dtype.is_floating_point and bad.numel() and data.draw(st.booleans()):
        bad.view(-1)[0] = data.draw(st.sampled_from([float("nan"), float("inf"), -1.0, 1e9]))
    extra = data.draw(
        st.sampled_from(
            [
                {},
                {"candidate_mask": torch.ones(2, 2)},
                {"candidate_mask": torch.ones(5, 5, dtype=torch.bool)},
                {"probs": torch.zeros(1, 2, vocab)},
            ]
        )
    )
    if kind in extra:
        extra = {}
    refs = data.draw(
        st.one_of(
            st.just({"references": ["a"] * (shape[0] if shape else 1)}),
            st.just({"references": "ab"}),
            st.just({"reference_ids": torch.full((shape[0], 3), vocab + 1)}),
            st.just({"reference_ids": torch.ones(shape[0], 3)}),
        )
    )
    names = (kind, "candidate_mask", "references", "reference_ids", "probs", "candidates")
    try:
        with quiet():
            value = loss(**{kind: bad}, **extra, **refs)
    except (TypeError, ValueError) as error:
        assert_names_argument(error, names)
        assert list(loss.reference_cache) == cache
    else:
        assert torch.isfinite(value).all()
    torch.testing.assert_close(loss(**good), before)


# ----------------------------------------------------------------------------- the reward
@FUZZ
@given(
    calls=st.lists(
        st.lists(st.tuples(good_texts, reference_groups), min_size=1, max_size=3),
        min_size=1,
        max_size=3,
    )
)
def test_reward_matches_the_plain_scorer_call_after_call(scorer, calls):
    """A reward with a tiny cache (evicting all the time) scores every call as the plain,
    uncached scorer does: no state carries over wrongly between calls."""
    reward = BERTScoreReward(scorer=BERTScorer(encoder=scorer.encoder), reference_cache_size=2)
    with quiet():
        for pairs in calls:
            completions = [c for c, _ in pairs]
            references = [r for _, r in pairs]
            got = reward(completions=completions, reference=references)
            want = scorer.score(completions, references)[2].tolist()
            assert got == pytest.approx(want, abs=TOLERANCE)
            assert len(reward.scorer._reference_cache) <= 2
    assert scorer.reference_cache_size == 0 and len(scorer._reference_cache) == 0


@FUZZ
@given(completions=st.one_of(junk, st.lists(junk, min_size=1, max_size=2)), refs=st.data())
def test_reward_bad_input_named(scorer, completions, refs):
    reward = BERTScoreReward(scorer=scorer)
    refs = refs.draw(st.one_of(junk, st.lists(junk, min_size=1, max_size=2)))
    try:
        with quiet():
            got = reward(completions=completions, reference=refs)
    except (TypeError, ValueError) as error:
        assert_names_argument(error, ("completions", "reference"))
    else:
        assert all(isinstance(x, float) for x in got)


# ----------------------------------------------------------------------------- the bridge
@pytest.fixture(scope="module")
def bridge_loss(scorer, tmp_path_factory):
    from _tokenizers import brown_lines, train_sentencepiece_bpe

    tokenizer = train_sentencepiece_bpe(
        brown_lines(3000), tmp_path_factory.mktemp("fuzz-sp"), vocab_size=800
    )
    return BERTScoreLoss(
        encoder=scorer.encoder, generator_tokenizer=tokenizer, reduction="none", temperature=0.1
    )


@FUZZ
@given(data=st.data())
def test_bridge_loss_finite_and_batch_invariant(bridge_loss, data):
    vocab = bridge_loss.generator_vocab_size
    batch = data.draw(st.integers(1, 3))
    length = data.draw(st.integers(1, 5))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    refs = data.draw(st.lists(reference_groups, min_size=batch, max_size=batch))
    if data.draw(st.booleans()):
        x = (torch.randn(batch, length, vocab, generator=generator) * 5).requires_grad_(True)
        inputs = {"logits": x}
    else:
        x = torch.randint(0, vocab, (batch, length), generator=generator)
        inputs = {"candidate_ids": x}
    with quiet():
        value = bridge_loss(**inputs, references=refs)
        assert torch.isfinite(value).all()
        if x.requires_grad:
            value.sum().backward()
            assert torch.isfinite(x.grad).all()
        i = data.draw(st.integers(0, batch - 1))
        one = {key: value[i : i + 1].detach() for key, value in inputs.items()}
        alone = bridge_loss(**one, references=[refs[i]])
        torch.testing.assert_close(alone[0], value.detach()[i], atol=1e-4, rtol=0)
        bad = x.detach().clone()
        if x.dtype == torch.long:
            bad[0, 0] = vocab + data.draw(st.integers(0, 5))
            with pytest.raises(ValueError, match="candidate_ids has ids outside"):
                bridge_loss(candidate_ids=bad, references=refs)
        else:
            with pytest.raises(ValueError, match="logits has a vocabulary"):
                bridge_loss(logits=bad[..., :-1], references=refs)
