"""Property-based fuzzing of the public API (issue 13): BERTScorer / score, the loss with every
input kind and matching, the reward and the vocabulary bridge; and (issue 22) the fused LM-head
path with every option (equal to the dense path on the same logits), the bridge with the fused
pass and a damaged cache file, and the trainer integration's BERTScoreTerm; and (issue 43)
seq2seq models through BERTScoreTrainerMixin, fused equal to dense.

Properties, for any input hypothesis draws:
- good input: finite scores and finite gradients, batch invariance (a sample scores the same
  alone as in a batch) and order invariance (a permuted batch gives permuted scores);
- bad input: only ``TypeError``/``ValueError``, whose message names the argument;
- a failed call changes no state: the caches hold what they held, and the next good call gives
  what it gave before.

Examples are derandomised (the same in every run, so CI cannot flake) and few per property: the
whole file runs in about a minute and a half on a 2-core CPU.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bsloss import BERTScoreLoss, BERTScorer, BERTScoreReward
from bsloss.functional.matching import SHORTHANDS

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
        for matching in SHORTHANDS
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
@given(data=st.data(), matching=st.sampled_from(sorted(SHORTHANDS)))
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


# ----------------------------------------------------------------------------- the fused path
@st.composite
def fused_inputs(draw, vocab: int):
    """Hidden states ``[B, L, d]``, an LM head ``[V, d]`` (and bias), a mask, references, and
    the fused pass's options: top-k, straight-through, temperature, soft-cap, targets."""
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    width = draw(st.sampled_from([8, 16]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    scale = draw(st.sampled_from([0.3, 3.0, 30.0]))
    hidden = torch.randn(batch, length, width, generator=generator) * scale
    weight = torch.randn(vocab, width, generator=generator) / width**0.5
    mask = torch.rand(batch, length, generator=generator) < draw(st.floats(0.4, 1.0))
    options = {
        "top_k": draw(st.sampled_from([None, 2, 7])),
        "straight_through": draw(st.booleans()),
        "generator_temperature": draw(st.sampled_from([None, 0.5, 2.0])),
        "logit_softcap": draw(st.sampled_from([None, 5.0, 30.0])),
        "targets": draw(st.booleans()),
    }
    references = draw(st.lists(reference_groups, min_size=batch, max_size=batch))
    return hidden, weight, mask, options, references


def _fused_call(loss, hidden, weight, mask, options, references, rows=None):
    rows = list(range(hidden.shape[0])) if rows is None else rows
    call = {
        "hidden_states": hidden[rows],
        "output_embeddings": weight,
        "candidate_mask": mask[rows],
        "references": [references[i] for i in rows],
        "generator_temperature": options["generator_temperature"],
        "logit_softcap": options["logit_softcap"],
    }
    if options["targets"]:
        targets = torch.arange(hidden.shape[0] * hidden.shape[1]).reshape(hidden.shape[:2])
        call["target_ids"] = (targets * 7919 % weight.shape[0])[rows]
    return call


def _fused_loss(encoder, options, **extra) -> BERTScoreLoss:
    return BERTScoreLoss(
        encoder=encoder,
        top_k=options["top_k"],
        straight_through=options["straight_through"],
        reduction="none",
        **extra,
    )


@FEW
@given(data=st.data())
def test_fused_path_finite_invariant_and_equal_to_the_dense_path(scorer, data):
    """hidden_states + the LM head, with every option of the pass: finite values and
    gradients, batch and order invariance, and the dense path's value on the same logits."""
    vocab = scorer.encoder.input_embeddings.num_embeddings
    hidden, weight, mask, options, refs = data.draw(fused_inputs(vocab))
    loss = _fused_loss(scorer.encoder, options)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with quiet():
        out = loss(**_fused_call(loss, hidden, weight, mask, options, refs))
        value = out.loss if options["targets"] else out
        assert value.shape == (hidden.shape[0],) and torch.isfinite(value).all()
        total = value.sum() + (out.cross_entropy.sum() if options["targets"] else 0)
        total.backward()
        assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
        h, w = hidden.detach(), weight.detach()
        # the same distributions as logits: soft-capped, then divided by the temperature
        logits = h @ w.T
        if options["logit_softcap"] is not None:
            logits = torch.tanh(logits / options["logit_softcap"]) * options["logit_softcap"]
        logits = logits / (options["generator_temperature"] or 1.0)
        dense = loss(logits=logits, candidate_mask=mask, references=refs)
        torch.testing.assert_close(value.detach(), dense, atol=2e-4, rtol=0)
        order = data.draw(st.permutations(range(h.shape[0])))
        permuted = loss(**_fused_call(loss, h, w, mask, options, refs, rows=list(order)))
        permuted = permuted.loss if options["targets"] else permuted
        torch.testing.assert_close(permuted, value.detach()[list(order)], atol=1e-4, rtol=0)
        i = data.draw(st.integers(0, h.shape[0] - 1))
        alone = loss(**_fused_call(loss, h, w, mask, options, refs, rows=[i]))
        alone = alone.loss if options["targets"] else alone
        torch.testing.assert_close(alone[0], value.detach()[i], atol=1e-4, rtol=0)


def _nan_at(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[x.numel() // 2] = value
    return x


# Each corruption of a valid fused call, and the argument its error must name.
FUSED_CORRUPTIONS = {
    "weight-nan": (lambda c: {**c, "output_embeddings": _nan_at(c["output_embeddings"], math.nan)},
                   "hidden_states["),
    "weight-inf": (lambda c: {**c, "output_embeddings": _nan_at(c["output_embeddings"], math.inf)},
                   "hidden_states["),
    "hidden-nan": (lambda c: {**c, "hidden_states": _nan_at(c["hidden_states"], math.nan)},
                   "hidden_states"),
    "fp16-overflow": (lambda c: {**c, "hidden_states": (c["hidden_states"] * 3000).half(),
                                 "output_embeddings": (c["output_embeddings"] * 3000).half()},
                      "hidden_states["),
    "temperature-tiny": (lambda c: {**c, "generator_temperature": 1e-45}, "generator_temperature"),
    "temperature-bool": (lambda c: {**c, "generator_temperature": True}, "generator_temperature"),
    "temperature-zero": (lambda c: {**c, "generator_temperature": 0.0}, "generator_temperature"),
    "softcap-inf": (lambda c: {**c, "logit_softcap": math.inf}, "logit_softcap"),
    "softcap-string": (lambda c: {**c, "logit_softcap": "30"}, "logit_softcap"),
    "weight-integer": (lambda c: {**c, "output_embeddings": c["output_embeddings"].long()},
                       "output_embeddings"),
    "weight-width": (lambda c: {**c, "output_embeddings": c["output_embeddings"][:, :-1]},
                     "output_embeddings"),
    "weight-vocab": (lambda c: {**c, "output_embeddings": c["output_embeddings"][:-1]},
                     "output_embeddings"),
    "no-head": (lambda c: {k: v for k, v in c.items() if k != "output_embeddings"},
                "output_embeddings"),
    "targets-shape": (lambda c: {**c, "target_ids": torch.zeros(1, dtype=torch.long)},
                      "target_ids"),
    "targets-outside": (lambda c: {**c, "target_ids": torch.full(c["hidden_states"].shape[:2],
                                                                  10**7)}, "target_ids"),
    "temperature-with-logits": (
        lambda c: {"logits": c["hidden_states"] @ c["output_embeddings"].T,
                   "references": c["references"], "generator_temperature": 2.0},
        "generator_temperature",
    ),
    "softcap-with-ids": (
        lambda c: {"candidate_ids": torch.zeros(c["hidden_states"].shape[:2], dtype=torch.long),
                   "references": c["references"], "logit_softcap": 30.0},
        "logit_softcap",
    ),
}  # fmt: skip


@pytest.mark.parametrize("corruption", sorted(FUSED_CORRUPTIONS))
@settings(FUZZ, max_examples=2)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), length=st.integers(1, 4))
def test_fused_bad_input_named_and_state_unchanged(
    losses, scorer, good_loss_call, corruption, seed, batch, length
):
    vocab = scorer.encoder.input_embeddings.num_embeddings
    loss = losses["softmax"]
    generator = torch.Generator().manual_seed(seed)
    valid = {
        "hidden_states": torch.randn(batch, length, 8, generator=generator),
        "output_embeddings": torch.randn(vocab, 8, generator=generator),
        "references": ["a dog runs"] * batch,
    }
    good, before = good_loss_call
    cache = list(loss.reference_cache)
    corrupt, name = FUSED_CORRUPTIONS[corruption]
    with quiet(), pytest.raises((TypeError, ValueError)) as error:
        loss(**corrupt(valid))
    assert name in str(error.value), str(error.value)
    assert list(loss.reference_cache) == cache
    torch.testing.assert_close(loss(**good), before)


# ----------------------------------------------------------------------------- the bridge, fused
@FEW
@given(data=st.data())
def test_bridge_fused_retokenize_scores_the_decoded_argmax(bridge_loss, data):
    """Fused path x top-k / straight-through x bridge_mode='retokenize': the scored text is the
    decoded argmax of h W^T (every variant of the pass tracks it), values and gradients are
    finite, and a row scores the same alone as in the batch."""
    tokenizer = bridge_loss.retokenizer.generator_tokenizer
    vocab = bridge_loss.generator_vocab_size
    hidden, weight, mask, options, refs = data.draw(fused_inputs(vocab))
    loss = _fused_loss(bridge_loss.encoder, options, bridge=bridge_loss.bridge,
                       generator_tokenizer=tokenizer)  # fmt: skip
    assert loss.bridge_mode == "retokenize"
    hidden.requires_grad_(True)
    with quiet():
        out = loss(**_fused_call(loss, hidden, weight, mask, options, refs))
        value = out.loss if options["targets"] else out
        assert torch.isfinite(value).all()
        value.sum().backward()
        assert torch.isfinite(hidden.grad).all()
        argmax = (hidden.detach() @ weight.T).argmax(-1)
        want = [tokenizer.decode(row[keep].tolist(), skip_special_tokens=True)
                for row, keep in zip(argmax, mask, strict=True)]  # fmt: skip
        assert loss.last_texts == want
        i = data.draw(st.integers(0, hidden.shape[0] - 1))
        alone = loss(**_fused_call(loss, hidden.detach(), weight, mask, options, refs, rows=[i]))
        alone = alone.loss if options["targets"] else alone
        torch.testing.assert_close(alone[0], value.detach()[i], atol=1e-4, rtol=0)


@FUZZ
@given(
    damage=st.one_of(
        st.tuples(st.just("truncate"), st.floats(0, 0.999)),
        st.tuples(st.just("flip"), st.integers(0, 2**16)),
        st.tuples(st.just("garbage"), st.binary(max_size=64)),
    )
)
def test_bridge_cache_damage_is_rebuilt(bridge_loss, tmp_path_factory, damage):
    """Whatever happens to the cache file (cut short, bytes flipped, replaced), the next build
    gives the same bridge (rebuilt with a warning naming the file, or loaded where the damage
    missed everything that is read) and leaves a valid file behind."""
    from bsloss import VocabularyBridge

    tokenizer = bridge_loss.retokenizer.generator_tokenizer
    folder = tmp_path_factory.mktemp("fuzz-cache")
    want = VocabularyBridge.build(tokenizer, bridge_loss.encoder, cache_dir=folder)
    (path,) = folder.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    kind, how = damage
    if kind == "truncate":
        data = data[: int(len(data) * how)]
    elif kind == "flip":
        generator = torch.Generator().manual_seed(how)
        for at in torch.randint(0, len(data), (4,), generator=generator).tolist():
            data[at] ^= 0xFF
    else:
        data = bytearray(how)
    path.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = VocabularyBridge.build(tokenizer, bridge_loss.encoder, cache_dir=folder)
    said = [str(w.message) for w in caught]
    assert all(path.name in m for m in said), said
    for name in ("offsets", "flat", "special"):  # flipped bytes fail the file's sha256
        assert torch.equal(getattr(got, name), getattr(want, name)), (name, said)
    VocabularyBridge.load(path, scorer_vocab_size=len(bridge_loss.encoder.tokenizer))


# ----------------------------------------------------------------------------- the trainer term
@pytest.fixture(scope="module")
def term_parts(scorer):
    from _models import scorer_vocabulary_tokenizer

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    return BERTScoreLoss(encoder=scorer.encoder), tokenizer


@st.composite
def term_batches(draw, vocab: int):
    batch, length = draw(st.integers(1, 3)), draw(st.integers(2, 6))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    logits = torch.randn(batch, length, vocab, generator=generator) * draw(
        st.sampled_from([1.0, 10.0])
    )
    labels = torch.randint(1000, 3000, (batch, length), generator=generator)
    start = torch.randint(0, length + 1, (batch,), generator=generator)  # a prompt of -100
    labels[torch.arange(length)[None] < start[:, None]] = -100
    return logits, labels, draw(st.booleans())


@FEW
@given(data=st.data())
def test_term_finite_order_invariant_and_metrics_apart(term_parts, data):
    """BERTScoreTerm on any micro-batch (rows without completion tokens included): a finite
    loss and gradient, the same loss for permuted rows, micro-batches that add up to the whole
    batch, and training / evaluation metrics recorded apart."""
    from bsloss.integrations.huggingface import BERTScoreTerm

    loss, tokenizer = term_parts
    vocab = len(tokenizer)
    logits, labels, causal = data.draw(term_batches(vocab))
    term = BERTScoreTerm(loss, tokenizer, weight=0.5, causal=causal)
    logits.requires_grad_(True)
    with quiet():
        whole = term({"logits": logits}, labels)
        assert torch.isfinite(whole)
        whole.backward()
        assert torch.isfinite(logits.grad).all()
        order = list(data.draw(st.permutations(range(len(labels)))))
        permuted = term({"logits": logits.detach()[order]}, labels[order])
        torch.testing.assert_close(permuted, whole.detach(), atol=1e-5, rtol=1e-5)
        shift = 1 if causal else 0
        total = max(int((labels[:, shift:] != -100).sum()), 1)
        parts = sum(
            term({"logits": logits.detach()[i : i + 1]}, labels[i : i + 1], total)
            for i in range(len(labels))
        )
        torch.testing.assert_close(parts, whole.detach(), atol=1e-5, rtol=1e-5)
        # a batch without a completion token has no CE to average: its key is left out,
        # never a 0 or a NaN standing for one
        has_tokens = bool((labels[:, shift:] != -100).any())
        train = term.pop_metrics()
        assert set(train) <= {"ce", "bertscore_f", "bertscore_loss"}
        assert ("ce" in train) == has_tokens
        with torch.no_grad():
            term({"logits": logits.detach()}, labels)
        assert term.pop_metrics() == {}
        assert ("ce" in term.pop_metrics(training=False)) == has_tokens


TERM_CORRUPTIONS = {
    "labels-none": (lambda o, y: (o, None, None), "labels"),
    "labels-shape": (lambda o, y: (o, y[:, :-1], None), "labels"),
    "references-length": (lambda o, y: (o, y, ["a"] * (len(y) + 1)), "references"),
    "reference-int": (lambda o, y: (o, y, [3] * len(y)), "references["),
}


@pytest.mark.parametrize("corruption", sorted(TERM_CORRUPTIONS))
@settings(FUZZ, max_examples=2)
@given(data=st.data())
def test_term_bad_input_named_and_state_unchanged(term_parts, corruption, data):
    from bsloss.integrations.huggingface import BERTScoreTerm

    loss, tokenizer = term_parts
    logits, labels, causal = data.draw(term_batches(len(tokenizer)))
    labels[:, -1] = 1000  # every row has a completion token to score
    term = BERTScoreTerm(loss, tokenizer, causal=causal)
    good = term({"logits": logits}, labels)
    decoded, metrics = dict(term._decoded), term.pop_metrics()
    corrupt, name = TERM_CORRUPTIONS[corruption]
    outputs, bad_labels, references = corrupt({"logits": logits}, labels)
    with quiet(), pytest.raises((TypeError, ValueError)) as error:
        term(outputs, bad_labels, references=references)
    assert name in str(error.value), str(error.value)
    assert term.pop_metrics() == {} and dict(term._decoded) == decoded
    torch.testing.assert_close(term({"logits": logits}, labels), good)
    assert term.pop_metrics() == pytest.approx(metrics)


# ------------------------------------------- the model's answers whatever the padding id
ANSWER_TOKENS = ["cat", "sat", "the", "[PAD]", "[MASK]", "[SEP]"]  # [SEP]: the end token


@FEW
@given(data=st.data())
def test_answers_are_the_same_whatever_the_padding_id(term_parts, data):
    """Any generated answers (end tokens anywhere or nowhere, padding ids inside them) and any
    prompt lengths give, whether the tokenizer pads with the end token (GPT-2 / Qwen style),
    [PAD] or [MASK]: each answered row's candidate is its tokens up to and including its first
    end token (or max_new_tokens of them), at least one, right after its prompt, fed back as
    generated and attended, padding after; the same candidates and inputs for every padding."""
    import copy

    from _models import scripted

    from bsloss.integrations.candidates import GreedyAnswers

    _, tokenizer = term_parts
    ids = tokenizer.convert_tokens_to_ids(ANSWER_TOKENS)
    eos = tokenizer.sep_token_id
    rows = data.draw(st.integers(1, 3))
    answers = [
        data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=6)) for _ in range(rows)
    ]
    prompts = [
        data.draw(st.lists(st.sampled_from(ids[:3]), min_size=1, max_size=4)) for _ in range(rows)
    ]
    references = [data.draw(st.lists(st.sampled_from(ids[:3]), max_size=3)) for _ in range(rows)]
    limit = data.draw(st.integers(1, 6))
    # as generate lays answers out: a row without an end token ran to max_new_tokens (a shorter
    # one would be followed by padding that pad = eos reads as its end)
    answers = [a if eos in a[:limit] else (a + [ids[0]] * limit)[:limit] for a in answers]
    expected = []
    for answer in answers:
        answer = answer[:limit]
        expected.append(answer[: answer.index(eos) + 1] if eos in answer else answer)
    results = []
    for pad_token in ("[SEP]", "[PAD]", "[MASK]"):
        padded = copy.deepcopy(tokenizer)
        padded.pad_token = pad_token
        width = max(len(p) + len(r) for p, r in zip(prompts, references, strict=True))
        pad = padded.pad_token_id
        input_ids = torch.tensor(
            [
                p + r + [pad] * (width - len(p) - len(r))
                for p, r in zip(prompts, references, strict=True)
            ]
        )
        attention_mask = torch.ones_like(input_ids)
        for i, (p, r) in enumerate(zip(prompts, references, strict=True)):
            attention_mask[i, len(p) + len(r) :] = 0
        labels = torch.tensor(
            [[-100] * len(p) + r + [-100] * (width - len(p) - len(r))
             for p, r in zip(prompts, references, strict=True)]
        )  # fmt: skip
        model = scripted(torch.nn.Module(), answers)
        joint = GreedyAnswers(max_new_tokens=limit).answer(
            model, {"input_ids": input_ids, "attention_mask": attention_mask}, labels,
            causal=True, pad_token_id=pad, eos_token_ids=[eos],
        )  # fmt: skip
        own_ids = joint.inputs["input_ids"][rows:]
        own_mask = joint.inputs["attention_mask"][rows:]
        for i, (prompt, answer) in enumerate(zip(prompts, expected, strict=True)):
            span = slice(len(prompt), len(prompt) + len(answer))
            assert own_ids[i, : span.stop].tolist() == prompt + answer, pad_token
            assert own_mask[i].sum() == span.stop and own_mask[i, : span.stop].all()
            got = joint.candidate_labels[i]
            if references[i]:
                assert got[span].tolist() == answer and len(answer) >= 1
                assert (got[: span.start] == -100).all() and (got[span.stop :] == -100).all()
            else:  # a row without a reference scores nothing
                assert (got == -100).all()
        results.append((joint.candidate_labels, own_ids.masked_fill(own_mask == 0, -1)))
    for labels_, inputs_ in results[1:]:
        assert torch.equal(labels_, results[0][0]) and torch.equal(inputs_, results[0][1])


