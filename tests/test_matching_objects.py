"""Matchings as objects: the object and string forms agree, parameters are validated where the
object is built, a custom subclass works end to end, and the package version has one home."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bsloss
from bsloss import BERTScoreLoss, Hard, LogSumExp, Matching, Sinkhorn, Softmax
from bsloss.functional import (
    bert_score,
    hard_match,
    logsumexp_match,
    resolve_matching,
    sinkhorn_match,
    softmax_match,
    token_scores,
)
from bsloss.functional.matching import SHORTHANDS
from bsloss.scorer.encoder import ScorerEncoder

# (string form with its legacy keywords, the object it stands for)
PAIRS = [
    (dict(matching="hard"), Hard()),
    (dict(matching="softmax", temperature=0.07), Softmax(temperature=0.07)),
    (dict(matching="logsumexp", temperature=0.2), LogSumExp(temperature=0.2)),
    (
        dict(matching="sinkhorn", temperature=0.15, sinkhorn_iterations=3),
        Sinkhorn(temperature=0.15, iterations=3),
    ),
]
IDS = [kwargs["matching"] for kwargs, _ in PAIRS]


def _batch(seed=0, batch=3, lc=5, lr=4, d=6):
    g = torch.Generator().manual_seed(seed)
    cand = torch.randn(batch, lc, d, generator=g, dtype=torch.float64)
    ref = torch.randn(batch, lr, d, generator=g, dtype=torch.float64)
    cand_mask = torch.ones(batch, lc, dtype=torch.bool)
    ref_mask = torch.ones(batch, lr, dtype=torch.bool)
    cand_mask[1, 3:] = False
    ref_mask[2, 2:] = False
    cand_w = torch.rand(batch, lc, generator=g, dtype=torch.float64) + 0.1
    ref_w = torch.rand(batch, lr, generator=g, dtype=torch.float64) + 0.1
    return cand, ref, cand_mask, ref_mask, cand_w, ref_w


def _prf_and_grads(**matching):
    cand, ref, cand_mask, ref_mask, cand_w, ref_w = _batch()
    cand.requires_grad_(True)
    ref.requires_grad_(True)
    prf = bert_score(cand, ref, cand_mask, ref_mask, cand_w, ref_w, **matching)
    torch.stack(prf).sum().backward()
    return torch.stack(prf).detach(), cand.grad, ref.grad


# ----------------------------------------------------------------- object == string
@pytest.mark.parametrize(("legacy", "obj"), PAIRS, ids=IDS)
def test_functional_object_and_string_give_identical_scores_and_gradients(legacy, obj):
    want = _prf_and_grads(**legacy)
    got = _prf_and_grads(matching=obj)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


@pytest.mark.parametrize(("legacy", "obj"), PAIRS, ids=IDS)
def test_token_scores_object_and_string_agree(legacy, obj):
    cand, ref, cand_mask, ref_mask, _, _ = _batch(seed=1)
    want = token_scores(cand, ref, cand_mask, ref_mask, **legacy)
    got = token_scores(cand, ref, cand_mask, ref_mask, matching=obj)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_one_default_temperature_for_objects_shorthands_and_entry_points(scorer):
    """T = 0.05 (bsloss.functional.matching.base.DEFAULT_TEMPERATURE) and one Sinkhorn step,
    whether the matching is an object, a shorthand of bert_score or one of BERTScoreLoss."""
    from bsloss import BERTScoreLoss
    from bsloss.functional.matching.base import DEFAULT_TEMPERATURE

    assert DEFAULT_TEMPERATURE == 0.05
    for name, cls in (("softmax", Softmax), ("logsumexp", LogSumExp), ("sinkhorn", Sinkhorn)):
        assert cls().temperature == DEFAULT_TEMPERATURE
        assert resolve_matching(name) == cls(temperature=DEFAULT_TEMPERATURE)
        loss = BERTScoreLoss(encoder=scorer.encoder, matching=name)
        assert loss.matching == cls(temperature=DEFAULT_TEMPERATURE)
    want = _prf_and_grads(matching=Sinkhorn(temperature=0.05, iterations=1))
    got = _prf_and_grads(matching="sinkhorn")
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    got = _prf_and_grads(matching="logsumexp")
    want = _prf_and_grads(matching=LogSumExp(temperature=0.05))
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)


def test_self_normalization_follows_the_object_not_the_name():
    cand, ref, *_ = _batch(seed=2)
    plain = bert_score(cand, ref, matching=Sinkhorn(), self_normalize=False)
    default = bert_score(cand, ref, matching=Sinkhorn())
    assert not torch.allclose(plain.f1, default.f1)
    explicit = bert_score(cand, ref, matching=Sinkhorn(), self_normalize=True)
    torch.testing.assert_close(default.f1, explicit.f1, atol=0, rtol=0)
    assert Sinkhorn.self_normalizes and not Softmax.self_normalizes
    assert Hard.is_hard and not Sinkhorn().is_hard


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize("cls", [Softmax, LogSumExp, Sinkhorn])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_temperature_validated_at_construction(cls, bad):
    with pytest.raises(ValueError, match="temperature"):
        cls(temperature=bad)


@pytest.mark.parametrize("cls", [Softmax, LogSumExp, Sinkhorn])
def test_temperature_type_validated(cls):
    with pytest.raises(TypeError, match="temperature"):
        cls(temperature="hot")
    with pytest.raises(TypeError, match="temperature"):
        cls(temperature=True)


@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_sinkhorn_iterations_validated_at_construction(bad, error):
    with pytest.raises(error, match="iterations"):
        Sinkhorn(iterations=bad)


def test_unknown_shorthand_lists_the_names():
    with pytest.raises(ValueError, match=r"hard.*logsumexp.*sinkhorn.*softmax.*'softmx'"):
        resolve_matching("softmx")
    with pytest.raises(TypeError, match="matching must be"):
        resolve_matching(softmax_match)


def test_a_conflicting_legacy_keyword_is_an_error_an_equal_one_is_not():
    obj = Sinkhorn(temperature=0.1, iterations=2)
    assert resolve_matching(obj, temperature=0.1, sinkhorn_iterations=2) is obj
    with pytest.raises(ValueError, match=r"temperature=0\.2 conflicts"):
        resolve_matching(obj, temperature=0.2)
    with pytest.raises(ValueError, match="sinkhorn_iterations=3 conflicts"):
        resolve_matching(obj, sinkhorn_iterations=3)
    with pytest.raises(ValueError, match="no temperature"):
        resolve_matching(Hard(), temperature=0.1)
    cand, ref, *_ = _batch()
    with pytest.raises(ValueError, match="conflicts"):
        bert_score(cand, ref, matching=Softmax(temperature=0.05), temperature=0.1)


def test_legacy_keywords_validated_on_the_string_path():
    with pytest.raises(TypeError, match="sinkhorn_iterations"):
        resolve_matching("sinkhorn", sinkhorn_iterations=1.5)
    with pytest.raises(ValueError, match="sinkhorn_iterations"):
        resolve_matching("sinkhorn", sinkhorn_iterations=0)
    with pytest.raises(ValueError, match="temperature"):
        resolve_matching("logsumexp", temperature=-1.0)


def test_kernels_reject_wrong_keywords():
    sim = torch.randn(1, 2, 3)
    c, r = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(TypeError):
        hard_match(sim, c, r, temperature=0.1)
    with pytest.raises(TypeError):
        softmax_match(sim, c, r, temperature=0.1, sinkhorn_iterations=1)
    with pytest.raises(TypeError):
        logsumexp_match(sim, c, r, temperature=0.1, temprature=0.2)
    with pytest.raises(TypeError):
        sinkhorn_match(sim, c, r, temperature=0.1, iterations=2)
    with pytest.raises(TypeError):
        Softmax(temprature=0.1)


def test_repr_and_equality():
    assert repr(Hard()) == "Hard()"
    assert repr(Softmax(temperature=0.05)) == "Softmax(temperature=0.05)"
    assert repr(LogSumExp(0.2)) == "LogSumExp(temperature=0.2)"
    assert (
        repr(Sinkhorn(temperature=0.1, iterations=2)) == "Sinkhorn(temperature=0.1, iterations=2)"
    )
    assert Sinkhorn(0.1, 2) == Sinkhorn(0.1, 2) and Sinkhorn(0.1, 2) != Sinkhorn(0.1, 3)
    assert Softmax(0.1) != LogSumExp(0.1)
    assert len({Softmax(0.1), Softmax(0.1), Hard()}) == 2
    assert eval(repr(Sinkhorn(0.3, 4)), vars(bsloss)) == Sinkhorn(0.3, 4)


# ----------------------------------------------------------------- a custom matching
class MeanMatch(Matching):
    """A toy matching: each token's score is its mean similarity over the real partners."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def parameters(self):
        return {"scale": self.scale}

    def __call__(self, sim, candidate_mask, reference_mask):
        valid = (candidate_mask[:, :, None] & reference_mask[:, None, :]).to(sim.dtype)
        total = sim * valid
        cand = total.sum(2) / valid.sum(2).clamp_min(1)
        ref = total.sum(1) / valid.sum(1).clamp_min(1)
        return self.scale * cand, self.scale * ref


