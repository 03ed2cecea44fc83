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
FEW = settings(FUZZ, max_examples=5)  # the properties whose examples cost seconds each
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
# (hypothesis's default alphabet leaves out lone surrogates: the corruptions add them)
good_texts = st.one_of(words, st.text(max_size=12))
reference_groups = st.one_of(good_texts, st.lists(good_texts, min_size=1, max_size=3))


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


@settings(FUZZ, max_examples=8)
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


# Each corruption turns valid (cands, refs) into bad input, and names the argument at fault.
METRIC_CORRUPTIONS = {
    "cands-string": (lambda c, r: ("".join(c) or "x", r), "cands"),
    "refs-string": (lambda c, r: (c, "ab"), "refs"),
    "cands-none": (lambda c, r: (None, r), "cands"),
    "cand-int": (lambda c, r: ([*c[:-1], 7], r), "cands["),
    "cand-surrogate": (lambda c, r: ([*c[:-1], "a \ud800"], r), "cands["),
    "ref-surrogate": (lambda c, r: (c, [*r[:-1], ["ok", "\udfff b"]]), "refs["),
    "ref-bytes": (lambda c, r: (c, [*r[:-1], b"abc"]), "refs["),
    "ref-empty-group": (lambda c, r: (c, [*r[:-1], []]), "refs["),
    "ref-in-group-none": (lambda c, r: (c, [*r[:-1], ["a", None]]), "refs["),
    "lengths": (lambda c, r: (c, r[:-1]), "refs"),
    "cands-tensor": (lambda c, r: (torch.zeros(len(c)), r), "cands"),
}


@pytest.mark.parametrize("corruption", sorted(METRIC_CORRUPTIONS))
@settings(FUZZ, max_examples=3)
@given(pairs=st.lists(st.tuples(good_texts, reference_groups), min_size=1, max_size=3))
def test_metric_bad_input_named_and_state_unchanged(cached_scorer, corruption, pairs):
    corrupt, name = METRIC_CORRUPTIONS[corruption]
    cands, refs = corrupt([c for c, _ in pairs], [r for _, r in pairs])
    good = cached_scorer.score(["a dog runs"], ["the dog sleeps"])
    cache = list(cached_scorer._reference_cache)
    with pytest.raises((TypeError, ValueError)) as error:
        cached_scorer.score(cands, refs)
    assert name in str(error.value), str(error.value)
    assert list(cached_scorer._reference_cache) == cache
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
def loss_inputs(draw, kind: str, vocab: int, hidden: int):
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, 5))
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


@pytest.mark.parametrize("kind", ["logits", "probs", "candidate_ids", "embeddings"])
@settings(FUZZ, max_examples=3)
@given(data=st.data(), matching=st.sampled_from(sorted(MATCHINGS)))
def test_loss_every_input_kind_and_matching(losses, scorer, kind, data, matching):
    vocab = scorer.encoder.input_embeddings.num_embeddings
    kind, x, mask, target = data.draw(loss_inputs(kind, vocab, scorer.encoder.hidden_size))
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


def _set(inputs: dict, **changes) -> dict:
    out = {k: v for k, v in inputs.items() if k not in changes}
    out.update({k: v for k, v in changes.items() if v is not None})
    return out


