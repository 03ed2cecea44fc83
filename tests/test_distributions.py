"""Generator distributions -> expected scorer inputs: gradients and the top-k / straight-through
variants."""

from __future__ import annotations

import pytest
import torch

from bsloss.distributions import augment_table, expected_inputs, token_distribution


def _table(vocab=11, dim=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, dim, generator=g, dtype=torch.float64), torch.rand(
        vocab, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("options", [{}, {"top_k": 4}, {"top_k": 11}])
def test_gradcheck_expected_inputs_from_logits(options):
    table, weights = _table()
    logits = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)

    def f(x):
        emb, w = expected_inputs(
            token_distribution(logits=x, **options), augment_table(table, weights)
        )
        return emb, w

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-6)


def test_gradcheck_expected_inputs_from_probs():
    table, weights = _table()
    probs = torch.rand(2, 3, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda p: expected_inputs(
            token_distribution(probs=p, top_k=5), augment_table(table, weights)
        ),
        (probs,),
        eps=1e-6,
        atol=1e-6,
    )


def test_dense_equals_explicit_softmax_product_and_full_top_k():
    table, weights = _table(seed=1)
    logits = torch.randn(2, 3, 11, dtype=torch.float64)
    emb, w = expected_inputs(token_distribution(logits=logits), augment_table(table, weights))
    p = torch.softmax(logits, dim=-1)
    assert torch.allclose(emb, p @ table) and torch.allclose(w, p @ weights)
    emb_k, _ = expected_inputs(
        token_distribution(logits=logits, top_k=11), augment_table(table, weights)
    )
    assert torch.allclose(emb, emb_k)


def test_straight_through_forward_is_argmax_row_backward_is_softmax_gradient():
    table, weights = _table(seed=2)
    logits = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    emb, _ = expected_inputs(
        token_distribution(logits=logits, straight_through=True), augment_table(table, weights)
    )
    assert torch.equal(emb, table[logits.detach().argmax(-1)])
    direction = torch.randn_like(emb)
    (emb * direction).sum().backward()
    soft = logits.detach().clone().requires_grad_(True)
    soft_emb, _ = expected_inputs(token_distribution(logits=soft), augment_table(table, weights))
    (soft_emb * direction).sum().backward()
    assert torch.allclose(logits.grad, soft.grad)


def test_top_k_equals_renormalised_top_k_probabilities():
    table, weights = _table(seed=3)
    logits = torch.randn(2, 3, 11, dtype=torch.float64)
    emb, _ = expected_inputs(
        token_distribution(logits=logits, top_k=3), augment_table(table, weights)
    )
    p = torch.softmax(logits, dim=-1)
    values, idx = p.topk(3, dim=-1)
    expected = torch.einsum("blk,blkd->bld", values / values.sum(-1, keepdim=True), table[idx])
    assert torch.allclose(emb, expected)


def test_gumbel_samples_are_normalised_and_need_logits():
    logits = torch.randn(2, 3, 11)
    dist = token_distribution(logits=logits, gumbel_temperature=0.5, top_k=11)
    assert torch.allclose(dist.weights.sum(-1), torch.ones(2, 3))
    with pytest.raises(ValueError, match="gumbel_temperature"):
        token_distribution(probs=torch.rand(2, 3, 11), gumbel_temperature=0.5)
    with pytest.raises(ValueError, match="gumbel_temperature"):
        token_distribution(logits=logits, gumbel_temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        token_distribution(logits=logits, top_k=0)
