"""The functional core (bsloss/functional/): the pure matching math (gradients, limits, masks and
numerical edge cases), cosine similarity at any scale, and batch centering under
torch.distributed with an empty batch."""

from __future__ import annotations

import pytest
import torch

import bsloss
from bsloss import BERTScoreLoss
from bsloss.functional import batch_center, bert_score, token_scores
from bsloss.functional.matching import SHORTHANDS

SOFT = ("softmax", "logsumexp", "sinkhorn")


def _batch(seed=0, dtype=torch.float64, batch=3, lc=5, lr=4, d=6):
    g = torch.Generator().manual_seed(seed)
    cand = torch.randn(batch, lc, d, generator=g, dtype=dtype)
    ref = torch.randn(batch, lr, d, generator=g, dtype=dtype)
    cand_mask = torch.ones(batch, lc, dtype=torch.bool)
    ref_mask = torch.ones(batch, lr, dtype=torch.bool)
    cand_mask[1, 3:] = False
    ref_mask[2, 2:] = False
    cand_w = torch.rand(batch, lc, generator=g, dtype=dtype) + 0.1
    ref_w = torch.rand(batch, lr, generator=g, dtype=dtype) + 0.1
    return cand, ref, cand_mask, ref_mask, cand_w, ref_w


@pytest.mark.parametrize("matching", sorted(SHORTHANDS))
def test_gradcheck_every_matching_with_masks_and_weights(matching):
    cand, ref, cand_mask, ref_mask, cand_w, ref_w = _batch()
    cand.requires_grad_(True)
    ref.requires_grad_(True)

    def f(c, r):
        return torch.stack(
            bert_score(c, r, cand_mask, ref_mask, cand_w, ref_w, matching=matching, temperature=0.3)
        )

    assert torch.autograd.gradcheck(f, (cand, ref), eps=1e-6, atol=1e-5)


