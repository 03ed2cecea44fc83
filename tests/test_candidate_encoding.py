"""The candidates as the scorer's inputs (bsloss/candidate_encoding.py): the fused pass's options
only with hidden_states, and in bridge_mode="retokenize" with Gemma 3's real tokenizer the
scored text is the decoded argmax, cut at the scorer's own pieces."""

from __future__ import annotations

import pytest
import torch
from _helpers import caught_warnings, head_for

from bsloss import BERTScoreLoss, StraightThrough, TopK
from bsloss.candidate_inputs import Embeddings, LMHeadInputs, Logits, Probabilities, TokenIds


@pytest.fixture(scope="module")
def gemma_loss(gemma_tokenizer, encoder, tmp_path_factory):
    """The documented Gemma path: the real 262,144-token tokenizer, bridge_mode='retokenize'
    (the default with generator_tokenizer), top-k candidates."""
    cache = tmp_path_factory.mktemp("gemma-bridge-r2")
    return BERTScoreLoss(
        encoder=encoder,
        generator_tokenizer=gemma_tokenizer,
        bridge_cache_dir=cache,
        top_k=4,
        reduction="none",
    )


def test_rc1_gemma_fused_top_k_retokenize_decodes_the_argmax(gemma_loss, gemma_tokenizer):
    """Fused path x top_k x bridge_mode='retokenize' with the real Gemma tokenizer: the scored
    text is the decoded argmax (it was the empty string: loss exactly 1, gradient 0)."""
    assert gemma_loss.bridge_mode == "retokenize"
    text = "The cat sat on the mat."
    ids = gemma_tokenizer(text, add_special_tokens=False)["input_ids"]
    hidden, weight = head_for(ids, len(gemma_tokenizer))
    hidden.requires_grad_(True)
    value, messages = caught_warnings(
        gemma_loss, hidden_states=hidden, output_embeddings=weight, references=[text]
    )
    assert not [m for m in messages if "empty" in m], messages
    assert gemma_loss.last_texts == [gemma_tokenizer.decode(ids)]
    assert value.item() < 0.05  # the reference itself, under the tempered default matching
    value.sum().backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["logits", "probs", "candidate_ids"])
@pytest.mark.parametrize(
    "option", [{"generator_temperature": 2.0}, {"logit_softcap": 30.0}], ids=lambda o: [*o][0]
)
def test_rc4_fused_only_options_are_refused_with_other_inputs(plain_loss, kind, option):
    """generator_temperature and logit_softcap only act in the fused pass; with logits, probs
    or candidate_ids they did nothing (a bit-identical result), now they are refused, named."""
    vocab = plain_loss.generator_vocab_size
    logits = torch.randn(1, 3, vocab)
    source = {"logits": logits, "probs": logits.softmax(-1), "candidate_ids": logits.argmax(-1)}
    with pytest.raises(
        ValueError, match=f"go with hidden_states, not with {kind}: got {[*option][0]}"
    ):
        plain_loss(**{kind: source[kind]}, references=["a cat"], **option)


def test_rc5_retokenize_truncation_counts_scorer_pieces(gemma_loss, gemma_tokenizer):
    """600 generator positions (a word and a newline, 300 times) make 300 scorer pieces: the
    scorer takes the text whole, so nothing is cut and nothing is said (it was cut at 510
    generator positions, with a warning that the scorer's limit was hit)."""
    text = "cat\n" * 300
    ids = gemma_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 600
    value, messages = caught_warnings(gemma_loss, TokenIds(torch.tensor([ids])), ["cat " * 300])
    assert messages == []
    assert gemma_loss.last_texts == [gemma_tokenizer.decode(ids)]
    assert torch.isfinite(value).all()
    # a text that does exceed the scorer's 510 pieces is cut there, with the warning
    long_ids = gemma_tokenizer(" cat" * 600, add_special_tokens=False)["input_ids"]
    _, messages = caught_warnings(gemma_loss, TokenIds(torch.tensor([long_ids])), ["cat"])
    assert len(messages) == 1 and "candidates[0]" in messages[0], messages


