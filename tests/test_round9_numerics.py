"""Round 9 (audit h10): the loss's F where the soft matchings make P or R negative, and the
inputs whose rounding made a value silently wrong."""

from __future__ import annotations

import math

import pytest
import torch

import bsloss
from bsloss.functional import bert_score
from bsloss.functional.reduction import f_measure


def unit_vectors(cosines: list[float]) -> torch.Tensor:
    """``[1, n, 2]`` unit vectors at the given cosines to ``(1, 0)``."""
    return torch.tensor([[[c, math.sqrt(1 - c * c)] for c in cosines]])


def test_bounded_f_has_no_pole_where_p_is_minus_r():
    """bert_score's ``2PR / (P + R)`` has a pole at ``P = -R``: hard matching of a candidate
    whose tokens have cosines 0.3 and -0.9 to the one reference token gives P = -0.3, R = 0.3
    and F = -0.3 * 0.3 * 2 / 0 (here: cut to 0 only at exactly 0; beside it, F = -1e6 and
    more). The bounded F is the harmonic mean where P, R > 0, else min(P, R): finite, between
    P and R, with a finite gradient; where both are positive it is bert_score's."""
    reference = unit_vectors([1.0])
    for second in (-0.9, -0.9 + 1e-6, -0.9 - 1e-6):
        candidate = unit_vectors([0.3, second]).requires_grad_()
        raw = bert_score(candidate, reference, normalized=True)
        bounded = bert_score(candidate, reference, normalized=True, bounded_f=True)
        p, r = bounded.precision.item(), bounded.recall.item()
        assert p < 0 < r and abs(p + r) < 1e-5
        assert bounded.f1.item() == pytest.approx(min(p, r))
        (gradient,) = torch.autograd.grad(bounded.f1.sum(), candidate)
        assert torch.isfinite(gradient).all() and gradient.abs().max() < 10
        if second != -0.9:  # beside the pole: bert_score's F far outside [P, R]
            assert abs(raw.f1.item()) > 1e4
    p = torch.tensor([0.2, 0.7, 1e-9, -0.1, -0.2, 0.0])
    r = torch.tensor([0.6, 0.7, 0.5, -0.3, 0.4, 0.0])
    torch.testing.assert_close(
        f_measure(p, r, bounded=True),
        torch.tensor([0.3, 0.7, 2e-9, -0.3, -0.2, 0.0]),
        rtol=1e-6,
        atol=1e-12,
    )
    both = (p > 0) & (r > 0)
    torch.testing.assert_close(f_measure(p, r, bounded=True)[both], f_measure(p, r)[both])


@pytest.mark.parametrize("matching", [bsloss.Softmax(0.05), bsloss.Sinkhorn(0.1)])
def test_the_losss_f_stays_between_p_and_r(encoder, matching):
    """Random logits (a generator at initialisation) give the soft matchings negative P or R
    (Softmax(0.05): R < 0 < P; Sinkhorn(0.1): both below 0): the loss's F is min(P, R)
    there, so ``1 - F`` stays in [0, 2] however P + R nears 0."""
    torch.manual_seed(0)
    loss = bsloss.BERTScoreLoss(encoder, matching=matching, reduction="none")
    logits = 2 * torch.randn(4, 6, encoder.input_embeddings.num_embeddings)
    refs = ["stocks fell sharply", "a cat sat on the mat", "the dog barked", "rain again"]
    p, r, f = loss.score(bsloss.Logits(logits), refs)
    assert ((p <= 0) | (r <= 0)).any()  # the region the bounded F is for
    lower, upper = torch.minimum(p, r), torch.maximum(p, r)
    assert (f >= lower - 1e-6).all() and (f <= upper + 1e-6).all()
    outside = (p <= 0) | (r <= 0)
    torch.testing.assert_close(f[outside], lower[outside])


def test_probabilities_whose_total_overflows_are_refused_named(encoder):
    """Unnormalised probabilities are renormalised per position; a row whose total overflows
    float32 (1e4 : 1 odds scaled by 1e34) divided every entry to 0: the candidate scored as
    empty (loss 1.0, zero gradient, no warning) where the same rows scaled down score 0.2543.
    Refused now, as a zero total is, naming the position."""
    vocab = encoder.input_embeddings.num_embeddings
    ids = torch.tensor([encoder.tokenizer("the cat sat on the mat")["input_ids"]])
    probs = torch.ones(*ids.shape, vocab, dtype=torch.float64)
    probs.scatter_(-1, ids[..., None], 1e4)
    loss = bsloss.BERTScoreLoss(encoder, matching=bsloss.Hard())
    scaled_down = loss(bsloss.Probabilities(probs.float()), ["a cat was on a mat"])
    assert 0.2 < scaled_down.item() < 0.3
    for mask in (None, torch.ones_like(ids, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"probs\[0, 0\] sums past the largest float"):
            loss(bsloss.Probabilities((probs * 1e34).float()), ["a x"], candidate_mask=mask)


def test_a_baseline_that_is_one_in_float32_is_refused(tmp_path, encoder):
    """0.99999999 is below 1 in float64 (the check) and 1.0 in float32 (the rescaling): the
    loss was inf with a NaN gradient, the metric's F 0.0."""
    from bsloss.baseline import read_baseline

    for value, accepted in ((0.99, True), (0.99999999, False), (1 - 1e-12, False)):
        path = tmp_path / f"baseline-{value!r}.csv"
        rows = "".join(f"{layer},{value!r},{value!r},{value!r}\n" for layer in range(7))
        path.write_text("LAYER,P,R,F\n" + rows)
        if accepted:
            assert read_baseline(path, 6).tolist() == [value] * 3
            continue
        with pytest.raises(ValueError, match=r"must have three finite values below 1"):
            read_baseline(path, 6)
        with pytest.raises(ValueError, match=r"must have three finite values below 1"):
            bsloss.BERTScoreLoss(encoder, rescale_with_baseline=str(path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("matching", [bsloss.Hard(), bsloss.Sinkhorn(0.1)])
def test_a_zero_vector_gets_an_ordinary_gradient(dtype, matching):
    """A zero token vector (a hidden state zeroed by a mask upstream) scores cosine 0, but its
    gradient was upstream / 1e-12 (``normalize``'s eps): 7.6e10 in float32, inf or NaN in
    float16, and ``0 * inf`` made NaN in the model's gradient behind a mask multiply."""
    torch.manual_seed(0)
    candidates = torch.randn(2, 5, 16).to(dtype)
    references = torch.randn(2, 4, 16).to(dtype)
    keep = torch.ones(2, 5, 1, dtype=dtype)
    keep[0, 2] = 0
    candidates.requires_grad_()
    masked = candidates * keep  # the zero vector, scored
    f1 = bert_score(masked, references, matching=matching).f1
    (through_mask, at_zero) = torch.autograd.grad(f1.sum(), [candidates, masked])
    assert torch.isfinite(through_mask).all()  # float16: NaN (0 * inf)
    assert at_zero.float().abs().max() < 10  # float32: 1e10 and more at [0, 2]
    # the values of ordinary vectors are those of normalize: bit-identical
    from bsloss.functional.similarity import l2_normalize

    vectors = torch.randn(3, 7, 16)
    assert torch.equal(l2_normalize(vectors), torch.nn.functional.normalize(vectors, dim=-1))
    tracked = vectors.clone().requires_grad_()  # the path with the gradient's own division
    assert torch.equal(l2_normalize(tracked), torch.nn.functional.normalize(vectors, dim=-1))
    assert torch.equal(l2_normalize(torch.zeros(2, 16)), torch.zeros(2, 16))