# ------------------------------------------------------------------ user-defined term weights
# what a user's TermWeight returns: a good number, a bad one (NaN, Inf, negative), or a tensor
# with a gradient, of the CE and term it is passed (a rule without .detach()) or of its own
WEIGHT_RESULTS = {
    "good-number": st.floats(0, 1e6, width=32),
    "bad-number": st.one_of(
        st.sampled_from([math.nan, math.inf, -math.inf]), st.floats(-1e6, -0.5, width=32)
    ),
    "of-inputs": st.just(None),
    "own-parameter": st.floats(0, 10, width=32),
}


@pytest.mark.parametrize("kind", sorted(WEIGHT_RESULTS))
@settings(FUZZ, max_examples=2)
@given(data=st.data())
def test_term_with_user_defined_weights(term_parts, kind, data):
    """A user's TermWeight: a good result gives the loss and gradient of Fixed(that value),
    no gradient reaching the CE and term through it nor the rule's own tensor; a bad one a
    ValueError naming the rule's class and the value, nothing recorded, the next call
    unaffected."""
    from bsloss.integrations.huggingface import BERTScoreTerm
    from bsloss.integrations.term_weights import Fixed, TermWeight

    loss, tokenizer = term_parts
    logits, labels, causal = data.draw(term_batches(len(tokenizer)))
    number = data.draw(WEIGHT_RESULTS[kind])
    scale = torch.tensor(number or 0.0, requires_grad=True)

    class UserWeight(TermWeight):
        def __call__(self, ce, term):
            if kind == "of-inputs":  # written without .detach()
                return (ce + term) / 2
            if kind == "own-parameter":
                return scale * (1 + term)
            return number

    if kind == "bad-number":
        term = BERTScoreTerm(loss, tokenizer, weight=UserWeight(), causal=causal)
        with quiet(), pytest.raises(ValueError, match="term weight UserWeight returned") as caught:
            term({"logits": logits}, labels)
        assert f"returned {number!r}" in str(caught.value), str(caught.value)
        assert term.pop_metrics() == {}
        term.weight = 1.0
        with quiet():
            assert torch.isfinite(term({"logits": logits}, labels))
        return

    def step(weight):
        x = logits.clone().requires_grad_(True)
        term = BERTScoreTerm(loss, tokenizer, weight=weight, causal=causal)
        with quiet():
            value = term({"logits": x}, labels)
        value.backward()
        return value.detach(), x.grad, term.pop_metrics()

    value, grad, metrics = step(UserWeight())
    # the weight is logged where it weighs a term: on a batch with no scored row there is none,
    # and any Fixed weight gives that batch's loss (the CE alone)
    assert ("bertscore_weight" in metrics) == ("bertscore_f" in metrics), metrics
    want_value, want_grad, _ = step(Fixed(metrics.get("bertscore_weight", 1.0)))
    torch.testing.assert_close(value, want_value, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert scale.grad is None


# ----------------------------------------------------------------------------- seq2seq + mixin
SEQ2SEQ_MODELS = [("t5gemma", 2.0), ("t5gemma", None), ("t5", None), ("bart", None)]


@pytest.fixture(scope="module")
def seq2seq_trainers(term_parts, tmp_path_factory):
    """A Seq2SeqTrainer with the BERTScore mixin per tiny model (the scorer's vocabulary; a
    T5Gemma with its soft-cap in the decoder's config, and without), built on first use."""
    import transformers
    from _models import tiny_seq2seq

    from bsloss.integrations.huggingface import BERTScoreTrainerMixin

    class Trainer(BERTScoreTrainerMixin, transformers.Seq2SeqTrainer):
        pass

    loss, tokenizer = term_parts
    built = {}

    def trainer(kind: str, softcap: float | None):
        if (kind, softcap) not in built:
            model = tiny_seq2seq(kind, len(tokenizer), softcap=softcap)
            if softcap is not None:
                with torch.no_grad():  # logits of a few units, which a soft-cap of 2 bends
                    model.get_output_embeddings().weight.mul_(10.0)
            args = transformers.Seq2SeqTrainingArguments(
                output_dir=str(tmp_path_factory.mktemp("fuzz-seq2seq")), report_to=[],
                use_cpu=True, save_strategy="no",
            )  # fmt: skip
            built[kind, softcap] = Trainer(model=model, args=args, processing_class=tokenizer,
                                           bertscore_loss=loss)  # fmt: skip
        return built[kind, softcap]

    return trainer


@FEW
@given(data=st.data())
def test_seq2seq_mixin_fused_equals_dense(seq2seq_trainers, data):
    """A seq2seq model's training step through BERTScoreTrainerMixin (the decoder inputs built
    from the labels, the fused path by default: lm_head_inputs, then BERTScoreTerm's chunked
    pass) gives the dense step's loss and every gradient, whatever the batch, the padding, the
    weight and the model (T5Gemma with and without its decoder-config soft-cap, T5, BART)."""
    from bsloss.integrations.term_weights import Balanced, Fixed

    kind, softcap = data.draw(st.sampled_from(SEQ2SEQ_MODELS))
    trainer = seq2seq_trainers(kind, softcap)
    model = trainer.model.train()
    assert trainer.bertscore_fused
    batch, source, length = (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5)),
                             data.draw(st.integers(1, 6)))  # fmt: skip
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    input_ids = torch.randint(1000, 3000, (batch, source), generator=generator)
    attention_mask = torch.ones(batch, source, dtype=torch.long)
    labels = torch.randint(1000, 3000, (batch, length), generator=generator)
    for row in range(batch):  # padding at the ends: -100 after the completion
        attention_mask[row, data.draw(st.integers(1, source)) :] = 0
        labels[row, data.draw(st.integers(0, length)) :] = -100
    weights = st.sampled_from([Fixed(0.5), Fixed(2.0), Balanced(1.0)])
    trainer.bertscore_term.weight = data.draw(weights)

    def step(fused: bool):
        trainer.bertscore_fused = fused
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks in both passes
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        with quiet():
            value = trainer.compute_loss(model, inputs)
        value.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return value.detach(), grads

    fused_value, fused_grads = step(True)
    dense_value, dense_grads = step(False)
    trainer.bertscore_fused = True
    assert torch.isfinite(dense_value)
    torch.testing.assert_close(fused_value, dense_value, atol=TOLERANCE, rtol=0)
    assert fused_grads.keys() == dense_grads.keys() and dense_grads
    for name, grad in dense_grads.items():
        # (float32: the two passes sum in another order, off by ~1e-6 of the gradient's size)
        torch.testing.assert_close(
            fused_grads[name], grad, atol=TOLERANCE, rtol=TOLERANCE, msg=name
        )