# ----------------------------------------------------------------- special tokens as content
SPECIAL_TEXTS = ["the cat sat on the mat", "a dog ran"]
SPECIAL_REFERENCES = ["A cat was sitting on the mat.", "The dog runs."]


@pytest.fixture(scope="module")
def special_batch(encoder):
    """``tokenizer(texts)`` as the README passes it: [CLS] ... [SEP] [PAD], with the attention
    mask as the candidate mask (true on [CLS] and [SEP])."""
    batch = encoder.tokenizer(SPECIAL_TEXTS, return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"].bool()


def _one_hot_candidates(source: str, ids: torch.Tensor, vocab: int):
    """Candidates whose most probable tokens are ``ids``, exactly one-hot in float32."""
    logits = torch.zeros(*ids.shape, vocab).scatter_(-1, ids[..., None], 1e4)
    if source == "logits":
        return Logits(logits)
    if source == "probs":
        return Probabilities(logits.softmax(-1))
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.functional.normalize(torch.randn(vocab, 64, generator=generator), dim=1)
    return LMHeadInputs(weight[ids] * 1e3, weight)  # logits 1000 apart at least 400: one-hot


@pytest.mark.parametrize("source", ["logits", "probs", "lm_head"])
def test_distributions_skip_the_scorer_special_tokens_as_token_ids_do(
    plain_loss, special_batch, vocab, source
):
    """One-hot distributions on ``tokenizer(texts)``'s ids, under its attention mask, score as
    those ids do (TokenIds skips [CLS]/[SEP]/[PAD]): they scored [CLS] and [SEP] as content
    (1 - F 0.264 / 0.220 against 0.115 / 0.122)."""
    ids, mask = special_batch
    expected = plain_loss.score(TokenIds(ids), SPECIAL_REFERENCES, candidate_mask=mask)
    got = plain_loss.score(
        _one_hot_candidates(source, ids, vocab), SPECIAL_REFERENCES, candidate_mask=mask
    )
    for name, a, b in zip("PRF", got, expected, strict=True):
        assert (a - b).abs().max().item() < 1e-5, (name, a.tolist(), b.tolist())


def test_straight_through_skips_the_positions_whose_token_is_special(encoder, special_batch, vocab):
    """Straight-through scores its argmax tokens: as TokenIds of the argmax, [CLS] and [SEP]
    skipped (F 0.736 / 0.780 against 0.885 / 0.878 before). The gradient still reaches the
    positions that are content."""
    ids, mask = special_batch
    loss = BERTScoreLoss(encoder=encoder, candidate_transforms=[StraightThrough()])
    torch.manual_seed(0)
    logits = torch.randn(*ids.shape, vocab) + 30 * torch.nn.functional.one_hot(ids, vocab)
    logits.requires_grad_(True)
    expected = loss.score(TokenIds(logits.argmax(-1)), SPECIAL_REFERENCES, candidate_mask=mask)
    got = loss.score(Logits(logits), SPECIAL_REFERENCES, candidate_mask=mask)
    for name, a, b in zip("PRF", got, expected, strict=True):
        assert (a - b).abs().max().item() < 1e-5, (name, a.tolist(), b.tolist())
    loss(Logits(logits), SPECIAL_REFERENCES, candidate_mask=mask).backward()
    moved = logits.grad.abs().sum(-1) > 0
    special = torch.isin(ids, torch.tensor(encoder.tokenizer.all_special_ids))
    assert moved[mask & ~special].all() and not moved[special].any()


# ----------------------------------------------------------------- embeddings with their weights
@pytest.fixture(scope="module")
def idf_loss(encoder):
    return BERTScoreLoss(
        encoder=encoder, matching="hard", idf=SPECIAL_REFERENCES + SPECIAL_TEXTS, reduction="none"
    )


def test_embeddings_with_their_weights_score_as_their_tokens(idf_loss, encoder):
    """The scorer's hidden states of the candidate texts (encode_references), with the weights
    it returns, score as the texts' token ids under an idf loss ([CLS]/[SEP] weigh 0, the rest
    their idf). Without weights such a loss refuses them: it weighed every position 1, [CLS] and
    [SEP] included, and the idf was silently dropped."""
    hidden, mask, weights = idf_loss.encode_references(SPECIAL_TEXTS)
    ids = encoder.tokenizer(SPECIAL_TEXTS, return_tensors="pt", padding=True)
    expected = idf_loss.score(
        TokenIds(ids["input_ids"]),
        SPECIAL_REFERENCES,
        candidate_mask=ids["attention_mask"].bool(),
    )
    got = idf_loss.score(Embeddings(hidden, weights), SPECIAL_REFERENCES, candidate_mask=mask)
    for name, a, b in zip("PRF", got, expected, strict=True):
        assert (a - b).abs().max().item() < 1e-5, (name, a.tolist(), b.tolist())
    with pytest.raises(ValueError, match=r"weighs tokens by idf.*Embeddings\(hidden, weights\)"):
        idf_loss.score(Embeddings(hidden), SPECIAL_REFERENCES, candidate_mask=mask)


def test_embeddings_without_weights_weigh_every_masked_position_one(plain_loss):
    hidden, mask, _ = plain_loss.encode_references(SPECIAL_TEXTS)
    refs = SPECIAL_REFERENCES
    default = plain_loss.score(Embeddings(hidden), refs, candidate_mask=mask)
    ones = plain_loss.score(Embeddings(hidden, mask.float()), refs, candidate_mask=mask)
    for a, b in zip(default, ones, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("weights", "error", "match"),
    [
        (torch.ones(2, 4), ValueError, r"weights must be \[B, L\] = \[2, 3\]"),
        (torch.ones(2, 3, dtype=torch.long), TypeError, "weights must have a floating dtype"),
        (torch.tensor([[1.0, -1.0, 1.0], [1.0, 1.0, 1.0]]), ValueError, r"at weights\[0, 1\]"),
        (torch.tensor([[1.0, 1.0, 1.0], [1.0, float("nan"), 1.0]]), ValueError, r"\[1, 1\]"),
    ],
    ids=["shape", "dtype", "negative", "nan"],
)
def test_embedding_weights_are_checked_where_built(weights, error, match):
    with pytest.raises(error, match=match):
        Embeddings(torch.zeros(2, 3, 8), weights)


@pytest.mark.parametrize(
    ("transforms", "seed"),
    [([TopK(2)], 1), ([TopK(2)], 5), ([TopK(7), StraightThrough()], 0), ([TopK(7)], 3)],
    ids=["top2-a", "top2-b", "top7-straight-through", "top7"],
)
def test_tied_tokens_are_chosen_alike_on_both_paths(encoder, vocab, transforms, seed):
    """A soft-cap of 5 saturates random logits: dozens of tokens tie at exactly 5.0, [PAD]
    (id 0) among them. Top-k lists tied tokens in no set order, and the dense and the fused
    path took them in different orders: straight-through one-hots of different tokens (60 of
    60 seeds differed at TopK(7), before this round), and, once the most probable token
    decides what is content, different positions kept (0.02 apart at TopK(2), found by
    test_fuzz). Both take the k tokens in token order now: ties go to the smallest id, as
    argmax over the whole vocabulary breaks them."""
    loss = BERTScoreLoss(encoder=encoder, candidate_transforms=transforms, reduction="none")
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 3, 16, generator=generator) * 30
    weight = torch.randn(vocab, 16, generator=generator) / 4
    logits = torch.tanh(hidden @ weight.T / 5.0) * 5.0
    assert (logits == 5.0).sum(-1).min() > 2
    fused = loss(LMHeadInputs(hidden, weight, softcap=5.0), ["the"])
    dense = loss(Logits(logits), ["the"])
    torch.testing.assert_close(fused, dense, atol=2e-4, rtol=0)