def test_custom_matching_in_bert_score():
    cand, ref, cand_mask, ref_mask, cand_w, ref_w = _batch(seed=3)
    cand.requires_grad_(True)
    out = bert_score(cand, ref, cand_mask, ref_mask, cand_w, ref_w, matching=MeanMatch())
    # by hand: weighted mean over candidate tokens of the mean cosine similarity
    c = torch.nn.functional.normalize(cand.detach(), dim=-1)
    r = torch.nn.functional.normalize(ref, dim=-1)
    sim = c @ r.transpose(1, 2)
    valid = (cand_mask[:, :, None] & ref_mask[:, None, :]).double()
    per_token = (sim * valid).sum(2) / valid.sum(2).clamp_min(1)
    w = cand_w * cand_mask
    torch.testing.assert_close(out.precision, (per_token * w).sum(1) / w.sum(1))
    out.f1.sum().backward()
    assert torch.isfinite(cand.grad).all() and cand.grad.abs().sum() > 0
    assert MeanMatch not in SHORTHANDS.values()  # no name: not a shorthand
    assert repr(MeanMatch(2.0)) == "MeanMatch(scale=2.0)"


def test_an_abstract_matching_cannot_be_built():
    class Incomplete(Matching):
        pass

    with pytest.raises(TypeError):
        Incomplete()


