"""Candidate-distribution transforms as objects: the same loss as their keyword shorthands,
validated where they are built, refused twice or when not a transform."""

from __future__ import annotations

import pytest
import torch

import bsloss
from bsloss import CandidateTransform, Gumbel, StraightThrough, TopK
from bsloss.candidate_transforms import (
    CandidateOptions,
    candidate_weights,
    resolve_candidate_transforms,
)

REFS = ["a cat sat on the mat", "the dog ran home"]


@pytest.fixture(scope="module")
def encoder(scorer):
    return scorer.encoder


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 5, 30522, dtype=torch.float64)


@pytest.mark.parametrize(
    ("objects", "keywords"),
    [
        ([TopK(16)], {"top_k": 16}),
        ([StraightThrough()], {"straight_through": True}),
        ([StraightThrough(), TopK(8)], {"top_k": 8, "straight_through": True}),
    ],
    ids=["top_k", "straight_through", "both_any_order"],
)
def test_objects_give_the_loss_and_gradient_of_their_keywords(encoder, logits, objects, keywords):
    by_object = bsloss.BERTScoreLoss(encoder=encoder, candidate_transforms=objects)
    by_keyword = bsloss.BERTScoreLoss(encoder=encoder, **keywords)
    assert by_object.candidates == by_keyword.candidates
    values, grads = [], []
    for loss_fn in (by_object, by_keyword):
        x = logits.clone().requires_grad_()
        value = loss_fn(logits=x, references=REFS)
        value.backward()
        values.append(value.detach())
        grads.append(x.grad)
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    plain = bsloss.BERTScoreLoss(encoder=encoder)(logits=logits, references=REFS)
    assert not torch.equal(plain, values[0])  # the transform does change the loss


def test_gumbel_object_samples_like_its_keyword(encoder, logits):
    values = []
    for options in ({"candidate_transforms": Gumbel(0.5)}, {"gumbel_temperature": 0.5}):
        torch.manual_seed(3)
        loss_fn = bsloss.BERTScoreLoss(encoder=encoder, **options)
        values.append(loss_fn(logits=logits, references=REFS))
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=0)


def test_parameters_are_validated_with_the_argument_named():
    with pytest.raises(ValueError, match="top_k must be >= 1, got 0"):
        TopK(0)
    with pytest.raises(TypeError, match="top_k must be an integer"):
        TopK(2.5)
    with pytest.raises(ValueError, match="gumbel_temperature must be a finite number > 0"):
        Gumbel(0.0)
    with pytest.raises(TypeError, match="straight_through must be a bool"):
        resolve_candidate_transforms(straight_through="yes")


def test_a_transform_twice_or_with_its_keyword_is_refused(encoder):
    with pytest.raises(ValueError, match="TopK is given twice"):
        resolve_candidate_transforms([TopK(4), TopK(8)])
    with pytest.raises(ValueError, match="TopK is given twice"):
        bsloss.BERTScoreLoss(encoder=encoder, candidate_transforms=[TopK(4)], top_k=4)
    with pytest.raises(TypeError, match=r"candidate_transforms\[1\] must be a CandidateTransform"):
        bsloss.BERTScoreLoss(encoder=encoder, candidate_transforms=[TopK(4), "top_k"])
    with pytest.raises(ValueError, match="top_k=1 gives an exactly zero gradient"):
        TopK(1)  # where it is built: it was refused only by the loss it was given to


def test_a_transform_class_is_refused_asking_for_an_instance(encoder):
    """The class where an instance belongs (candidate_transforms=TopK) is named as such, with
    what to pass; so is something that is neither a transform nor a list of them."""
    with pytest.raises(TypeError, match=r"candidate_transforms=TopK is the class: pass TopK\(k\)"):
        bsloss.BERTScoreLoss(encoder=encoder, candidate_transforms=TopK)
    with pytest.raises(
        TypeError,
        match=r"candidate_transforms\[1\]=StraightThrough is the class: pass StraightThrough\(\)",
    ):
        resolve_candidate_transforms([TopK(4), StraightThrough])
    with pytest.raises(TypeError, match="candidate_transforms must be a CandidateTransform"):
        resolve_candidate_transforms(4)