def _with_value(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[0] = value
    return x


# Each corruption turns a valid call of the loss into a bad one (``None``: the call is valid,
# e.g. an empty batch or float64 logits, and must give finite values), naming the argument.
LOSS_CORRUPTIONS = {
    "logits-rank": (lambda i, v: _set(i, logits=i["logits"][0]), "logits"),
    "logits-long": (lambda i, v: _set(i, logits=i["logits"].long()), "logits"),
    "logits-list": (lambda i, v: _set(i, logits=i["logits"].tolist()), "logits"),
    "logits-nan": (lambda i, v: _set(i, logits=_with_value(i["logits"], float("nan"))), "logits"),
    "logits-inf": (lambda i, v: _set(i, logits=_with_value(i["logits"], float("inf"))), "logits"),
    "logits-vocab": (lambda i, v: _set(i, logits=i["logits"][..., :-1]), "logits"),
    "logits-and-probs": (lambda i, v: _set(i, probs=i["logits"].softmax(-1)), "probs"),
    "nothing": (lambda i, v: _set(i, logits=None) | {}, "logits"),
    "probs-negative": (
        lambda i, v: {**_set(i, logits=None), "probs": -i["logits"].softmax(-1)},
        "probs",
    ),
    "ids-float": (
        lambda i, v: {**_set(i, logits=None), "candidate_ids": i["logits"].argmax(-1).float()},
        "candidate_ids",
    ),
    "ids-outside": (
        lambda i, v: {**_set(i, logits=None), "candidate_ids": i["logits"].argmax(-1) + v},
        "candidate_ids",
    ),
    "embeddings-width": (
        lambda i, v: {**_set(i, logits=None), "embeddings": i["logits"][..., :7]},
        "embeddings",
    ),
    "mask-shape": (
        lambda i, v: _set(i, candidate_mask=i["candidate_mask"][:, :-1]),
        "candidate_mask",
    ),
    "mask-float": (
        lambda i, v: _set(i, candidate_mask=i["candidate_mask"].float()),
        "candidate_mask",
    ),
    "references-string": (lambda i, v: _set(i, references="ab"), "references"),
    "references-length": (lambda i, v: _set(i, references=[*i["references"], "x"]), "references"),
    "references-surrogate": (
        lambda i, v: _set(i, references=[*i["references"][:-1], "\ud800"]),
        "references[",
    ),
    "references-empty-group": (
        lambda i, v: _set(i, references=[*i["references"][:-1], []]),
        "references[",
    ),
    "references-and-ids": (
        lambda i, v: _set(i, reference_ids=torch.full((len(i["references"]), 3), 101)),
        "reference_ids",
    ),
    "reference-ids-outside": (
        lambda i, v: {
            **_set(i, references=None),
            "reference_ids": torch.full((len(i["references"]), 3), v),
        },
        "reference_ids",
    ),
    "reference-ids-float": (
        lambda i, v: {
            **_set(i, references=None),
            "reference_ids": torch.ones(len(i["references"]), 3),
        },
        "reference_ids",
    ),
    "reference-mask-shape": (
        lambda i, v: {
            **_set(i, references=None),
            "reference_ids": torch.full((len(i["references"]), 3), 101),
            "reference_mask": torch.ones(1, 2, dtype=torch.bool),
        },
        "reference_mask",
    ),
    # valid edge cases
    "empty-batch": (
        lambda i, v: _set(
            i, logits=i["logits"][:0], candidate_mask=i["candidate_mask"][:0], references=[]
        ),
        None,
    ),
    "float64-logits": (lambda i, v: _set(i, logits=i["logits"].double()), None),
    "long-padding": (
        lambda i, v: _set(
            i,
            logits=torch.cat([i["logits"], i["logits"][:, :1].expand(-1, 600, -1)], dim=1),
            candidate_mask=torch.cat(
                [i["candidate_mask"], torch.zeros(len(i["references"]), 600, dtype=torch.bool)],
                dim=1,
            ),
        ),
        None,
    ),
}


@pytest.fixture(scope="module")
def good_loss_call(losses, scorer):
    """A valid call and its value: every later call must still give it."""
    vocab = scorer.encoder.input_embeddings.num_embeddings
    good = {"logits": torch.zeros(1, 2, vocab), "references": ["a dog"]}
    return good, losses["softmax"](**good)


@pytest.mark.parametrize("corruption", sorted(LOSS_CORRUPTIONS))
@settings(FUZZ, max_examples=2)
@given(
    batch=st.integers(1, 3),
    length=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    offset=st.integers(0, 10**6),
    data=st.data(),
)
def test_loss_bad_input_named_and_state_unchanged(
    losses, scorer, good_loss_call, corruption, batch, length, seed, offset, data
):
    vocab = scorer.encoder.input_embeddings.num_embeddings
    loss = losses["softmax"]
    generator = torch.Generator().manual_seed(seed)
    valid = {
        "logits": torch.randn(batch, length, vocab, generator=generator),
        "candidate_mask": torch.ones(batch, length, dtype=torch.bool),
        "references": data.draw(st.lists(reference_groups, min_size=batch, max_size=batch)),
    }
    good, before = good_loss_call
    cache = list(loss.reference_cache)
    corrupt, name = LOSS_CORRUPTIONS[corruption]
    inputs = corrupt(valid, vocab + offset)
    with quiet():
        if name is None:
            value = loss(**inputs)
            assert value.shape == (inputs["logits"].shape[0],)
            assert torch.isfinite(value).all()
        else:
            with pytest.raises((TypeError, ValueError)) as error:
                loss(**inputs)
            assert name in str(error.value), str(error.value)
            assert list(loss.reference_cache) == cache
    torch.testing.assert_close(loss(**good), before)


# ----------------------------------------------------------------------------- the reward
# a small pool: completions and references repeat across calls, so calls whose texts are all
# cached (or were just evicted) are common
pool = st.sampled_from(["Yes", "No", "a dog", "", "the cat sat on the mat", "No."])


@FUZZ
@given(
    calls=st.lists(
        st.lists(
            st.tuples(pool, st.one_of(pool, st.lists(pool, min_size=1, max_size=2))),
            min_size=1,
            max_size=3,
        ),
        min_size=1,
        max_size=4,
    ),
    cache_size=st.integers(1, 3),
)
def test_reward_matches_the_plain_scorer_call_after_call(scorer, calls, cache_size):
    """A reward with a tiny cache (evicting all the time) scores every call as the plain,
    uncached scorer does: no state carries over wrongly between calls."""
    plain = BERTScorer(encoder=scorer.encoder)
    reward = BERTScoreReward(scorer=plain, reference_cache_size=cache_size)
    with quiet():
        for pairs in calls:
            completions = [c for c, _ in pairs]
            references = [r for _, r in pairs]
            got = reward(completions=completions, reference=references)
            want = plain.score(completions, references)[2].tolist()
            assert got == pytest.approx(want, abs=TOLERANCE)
            assert len(reward.scorer._reference_cache) <= cache_size
    assert plain.reference_cache_size == 0 and len(plain._reference_cache) == 0


REWARD_CORRUPTIONS = {
    "completions-string": (lambda c, r: ("".join(c) or "x", r), "completions"),
    "reference-string": (lambda c, r: (c, "ab"), "reference"),
    "completion-int": (lambda c, r: ([*c[:-1], 3], r), "completions["),
    "completion-surrogate": (lambda c, r: ([*c[:-1], "\ud800"], r), "completions["),
    "chat-content-int": (
        lambda c, r: ([*c[:-1], [{"role": "a", "content": 5}]], r),
        "completions[",
    ),
    "reference-none": (lambda c, r: (c, [*r[:-1], None]), "reference["),
    "reference-empty-group": (lambda c, r: (c, [*r[:-1], []]), "reference["),
    "lengths": (lambda c, r: (c, [*r, "x"]), "reference"),
}


@pytest.mark.parametrize("corruption", sorted(REWARD_CORRUPTIONS))
@settings(FUZZ, max_examples=2)
@given(pairs=st.lists(st.tuples(pool, pool), min_size=1, max_size=3))
def test_reward_bad_input_named(scorer, corruption, pairs):
    reward = BERTScoreReward(scorer=scorer)
    corrupt, name = REWARD_CORRUPTIONS[corruption]
    completions, references = corrupt([c for c, _ in pairs], [r for _, r in pairs])
    with pytest.raises((TypeError, ValueError)) as error:
        reward(completions=completions, reference=references)
    assert name in str(error.value), str(error.value)


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


@FEW
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