def test_a_taken_shorthand_is_refused():
    with pytest.raises(ValueError, match="'softmax' is taken"):

        class Other(Matching):
            name = "softmax"

            def __call__(self, sim, candidate_mask, reference_mask):
                return sim.amax(2), sim.amax(1)

    assert SHORTHANDS["softmax"] is Softmax


# ----------------------------------------------------------------- the loss
@pytest.fixture(scope="module")
def encoder():
    return ScorerEncoder.from_pretrained(None)


def _loss_value_and_grad(loss, encoder):
    g = torch.Generator().manual_seed(0)
    vocab = encoder.input_embeddings.num_embeddings
    logits = (torch.randn(2, 5, vocab, generator=g) * 3).requires_grad_(True)
    value = loss(logits=logits, references=["a cat sat on the mat", "the dog ran home"])
    value.sum().backward()
    return value.detach(), logits.grad


@pytest.mark.parametrize(("legacy", "obj"), PAIRS, ids=IDS)
def test_loss_object_and_string_give_identical_values_and_gradients(encoder, legacy, obj):
    by_name = BERTScoreLoss(encoder=encoder, reduction="none", **legacy)
    by_object = BERTScoreLoss(encoder=encoder, reduction="none", matching=obj)
    assert by_name.matching == obj and by_object.matching is obj
    want = _loss_value_and_grad(by_name, encoder)
    got = _loss_value_and_grad(by_object, encoder)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_loss_string_defaults_and_conflicts(encoder):
    assert BERTScoreLoss(encoder=encoder).matching == Softmax(temperature=0.05)
    assert BERTScoreLoss(encoder=encoder, matching="sinkhorn").matching == Sinkhorn(0.05, 1)
    assert BERTScoreLoss(encoder=encoder, matching="hard", temperature=0.3).matching == Hard()
    with pytest.raises(ValueError, match="conflicts"):
        BERTScoreLoss(encoder=encoder, matching=Sinkhorn(iterations=2), sinkhorn_iterations=5)
    with pytest.raises(ValueError, match="matching must be one of"):
        BERTScoreLoss(encoder=encoder, matching="sinkorn")


