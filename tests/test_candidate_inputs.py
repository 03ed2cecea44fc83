"""The loss's inputs as values (bsloss.candidate_inputs, bsloss.bridge.Bridge): each typed input
gives what its deprecated keyword gave, the keywords warn naming their replacement, bad values
are refused where they are built, and the constructor takes at most 13 parameters."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import bsloss
from bsloss import (
    BERTScoreLoss,
    Bridge,
    Embeddings,
    Gumbel,
    LMHeadInputs,
    Logits,
    Probabilities,
    StraightThrough,
    TokenIds,
    TopK,
    VocabularyBridge,
)
from bsloss.integrations.lm_head import LMHead
from bsloss.loss import _DEPRECATED_INIT

REFS = ["a cat sat on the mat", "the weather is cold today"]


@pytest.fixture(scope="module")
def encoder(scorer):
    return scorer.encoder


@pytest.fixture(scope="module")
def loss(encoder):
    return BERTScoreLoss(encoder, reduction="none")


def _old(fn, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(**kwargs)


def test_constructor_takes_at_most_13_parameters():
    parameters = inspect.signature(BERTScoreLoss.__init__).parameters.values()
    named = [p for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD]
    assert len(named) <= 13, [p.name for p in named]


def _inputs(encoder, seed=0):
    generator = torch.Generator().manual_seed(seed)
    vocab, width = encoder.input_embeddings.num_embeddings, encoder.hidden_size
    logits = torch.randn(2, 5, vocab, generator=generator)
    return {
        "logits": logits,
        "probs": torch.softmax(logits, dim=-1),
        "candidate_ids": torch.randint(1000, 2000, (2, 5), generator=generator),
        "embeddings": torch.randn(2, 5, width, generator=generator),
    }


@pytest.mark.parametrize(
    ("keyword", "typed"),
    [
        ("logits", Logits),
        ("logits", lambda x: x),  # the bare tensor: logits
        ("probs", Probabilities),
        ("candidate_ids", TokenIds),
        ("embeddings", Embeddings),
    ],
)
def test_each_typed_input_equals_its_keyword(loss, encoder, keyword, typed):
    value = _inputs(encoder)[keyword]
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    new = loss(typed(value), REFS, candidate_mask=mask)
    old = _old(loss, **{keyword: value}, candidate_mask=mask, references=REFS)
    torch.testing.assert_close(new, old, rtol=0, atol=0)
    new_prf = loss.score(typed(value), REFS, candidate_mask=mask)
    old_prf = _old(loss.score, **{keyword: value}, candidate_mask=mask, references=REFS)
    for a, b in zip(new_prf, old_prf, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _head(encoder, seed=1):
    generator = torch.Generator().manual_seed(seed)
    vocab = encoder.input_embeddings.num_embeddings
    hidden = torch.randn(2, 4, 8, generator=generator, requires_grad=True)
    return hidden, torch.randn(vocab, 8, generator=generator)


def test_lm_head_inputs_equal_the_keywords_and_carry_the_softcap(loss, encoder):
    hidden, weight = _head(encoder)
    old = _old(
        loss,
        hidden_states=hidden,
        output_embeddings=weight,
        logit_softcap=3.0,
        generator_temperature=0.7,
        references=REFS,
    )
    new = loss(LMHeadInputs(hidden, weight, softcap=3.0, temperature=0.7), REFS)
    torch.testing.assert_close(new, old, rtol=0, atol=0)
    head = LMHead(weight, None, 3.0)
    carried = head.inputs(hidden, temperature=0.7)
    assert carried.softcap == 3.0 and carried.head is head
    torch.testing.assert_close(loss(carried, REFS), old, rtol=0, atol=0)
    # an LMHead's soft-cap is taken when none is given; without one, none is applied
    torch.testing.assert_close(loss(LMHeadInputs(hidden, head, temperature=0.7), REFS), old)
    uncapped = loss(LMHeadInputs(hidden, weight, temperature=0.7), REFS)
    assert not torch.allclose(uncapped, old)


def test_cross_entropy_methods_equal_the_old_calls(encoder):
    loss = BERTScoreLoss(encoder)
    hidden, weight = _head(encoder)
    targets = torch.tensor([[5, 6, -100, 7], [8, 9, 10, -100]])
    old = _old(
        loss, hidden_states=hidden, output_embeddings=weight, target_ids=targets, references=REFS
    )
    new = loss.loss_and_cross_entropy(LMHeadInputs(hidden, weight), targets, REFS)
    assert type(new) is type(old)
    for a, b in zip(new, old, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    prf, ce = loss.score_and_cross_entropy(LMHeadInputs(hidden, weight), targets, REFS)
    old_prf, old_ce = _old(
        loss.score_and_cross_entropy,
        hidden_states=hidden,
        output_embeddings=weight,
        target_ids=targets,
        references=REFS,
    )
    torch.testing.assert_close(ce, old_ce, rtol=0, atol=0)
    torch.testing.assert_close(prf.f1, old_prf.f1, rtol=0, atol=0)
    # forward has one return type: a tensor
    assert isinstance(loss(LMHeadInputs(hidden, weight), REFS), torch.Tensor)


@pytest.mark.parametrize(
    ("keyword", "replacement"),
    [
        ("logits", r"forward\(logits=\.\.\.\) is deprecated: pass the tensor itself"),
        ("probs", r"pass Probabilities\(x\)"),
        ("candidate_ids", r"pass TokenIds\(x\)"),
        ("embeddings", r"pass Embeddings\(x\)"),
        ("hidden_states", r"pass LMHeadInputs\(hidden_states, head, softcap=\.\.\."),
    ],
)
def test_candidate_keywords_warn_naming_the_replacement(loss, encoder, keyword, replacement):
    hidden, weight = _head(encoder)
    given = {**_inputs(encoder), "hidden_states": hidden}
    extra = {"output_embeddings": weight} if keyword == "hidden_states" else {}
    with pytest.warns(DeprecationWarning, match=replacement):
        loss(**{keyword: given[keyword]}, **extra, references=REFS)


def test_forward_target_ids_warns_naming_loss_and_cross_entropy(encoder):
    loss = BERTScoreLoss(encoder)
    hidden, weight = _head(encoder)
    with pytest.warns(DeprecationWarning, match="loss_and_cross_entropy"):
        loss(
            LMHeadInputs(hidden, weight),
            REFS,
            target_ids=torch.zeros(2, 4, dtype=torch.long),
        )


@pytest.mark.parametrize("name", sorted(_DEPRECATED_INIT))
def test_constructor_keywords_warn_naming_the_replacement(encoder, name):
    value = {
        "encoder": encoder,
        "temperature": 0.1,
        "sinkhorn_iterations": 2,
        "baseline_path": None,
        "generator_tokenizer": encoder.tokenizer,
        "bridge_cache_dir": None,
        "bridge_mode": "average",
        "top_k": 4,
        "straight_through": True,
        "gumbel_temperature": 0.5,
        "device": "cpu",
    }[name]
    extra = {} if name == "encoder" else {"model": encoder}
    if name == "sinkhorn_iterations":
        extra["matching"] = "sinkhorn"
    with pytest.warns(DeprecationWarning, match=rf"BERTScoreLoss\({name}=\.\.\.\)") as caught:
        BERTScoreLoss(**extra, **{name: value})
    message = str(next(w.message for w in caught if name in str(w.message)))
    assert _DEPRECATED_INIT[name] in message


def test_constructor_replacements_equal_the_old_keywords(encoder):
    old = _old(
        BERTScoreLoss,
        encoder=encoder,
        matching="sinkhorn",
        temperature=0.1,
        sinkhorn_iterations=2,
        top_k=8,
        straight_through=True,
        gumbel_temperature=0.5,
    )
    new = BERTScoreLoss(
        encoder,
        matching=bsloss.Sinkhorn(temperature=0.1, iterations=2),
        candidate_transforms=[TopK(8), StraightThrough(), Gumbel(0.5)],
    )
    assert new.matching == old.matching and new.candidates == old.candidates
    assert new.encoder is old.encoder


def test_bridge_object_equals_the_bridge_keywords(encoder):
    size = len(encoder.tokenizer)
    pieces = torch.arange(size)[:, None].roll(1, dims=0)
    vocabulary = VocabularyBridge(pieces)
    old = _old(BERTScoreLoss, encoder=encoder, bridge=vocabulary, bridge_mode="average")
    new = BERTScoreLoss(encoder, bridge=Bridge(vocabulary=vocabulary, mode="average"))
    shorthand = BERTScoreLoss(encoder, bridge=vocabulary)
    assert old.bridge_mode == new.bridge_mode == shorthand.bridge_mode == "average"
    ids = torch.randint(1000, 2000, (2, 5))
    expected = _old(old, candidate_ids=ids, references=REFS)
    torch.testing.assert_close(new(TokenIds(ids), REFS), expected, rtol=0, atol=0)
    torch.testing.assert_close(shorthand(TokenIds(ids), REFS), expected, rtol=0, atol=0)
    # the generator's tokenizer: the shorthand of Bridge(tokenizer) (here the identity)
    by_tokenizer = BERTScoreLoss(encoder, bridge=encoder.tokenizer)
    assert by_tokenizer.bridge is not None and by_tokenizer.bridge.identity


def test_bad_values_are_refused_naming_the_argument(loss, encoder):
    with pytest.raises(ValueError, match=r"logits must be \[B, L, V\], got shape \[2, 5\]"):
        Logits(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="candidate_ids must have an integer dtype"):
        TokenIds(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="probs must be a torch.Tensor, got list"):
        Probabilities([[0.5, 0.5]])
    with pytest.raises(ValueError, match=r"embeddings must be \[B, L, d\]"):
        Embeddings(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="needs output_embeddings"):
        LMHeadInputs(torch.zeros(1, 2, 8), None)
    # named as the object's own arguments, not the loss's deprecated keywords (audit h31)
    with pytest.raises(ValueError, match=r"LMHeadInputs\(softcap\) must be a finite number > 0"):
        LMHeadInputs(torch.zeros(1, 2, 8), torch.zeros(4, 8), softcap=float("inf"))
    with pytest.raises(ValueError, match=r"LMHeadInputs\(temperature\) must be a finite number"):
        LMHeadInputs(torch.zeros(1, 2, 8), torch.zeros(4, 8), temperature=0)
    with pytest.raises(TypeError, match=r"Bridge\(tokenizer\) must be a Hugging Face tokenizer"):
        Bridge("gpt2")
    with pytest.raises(TypeError, match="candidates must be a torch.Tensor .logits. or one of"):
        loss("a cat", REFS)
    with pytest.raises(ValueError, match="exactly one of .* .got candidates, probs."):
        _old(loss, candidates=torch.zeros(2, 3, 4), probs=torch.zeros(2, 3, 4), references=REFS)
    with pytest.raises(TypeError, match="unexpected keyword argument 'logit'"):
        loss(torch.zeros(2, 3, 4), REFS, logit=1)
    with pytest.raises(TypeError, match="BERTScoreLoss.. got an unexpected keyword argument"):
        BERTScoreLoss(encoder, tempreature=0.1)
    with pytest.raises(ValueError, match="Bridge needs the generator's tokenizer"):
        Bridge(mode="average")
    with pytest.raises(TypeError, match="bridge must be a Hugging Face tokenizer"):
        BERTScoreLoss(encoder, bridge="gpt2")
    with pytest.raises(ValueError, match=r"Bridge\(mode\) must be one of"):
        Bridge(encoder.tokenizer, mode="mean")


def test_rescale_with_baseline_takes_the_baseline_path(encoder):
    from bsloss.baseline import shipped_baseline_path
    from bsloss.scorer.default import DEFAULT_MODEL_NAME

    path = str(shipped_baseline_path(DEFAULT_MODEL_NAME))
    old = _old(BERTScoreLoss, encoder=encoder, rescale_with_baseline=True, baseline_path=path)
    new = BERTScoreLoss(encoder, rescale_with_baseline=path)
    torch.testing.assert_close(new.baseline, old.baseline, rtol=0, atol=0)
