"""The candidates as the scorer's inputs (bsloss/candidate_encoding.py): the fused pass's options
only with hidden_states, and in bridge_mode="retokenize" with Gemma 3's real tokenizer the
scored text is the decoded argmax, cut at the scorer's own pieces."""

from __future__ import annotations

import pytest
import torch
from _helpers import caught_warnings, head_for

from bsloss import BERTScoreLoss
from bsloss.candidate_inputs import TokenIds


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