def test_custom_matching_in_the_loss(encoder):
    loss = BERTScoreLoss(encoder=encoder, matching=MeanMatch(), reduction="none")
    value, grad = _loss_value_and_grad(loss, encoder)
    assert value.shape == (2,) and torch.isfinite(value).all()
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    # the scale reaches the score: 1 - 2 s = 2 (1 - s) - 1
    doubled, _ = _loss_value_and_grad(
        BERTScoreLoss(encoder=encoder, matching=MeanMatch(2.0), reduction="none"), encoder
    )
    torch.testing.assert_close(doubled, 2 * value - 1)


# ----------------------------------------------------------------- the version
def test_version_has_one_home():
    from bsloss import _version, metric

    assert bsloss.__version__ is _version.__version__ is metric.__version__
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:  # the build backend's own reading of the dynamic version
        from setuptools.config.pyprojecttoml import read_configuration
    except ImportError:
        tomllib = pytest.importorskip("tomllib")
        config = tomllib.loads(pyproject.read_text())
        assert "version" in config["project"]["dynamic"]
        attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
        assert attr == "bsloss._version.__version__"
    else:
        assert read_configuration(pyproject)["project"]["version"] == _version.__version__


# ----------------------------------------------------------------- audit h28
def test_kernels_check_their_temperature_and_steps_and_compute_in_float32():
    """The public kernels checked nothing (``T = 0``: NaN scores, ``T < 0``: a soft minimum,
    ``sinkhorn_iterations=0``: the unnormalised kernel's scores) and computed in the
    similarities' dtype: float16 ends at 65504, so ``sim / T`` overflowed it (``T = 1e-5``:
    NaN from ``Softmax`` and ``Sinkhorn``, inf from ``LogSumExp``)."""
    sim = torch.tensor([[[0.99, 0.2], [0.1, 0.95]]])
    c = r = torch.ones(1, 2, dtype=torch.bool)
    kernels = (softmax_match, logsumexp_match, sinkhorn_match)
    for kernel in kernels:
        for bad in (0.0, -0.1, float("nan")):
            with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
                kernel(sim, c, r, temperature=bad)
    for bad, error in ((0, ValueError), (2.5, TypeError)):
        with pytest.raises(error, match="sinkhorn_iterations"):
            sinkhorn_match(sim, c, r, temperature=0.1, sinkhorn_iterations=bad)
    for matching in (Softmax(1e-5), LogSumExp(1e-5), Sinkhorn(1e-5)):
        half = sim.half().requires_grad_(True)
        p, r_scores = matching(half, c, r)
        assert p.dtype == torch.float32
        assert torch.isfinite(p).all() and torch.isfinite(r_scores).all()
        torch.testing.assert_close(p, matching(sim, c, r)[0], rtol=0, atol=1e-3)
        p.sum().backward()
        assert torch.isfinite(half.grad).all()


def test_a_built_matching_keeps_its_parameters():
    """``Softmax(0.05).temperature = 0`` gave NaN F, ``-0.05`` a soft minimum, unchecked, and
    a changed hash under a dict; a ``Tempered`` without a kernel failed at its first call."""
    from bsloss.functional.matching.base import Tempered

    for matching, name in ((Softmax(0.05), "temperature"), (Sinkhorn(0.1, 2), "iterations")):
        with pytest.raises(AttributeError, match=rf"\.{name} is fixed when it is built"):
            setattr(matching, name, 0)
    assert Softmax(0.05) == Softmax(0.05) and hash(Sinkhorn(0.1, 2)) == hash(Sinkhorn(0.1, 2))
    with pytest.raises(TypeError, match="Tempered sets no kernel"):
        Tempered(0.1)
    custom = MeanMatch(2.0)
    custom.scale = 3.0  # a user's own matching keeps its own rules
    assert custom.parameters() == {"scale": 3.0}