def test_a_new_transform_is_one_small_class(encoder, logits):
    """A subclass that sets existing options works wherever transforms are taken."""

    class Greedy(CandidateTransform):
        def configure(self, options: CandidateOptions) -> CandidateOptions:
            return StraightThrough().configure(TopK(2).configure(options))

    custom = bsloss.BERTScoreLoss(encoder=encoder, candidate_transforms=Greedy())
    assert custom.candidates == CandidateOptions(top_k=2, straight_through=True)
    reference = bsloss.BERTScoreLoss(encoder=encoder, top_k=2, straight_through=True)
    assert torch.equal(
        custom(logits=logits, references=REFS), reference(logits=logits, references=REFS)
    )


def test_options_check_names_the_argument_and_the_vocabulary():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 5\], got 8"):
        CandidateOptions(top_k=8).check(5)
    # the transform the user passed is named (the message named the deprecated keyword only)
    with pytest.raises(
        ValueError, match=r"Gumbel\(\.\.\.\) \(gumbel_temperature\) samples from logits"
    ):
        CandidateOptions(gumbel_temperature=0.5).check(5, from_logits=False)
    with pytest.raises(ValueError, match="gumbel_temperature"):
        CandidateOptions(gumbel_temperature=0.0).check(5)
    with pytest.raises(TypeError, match="straight_through must be a bool"):
        CandidateOptions(straight_through=1).check(5)
    CandidateOptions(top_k=5, straight_through=True, gumbel_temperature=0.5).check(5)


def test_candidate_weights_apply_noise_then_cut_then_normalise_then_one_hot():
    scores = torch.tensor([[3.0, 1.0, 2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    # noise that reverses the order: the cut must see the perturbed scores, not the scores
    reverse = lambda s: -s  # noqa: E731
    options = CandidateOptions(top_k=2, straight_through=True, gumbel_temperature=1.0)
    weights, kept = candidate_weights(scores, options, perturb=reverse)
    assert kept.tolist() == [[1, 3]]  # in token order
    assert weights.tolist() == [[0.0, 1.0]]  # the one-hot of the softmax over the kept two
    weights[0, 0].backward()  # straight-through: the softmax's gradient reaches the scores
    soft = torch.softmax(torch.tensor([0.0, -1.0], dtype=torch.float64), -1)
    assert scores.grad[0, 1].item() == pytest.approx(-soft[1].item() * (1 - soft[1].item()))
    probs, _ = candidate_weights(
        torch.tensor([[0.2, 0.6, 0.1]]), CandidateOptions(top_k=2), probabilities=True
    )
    assert probs.tolist() == [[pytest.approx(0.25), pytest.approx(0.75)]]  # tokens 0 and 1
    with pytest.raises(ValueError, match="Gumbel noise needs"):
        candidate_weights(scores, CandidateOptions(gumbel_temperature=1.0))


@pytest.mark.parametrize(
    "options", [{"top_k": 4}, {"top_k": 4, "straight_through": True, "gumbel_temperature": 0.5}]
)
def test_dense_and_chunked_kernels_form_their_weights_in_the_one_place(monkeypatch, options):
    """Both kernels call :func:`candidate_weights` (the order written once) and agree."""
    import bsloss.distributions as dense
    import bsloss.functional.fused_expectation as chunked

    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1])
        return candidate_weights(*args, **kwargs)

    monkeypatch.setattr(dense, "candidate_weights", spy)
    monkeypatch.setattr(chunked, "candidate_weights", spy)
    torch.manual_seed(0)
    hidden, head, table = torch.randn(6, 8), torch.randn(40, 8), torch.randn(40, 3)
    fused = chunked.fused_expected_inputs(
        hidden, head, table, **options, gumbel_seed=3, chunk_elements=32
    )
    distribution = dense.token_distribution((hidden @ head.T)[None], **options, gumbel_seed=3)
    expected = torch.einsum("blk,blkc->blc", distribution.weights, table[distribution.indices])
    assert len(calls) == 2 and calls[0] == calls[1] == CandidateOptions(**options)
    torch.testing.assert_close(fused.expected, expected[0], atol=1e-5, rtol=1e-5)
