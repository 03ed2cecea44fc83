"""Candidate-distribution transforms as objects: the same loss as their keyword shorthands,
validated where they are built, refused twice or when not a transform."""

from __future__ import annotations

import pytest
import torch

import bsloss
from bsloss import CandidateTransform, Gumbel, StraightThrough, TopK
from bsloss.candidate_transforms import CandidateOptions, resolve_candidate_transforms

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
        bsloss.BERTScoreLoss(encoder=encoder, candidate_transforms=TopK(1))


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