def test_gradcheck_sinkhorn_several_iterations_and_centering():
    cand, ref, cand_mask, ref_mask, cand_w, ref_w = _batch(seed=1)
    cand.requires_grad_(True)

    def f(c):
        c = batch_center(c, cand_mask, distributed=False)
        return bert_score(
            c,
            ref,
            cand_mask,
            ref_mask,
            cand_w,
            ref_w,
            matching="sinkhorn",
            temperature=0.2,
            sinkhorn_iterations=4,
        ).f1

    assert torch.autograd.gradcheck(f, (cand,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("matching", ["softmax", "logsumexp"])
def test_soft_matchings_tend_to_hard_as_temperature_goes_to_zero(matching):
    cand, ref, cand_mask, ref_mask, cand_w, ref_w = _batch(seed=2)
    hard = bert_score(cand, ref, cand_mask, ref_mask, cand_w, ref_w, matching="hard")
    gaps = []
    for t in (0.5, 0.05, 1e-3):
        soft = bert_score(
            cand,
            ref,
            cand_mask,
            ref_mask,
            cand_w,
            ref_w,
            matching=matching,
            temperature=t,
            self_normalize=False,
        )
        gaps.append(max((a - b).abs().max().item() for a, b in zip(soft, hard, strict=True)))
    assert gaps[-1] < 1e-3
    assert gaps[0] > gaps[-1]


def test_one_step_sinkhorn_limit_is_column_relative_max_not_hard():
    """Measured: one Sinkhorn step does not tend to the greedy max (see sinkhorn.py)."""
    cand, ref, cand_mask, ref_mask, _, _ = _batch(seed=2)
    cand_mask[:] = True
    ref_mask[:] = True
    sim = torch.einsum(
        "bid,bjd->bij",
        torch.nn.functional.normalize(cand, dim=-1),
        torch.nn.functional.normalize(ref, dim=-1),
    )
    p_sk, r_sk = token_scores(cand, ref, cand_mask, ref_mask, matching="sinkhorn", temperature=1e-4)
    relative = sim - sim.max(dim=1, keepdim=True).values
    # Several columns may have token i as their best (relative gap 0): the plan splits evenly.
    best = relative >= relative.max(dim=2, keepdim=True).values - 1e-9
    expected_p = (sim * best).sum(dim=2) / best.sum(dim=2)
    assert torch.allclose(p_sk, expected_p, atol=1e-6)
    p_hard, _ = token_scores(cand, ref, cand_mask, ref_mask, matching="hard")
    assert (p_sk - p_hard).abs().max() > 1e-2  # the limit differs from hard here
    # For a sentence against itself best matches are mutual, and the limit is the hard score 1.
    self_p, _ = token_scores(
        cand, cand, cand_mask, cand_mask, matching="sinkhorn", temperature=1e-4
    )
    assert torch.allclose(self_p, torch.ones_like(self_p), atol=1e-6)


def test_hard_gradient_flows_only_through_argmax_cells():
    cand, ref, cand_mask, ref_mask, _, _ = _batch(seed=3)
    sim = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    p, r = SHORTHANDS["hard"].kernel(sim, cand_mask, ref_mask)
    p.sum().backward()
    grad = sim.grad
    # One non-zero cell per real candidate token, at its row's argmax.
    assert int((grad != 0).sum()) == int(cand_mask.sum()) - int((~ref_mask.any(1)).sum())
    masked = sim.detach().masked_fill(~(cand_mask[:, :, None] & ref_mask[:, None, :]), -9)
    argmax = masked.argmax(dim=2)
    for b in range(3):
        for i in range(5):
            if cand_mask[b, i]:
                assert grad[b, i, argmax[b, i]] == 1


def test_pair_with_an_empty_reference_scores_zero():
    cand, ref, cand_mask, ref_mask, cand_w, ref_w = _batch(seed=8, dtype=torch.float32)
    ref_w[2] = 0.0  # only special tokens: matchable, but no weight
    out = bert_score(cand, ref, cand_mask, ref_mask, cand_w, ref_w)
    assert out.precision[2] == 0 and out.recall[2] == 0 and out.f1[2] == 0
    assert out.precision[0] != 0


def test_padded_cells_never_enter_the_max():
    # All real similarities negative: bert_score's `sim * mask` would give 0 from padded cells.
    cand = torch.tensor([[[1.0, 0.0]]])
    ref = torch.tensor([[[-1.0, 0.1], [0.0, 0.0]]])  # second reference slot is padding
    ref_mask = torch.tensor([[True, False]])
    out = bert_score(cand, ref, None, ref_mask, matching="hard")
    assert out.precision.item() == pytest.approx(-1 / (1.01**0.5), abs=1e-6)


@pytest.mark.parametrize("matching", sorted(SHORTHANDS))
def test_empty_sentence_defined_score_and_zero_gradient(matching):
    cand, ref, cand_mask, ref_mask, cand_w, ref_w = _batch(seed=4, dtype=torch.float32)
    cand_mask[0] = False
    cand.requires_grad_(True)
    ref.requires_grad_(True)
    out = bert_score(
        cand, ref, cand_mask, ref_mask, cand_w, ref_w, matching=matching, temperature=0.1
    )
    assert out.precision[0] == 0 and out.recall[0] == 0 and out.f1[0] == 0
    sum(x.sum() for x in out).backward()
    assert torch.isfinite(cand.grad).all() and torch.isfinite(ref.grad).all()
    assert (cand.grad[0] == 0).all()


@pytest.mark.parametrize("matching", SOFT)
@pytest.mark.parametrize("case", ["all_equal", "tiny_temperature", "huge_values"])
def test_numerical_edge_cases_finite(matching, case):
    cand, ref, cand_mask, ref_mask, cand_w, ref_w = _batch(seed=5, dtype=torch.float32)
    temperature = 0.05
    if case == "all_equal":
        cand = torch.ones_like(cand)
        ref = torch.ones_like(ref)
    elif case == "tiny_temperature":
        temperature = 1e-4
    else:
        cand = cand * 1e4
    cand.requires_grad_(True)
    out = bert_score(
        cand, ref, cand_mask, ref_mask, cand_w, ref_w, matching=matching, temperature=temperature
    )
    assert all(torch.isfinite(x).all() for x in out)
    out.f1.sum().backward()
    assert torch.isfinite(cand.grad).all()


def test_bf16_autocast_math_runs_in_fp32():
    cand, ref, cand_mask, ref_mask, cand_w, ref_w = _batch(seed=6, dtype=torch.float32)
    exact = bert_score(cand, ref, cand_mask, ref_mask, cand_w, ref_w, matching="softmax")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = bert_score(
            cand.bfloat16(), ref.bfloat16(), cand_mask, ref_mask, cand_w, ref_w, matching="softmax"
        )
    assert mixed.f1.dtype == torch.float32
    assert (mixed.f1 - exact.f1).abs().max() < 2e-2


def test_batch_center_subtracts_mean_of_real_tokens():
    emb = torch.randn(2, 3, 4)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    centered = batch_center(emb, mask, distributed=False)
    mean = (emb[0, 0] + emb[0, 1] + emb[1, 0]) / 3
    assert torch.allclose(centered[0, 1], emb[0, 1] - mean, atol=1e-6)
    assert torch.allclose(centered[mask].sum(0), torch.zeros(4), atol=1e-5)
    assert (centered[~mask] == 0).all()


def test_logsumexp_bounds_and_sinkhorn_marginal():
    cand, ref, cand_mask, ref_mask, _, _ = _batch(seed=7)
    sim = torch.einsum(
        "bid,bjd->bij",
        torch.nn.functional.normalize(cand, dim=-1),
        torch.nn.functional.normalize(ref, dim=-1),
    )
    p_hard, _ = token_scores(cand, ref, cand_mask, ref_mask, matching="hard")
    p_lse, _ = token_scores(cand, ref, cand_mask, ref_mask, matching="logsumexp", temperature=0.1)
    p_soft, _ = token_scores(cand, ref, cand_mask, ref_mask, matching="softmax", temperature=0.1)
    real = cand_mask & ref_mask.any(1, keepdim=True)
    assert torch.all(p_lse[real] >= p_hard[real] - 1e-12)
    assert torch.all(p_lse[real] <= p_hard[real] + 0.1 * torch.log(torch.tensor(4.0)) + 1e-12)
    assert torch.all(p_soft[real] <= p_hard[real] + 1e-12)
    del sim


@pytest.mark.slow  # two processes each load the scorer: ~30 s on 2 busy cores
def test_rc8_centering_collectives_are_joined_on_an_empty_batch(tmp_path, encoder):
    """center=True under torch.distributed (two gloo processes): a process with an empty batch
    returned before the centering all-reduce, so the calls of the processes stopped pairing
    (a timeout, or a silently wrong mean). Now each call's values are the one-process ones."""
    import _distributed_empty_batch as script
    from test_distributed_scoring import run_two_processes

    results = run_two_processes("_distributed_empty_batch.py", tmp_path)
    loss = BERTScoreLoss(encoder=encoder, center=True, reduction="none")
    vocab = loss.generator_vocab_size
    alone = loss(logits=script.batch([0, 1], vocab), references=script.REFERENCES[:2]).detach()
    both = loss(logits=script.batch([0, 1, 2, 3], vocab), references=script.REFERENCES).detach()
    torch.testing.assert_close(results[0]["first"], alone, atol=1e-5, rtol=0)
    assert results[1]["first"].shape == (0,) and results[0]["first_grad_finite"]
    torch.testing.assert_close(results[0]["second"], both[:2], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[1]["second"], both[2:], atol=1e-5, rtol=0)


@pytest.mark.slow  # two processes each load and compile the loss: ~40 s on 2 busy cores
def test_a_compiled_loss_centers_over_every_process(tmp_path, encoder):
    """center=True under torch.distributed (two gloo processes) with the loss compiled: the
    centering all-reduce inside the compiled matching step still joins the other process, so
    each process's values are the one-process values of the whole batch (not those of its own
    rows, which differ), for a second call with new reference texts too, and its values and
    gradients are the eager ones."""
    import _distributed_empty_batch as script
    from test_distributed_scoring import run_two_processes

    results = run_two_processes("_distributed_compiled_centering.py", tmp_path)
    loss = BERTScoreLoss(encoder=encoder, center=True, reduction="none")
    vocab = loss.generator_vocab_size
    both = loss(logits=script.batch([0, 1, 2, 3], vocab), references=script.REFERENCES).detach()
    alone = loss(logits=script.batch([0, 1], vocab), references=script.REFERENCES[:2]).detach()
    assert (alone - both[:2]).abs().max() > 1e-3  # the global mean is not the local one
    for rank, result in enumerate(results):
        own, other = (both[:2], both[2:]) if rank == 0 else (both[2:], both[:2])
        eager_value, eager_grad = result["eager"]
        value, grad = result["compiled"]
        torch.testing.assert_close(value, own, atol=1e-5, rtol=0)
        torch.testing.assert_close(value, eager_value, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, eager_grad, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(result["compiled, other rows"][0], other, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [1e20, 1e-20, 1e30, 1e-30])
def test_rc9_cosine_similarity_is_scale_invariant(scale):
    """Token vectors scaled by 1e20 overflowed the float32 norm and by 1e-20 fell under its
    eps: F came out 0. Now F is the same at every scale, and the gradient is finite."""
    generator = torch.Generator().manual_seed(0)
    cands = torch.randn(2, 4, 16, generator=generator)
    refs = torch.randn(2, 5, 16, generator=generator)
    mask_c, mask_r = torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool)
    want = bert_score(cands, refs, mask_c, mask_r, mask_c.float(), mask_r.float()).f1
    scaled = (cands * scale).requires_grad_(True)
    got = bert_score(scaled, refs * scale, mask_c, mask_r, mask_c.float(), mask_r.float()).f1
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(got.sum(), scaled)
    assert torch.isfinite(grad).all()
    # the rescale is an exact power of two: ordinary vectors normalise bit for bit as before
    x = torch.randn(7, 384, generator=generator)
    assert torch.equal(bsloss.functional.l2_normalize(x), torch.nn.functional.normalize(x, dim=-1))


@pytest.mark.slow  # two processes each load the scorer: ~30 s on 2 busy cores
def test_centering_over_processes_differentiates_the_global_mean(tmp_path, encoder):
    """center=True under torch.distributed (two gloo processes): the values were the whole
    batch's, but the gradient took only the local share of the mean (the all-reduce was
    detached): 19-31% off the one-process gradient (cosine 0.95-0.99). Now each row's
    gradient equals one process's holding all four rows, for an even, an uneven and an
    all-to-one split (the empty process joins the backward all-reduce too: no hang)."""
    import _distributed_center_gradient as script
    from _distributed_empty_batch import REFERENCES, batch
    from test_distributed_scoring import run_two_processes

    results = run_two_processes("_distributed_center_gradient.py", tmp_path)
    loss = BERTScoreLoss(encoder=encoder, center=True, reduction="none")
    logits = batch([0, 1, 2, 3], loss.generator_vocab_size)
    whole = loss(logits=logits, references=REFERENCES)
    whole.sum().backward()
    for name in script.SPLITS:
        for result in results:
            rows, values, gradient = result[name]
            if not rows:
                assert values.shape == (0,)
                continue
            torch.testing.assert_close(values, whole.detach()[rows], atol=1e-5, rtol=0)
            torch.testing.assert_close(gradient, logits.grad[rows], atol=1e-6, rtol=1e-4)