def test_token_scores_and_weighted_mean_check_their_shapes():
    """``token_scores`` skipped ``bert_score``'s checks: a ``[B, 1]`` mask broadcast (a row's
    scores all zeroed), a float mask was read as true, mismatched d failed inside ``einsum``;
    ``weighted_mean`` took ``[B, 1]`` weights and returned a sum."""
    from bsloss.functional import weighted_mean

    cand, ref, cand_mask, ref_mask, _, _ = _batch()
    with pytest.raises(ValueError, match=r"candidate_mask must have shape \[B, L\] = \[3, 5\]"):
        token_scores(cand, ref, cand_mask[:, :1], ref_mask)
    with pytest.raises(TypeError, match="reference_mask"):
        token_scores(cand, ref, cand_mask, ref_mask.float() * 0.3)
    with pytest.raises(ValueError, match="agree on the batch size B and the embedding size d"):
        token_scores(cand, ref[..., :5], cand_mask, ref_mask)
    scores = token_scores(cand, ref, cand_mask, ref_mask)
    assert [tuple(s.shape) for s in scores] == [(3, 5), (3, 4)]
    with pytest.raises(ValueError, match=r"weights must have the shape of token_scores, \[3, 5\]"):
        weighted_mean(scores[0], torch.ones(3, 1))


def test_config_numbers_are_kept_as_python_numbers_and_repeat_as_equal():
    """Round 17 (left by audit h28): ``numpy.float32(0.05)`` beside ``Softmax(0.05)``
    was a conflict (0.05000000074505806 against 0.05); ``Gumbel(torch.tensor(0.5))`` and
    ``TopK(numpy.int64(4))`` kept the tensor and the numpy integer (their repr and hash)."""
    import numpy as np

    from bsloss.candidate_transforms import Gumbel, TopK

    assert resolve_matching(Softmax(0.05), temperature=np.float32(0.05)) == Softmax(0.05)
    with pytest.raises(ValueError, match="conflicts with matching=Softmax"):
        resolve_matching(Softmax(0.05), temperature=np.float32(0.0501))
    gumbel, top_k = Gumbel(torch.tensor(0.5)), TopK(np.int64(4))
    assert type(gumbel.temperature) is float and repr(gumbel) == "Gumbel(temperature=0.5)"
    assert hash(gumbel) == hash(Gumbel(0.5)) and gumbel == Gumbel(0.5)
    assert type(top_k.k) is int and repr(top_k) == "TopK(k=4)"


def test_best_over_references_names_its_bad_inputs():
    """Round 17 (left by audit h28): an owner out of range failed inside ``scatter_reduce``
    (on a GPU a device-side assert), a float owner or an int ``ignore`` inside torch."""
    from bsloss.functional import best_over_references

    scores, owner = torch.tensor([0.2, 0.7, 0.5]), torch.tensor([0, 0, 1])
    torch.testing.assert_close(best_over_references(scores, owner, 2), torch.tensor([0.7, 0.5]))
    outside = r"owner holds candidate 2, outside \[0, num_candidates\) = \[0, 2\)"
    with pytest.raises(ValueError, match=outside):
        best_over_references(scores, torch.tensor([0, 0, 2]), 2)
    with pytest.raises(ValueError, match="owner holds candidate -1"):
        best_over_references(scores, torch.tensor([-1, 0, 1]), 2)
    with pytest.raises(TypeError, match="owner must hold integer candidate indices"):
        best_over_references(scores, owner.float(), 2)
    with pytest.raises(ValueError, match=r"owner must be \[N\] = \[3\]"):
        best_over_references(scores, owner[:2], 2)
    with pytest.raises(ValueError, match="ignore must be a bool"):
        best_over_references(scores, owner, 2, ignore=torch.tensor([0, 1, 0]))
    with pytest.raises(TypeError, match="num_candidates must be an int"):
        best_over_references(scores, owner, 2.0)
