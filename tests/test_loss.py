"""BERTScoreLoss through the real embedded scorer: exactness, gradients, checkpointing, errors."""

from __future__ import annotations

import copy

import pytest
import torch

import bsloss
from bsloss import BERTScoreLoss, BERTScorer
from bsloss.scorer.encoder import ScorerEncoder


@pytest.fixture(scope="module")
def encoder():
    return ScorerEncoder.from_pretrained(None)


@pytest.fixture(scope="module")
def pairs(stsb_dev):
    rows = stsb_dev[:24]
    return [s1 for _, s1, _ in rows], [s2 for _, _, s2 in rows]


def one_hot_logits(encoder, texts, value=1e4):
    ids = [encoder.tokenizer(t.strip(), add_special_tokens=False)["input_ids"] for t in texts]
    length, vocab = max(map(len, ids)), encoder.input_embeddings.num_embeddings
    logits = torch.zeros(len(ids), length, vocab)
    mask = torch.zeros(len(ids), length, dtype=torch.bool)
    for b, row in enumerate(ids):
        logits[b, torch.arange(len(row)), torch.tensor(row)] = value
        mask[b, : len(row)] = True
    return logits, mask


def test_one_hot_hard_loss_equals_bertscorer(encoder, pairs):
    cands, refs = pairs
    logits, mask = one_hot_logits(encoder, cands)
    loss = BERTScoreLoss(encoder=encoder, matching="hard")
    ours = loss.score(logits=logits, candidate_mask=mask, references=refs)
    exact = BERTScorer(encoder=encoder).score(cands, refs)
    for a, b in zip(ours, exact, strict=True):
        assert (a.detach() - b).abs().max() <= 1e-5


def test_one_hot_with_idf_and_rescaling_equals_bertscorer(encoder, pairs):
    cands, refs = pairs
    logits, mask = one_hot_logits(encoder, cands)
    loss = BERTScoreLoss(encoder=encoder, matching="hard", idf=refs, rescale_with_baseline=True)
    ours = loss.score(logits=logits, candidate_mask=mask, references=refs)
    exact = BERTScorer(encoder=encoder, idf=refs, rescale_with_baseline=True).score(cands, refs)
    for a, b in zip(ours, exact, strict=True):
        assert (a.detach() - b).abs().max() <= 1e-5


@pytest.mark.parametrize("matching", ["softmax", "logsumexp"])
def test_soft_at_small_temperature_close_to_hard(encoder, pairs, matching):
    cands, refs = pairs
    logits, mask = one_hot_logits(encoder, cands)
    hard = BERTScoreLoss(encoder=encoder, matching="hard").score(
        logits=logits, candidate_mask=mask, references=refs
    )
    soft = BERTScoreLoss(encoder=encoder, matching=matching, temperature=1e-3).score(
        logits=logits, candidate_mask=mask, references=refs
    )
    assert (soft.f1 - hard.f1).abs().max() <= 1e-3


def test_straight_through_forward_is_hard_score_of_argmax_tokens(encoder, pairs):
    cands, refs = pairs
    torch.manual_seed(0)
    logits, mask = one_hot_logits(encoder, cands, value=4.0)
    logits = logits + torch.randn_like(logits) * 1.5  # argmax differs from the text sometimes
    logits.requires_grad_(True)
    loss = BERTScoreLoss(encoder=encoder, matching="hard", straight_through=True)
    st = loss.score(logits=logits, candidate_mask=mask, references=refs)
    argmax = logits.detach().argmax(-1)
    decoded = BERTScoreLoss(encoder=encoder, matching="hard").score(
        candidate_ids=argmax, candidate_mask=mask, references=refs
    )
    assert (st.f1.detach() - decoded.f1).abs().max() <= 1e-6
    st.f1.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_finite_difference_through_real_scorer_float64(encoder):
    enc64 = copy.deepcopy(encoder).double()
    loss = BERTScoreLoss(
        encoder=enc64, matching="softmax", temperature=0.1, top_k=None, gradient_checkpointing=True
    )
    torch.manual_seed(1)
    vocab = enc64.input_embeddings.num_embeddings
    logits = torch.randn(1, 3, vocab, dtype=torch.float64) * 2
    logits[0, :, [2158, 4937, 2003]] += 8.0  # a few plausible tokens carry most of the mass
    logits.requires_grad_(True)
    refs = ["a man is playing a guitar."]
    value = loss(logits=logits, references=refs)
    (grad,) = torch.autograd.grad(value, logits)
    eps = 1e-5
    coordinates = [(0, 0, 2158), (0, 1, 4937), (0, 2, 2003), (0, 1, 2158)]
    for b, t, v in coordinates:
        shifted = logits.detach().clone()
        shifted[b, t, v] += eps
        up = loss(logits=shifted, references=refs)
        shifted[b, t, v] -= 2 * eps
        down = loss(logits=shifted, references=refs)
        numeric = (up - down) / (2 * eps)
        assert abs(numeric.item() - grad[b, t, v].item()) <= 1e-6 + 1e-4 * abs(numeric.item())
    assert any(abs(grad[c].item()) > 1e-6 for c in coordinates)


@pytest.mark.parametrize("top_k", [None, 32])
def test_checkpointing_same_loss_and_gradients(encoder, pairs, top_k):
    cands, refs = pairs
    torch.manual_seed(2)
    logits, mask = one_hot_logits(encoder, cands[:4], value=3.0)
    logits = (logits + torch.randn_like(logits)).requires_grad_(True)
    results = []
    for checkpointing in (False, True):
        loss = BERTScoreLoss(
            encoder=encoder,
            matching="softmax",
            temperature=0.05,
            top_k=top_k,
            gradient_checkpointing=checkpointing,
        )
        value = loss(logits=logits, candidate_mask=mask, references=refs[:4])
        (grad,) = torch.autograd.grad(value, logits)
        results.append((value.detach(), grad))
    (v0, g0), (v1, g1) = results
    assert (v0 - v1).abs() <= 1e-6
    assert (g0 - g1).abs().max() <= 1e-6


def test_checkpointed_scorer_keeps_its_submodules_reachable(encoder):
    BERTScoreLoss(encoder=encoder, gradient_checkpointing=True)
    first = encoder.model.encoder.layer[0]
    assert type(first).__name__ == "CheckpointedLayer"
    # code that inspects the scorer (dtype checks, hooks) sees the wrapped layer's parts
    assert first.intermediate is first.layer.intermediate
    assert first.intermediate.dense.weight.dtype == torch.float32
    with pytest.raises(AttributeError):
        first.no_such_part  # noqa: B018


def test_scorer_stays_frozen(encoder, pairs):
    cands, refs = pairs
    logits, mask = one_hot_logits(encoder, cands[:2], value=2.0)
    logits.requires_grad_(True)
    loss = BERTScoreLoss(encoder=encoder)
    loss(logits=logits, candidate_mask=mask, references=refs[:2]).backward()
    assert all(p.grad is None and not p.requires_grad for p in encoder.parameters())
    assert not encoder.training
    loss.train()  # a generator's .train() must not switch the scorer's dropout on
    assert not encoder.training and not encoder.model.training


@pytest.mark.parametrize("matching", ["hard", "softmax", "logsumexp", "sinkhorn"])
def test_edge_cases_finite(encoder, pairs, matching):
    cands, refs = pairs
    logits, mask = one_hot_logits(encoder, cands[:3], value=1e4)
    logits[1] = -1e4  # logits of +-1e4
    mask[2] = False  # an empty candidate
    logits.requires_grad_(True)
    loss = BERTScoreLoss(encoder=encoder, matching=matching, temperature=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = loss(
            logits=logits,
            candidate_mask=mask,
            references=refs[:3],
        )
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logits.grad).all()
    per_sample = BERTScoreLoss(encoder=encoder, matching=matching, reduction="none")(
        logits=logits.detach(), candidate_mask=mask, references=refs[:3]
    )
    assert per_sample[2] == 1.0  # empty candidate: score 0


def test_bf16_autocast_close_to_fp32(encoder, pairs):
    cands, refs = pairs
    logits, mask = one_hot_logits(encoder, cands[:6], value=3.0)
    loss = BERTScoreLoss(encoder=encoder, matching="softmax", reduction="none")
    exact = loss(logits=logits, candidate_mask=mask, references=refs[:6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = loss(logits=logits, candidate_mask=mask, references=refs[:6])
    assert mixed.dtype == torch.float32
    assert (mixed - exact).abs().max() < 0.02


def test_multiple_references_take_best(encoder, pairs):
    cands, refs = pairs
    logits, mask = one_hot_logits(encoder, cands[:3])
    loss = BERTScoreLoss(encoder=encoder, matching="hard", reduction="none")
    groups = [[refs[0], cands[0]], [refs[1]], [cands[2], refs[2], refs[0]]]
    multi = loss(logits=logits, candidate_mask=mask, references=groups)
    assert multi[0] <= 1e-5 and multi[2] <= 1e-5  # the candidate itself is among the refs
    single = loss(logits=logits, candidate_mask=mask, references=refs[:3])
    assert multi[1] == pytest.approx(single[1].item(), abs=1e-6)


def test_embeddings_input_and_targets(encoder, pairs):
    cands, refs = pairs
    loss = BERTScoreLoss(encoder=encoder, matching="hard", target="precision", reduction="sum")
    hidden, mask, _ = loss.encode_references(cands[:2])
    hidden = hidden.clone().requires_grad_(True)
    value = loss(embeddings=hidden, candidate_mask=mask, references=refs[:2])
    value.backward()
    assert hidden.grad.abs().sum() > 0


def test_bad_input_errors(encoder, pairs):
    cands, refs = pairs
    logits, mask = one_hot_logits(encoder, cands[:2])
    for temperature in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            BERTScoreLoss(encoder=encoder, matching="softmax", temperature=temperature)
    loss = BERTScoreLoss(encoder=encoder)
    with pytest.raises(ValueError, match="logits has a vocabulary of 100"):
        loss(logits=torch.randn(2, 3, 100), references=refs[:2])
    with pytest.raises(ValueError, match="candidate_mask"):
        loss(logits=logits, candidate_mask=mask[:, :-1], references=refs[:2])
    bad = logits.clone()
    bad[1, 0, 5] = float("nan")
    with pytest.raises(ValueError, match="logits contains NaN"):
        loss(logits=bad, candidate_mask=mask, references=refs[:2])
    bad[1, 0, 5] = float("inf")
    with pytest.raises(ValueError, match="logits contains NaN or Inf"):
        loss(logits=bad, candidate_mask=mask, references=refs[:2])
    with pytest.raises(ValueError, match="references has 3 entries"):
        loss(logits=logits, candidate_mask=mask, references=refs[:3])
    with pytest.raises(ValueError, match="target"):
        BERTScoreLoss(encoder=encoder, target="accuracy")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_autocast(pairs):
    cands, refs = pairs
    encoder = ScorerEncoder.from_pretrained(None, device="cuda")
    logits, mask = one_hot_logits(encoder, cands[:4], value=3.0)
    logits = logits.cuda().requires_grad_(True)
    loss = BERTScoreLoss(encoder=encoder)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        value = loss(logits=logits, candidate_mask=mask.cuda(), references=refs[:4])
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logits.grad).all()
    assert bsloss.BERTScorer(encoder=encoder).score(cands[:4], refs[:4])[2].is_cpu


# ---------------------------------------------------------------- device placement
# No second real device on a CPU machine: the "meta" device stands in for CUDA. What failed on a
# GPU (the weight buffer left on the CPU beside a CUDA encoder: `torch.cat` of the two in the
# generator table) fails the same way here.


def test_a_loss_built_around_an_encoder_elsewhere_puts_its_tables_there():
    encoder = ScorerEncoder.from_pretrained(None, device="cpu").to("meta")
    loss = BERTScoreLoss(encoder=encoder, rescale_with_baseline=True)
    assert loss.scorer_weights.device.type == "meta"
    assert loss.baseline.device.type == "meta"
    assert loss._generator_table().device.type == "meta"


def test_the_loss_follows_an_encoder_moved_on_its_own():
    loss = BERTScoreLoss(encoder=ScorerEncoder.from_pretrained(None, device="cpu"))
    loss.encoder.to("meta")  # as a trainer or a user placing only the scorer would
    assert loss._generator_table().device.type == "meta"
    assert loss.scorer_weights.device.type == "meta"


@pytest.mark.parametrize("argument", ["logits", "reference_ids"])
def test_inputs_on_another_device_are_refused_naming_the_argument_and_both_devices(
    encoder, argument
):
    loss = BERTScoreLoss(encoder=encoder)
    vocab = encoder.input_embeddings.num_embeddings
    logits = torch.randn(1, 3, vocab)
    ids = torch.tensor([[101, 1037, 102]])
    if argument == "logits":
        call = {"logits": logits.to("meta"), "references": ["a cat"]}
    else:
        call = {"logits": logits, "reference_ids": ids.to("meta")}
    with pytest.raises(ValueError, match=f"{argument} is on meta but the scorer is on cpu"):
        loss(**call)


def test_the_lm_head_and_targets_must_sit_with_the_hidden_states(encoder):
    loss = BERTScoreLoss(encoder=encoder)
    vocab = encoder.input_embeddings.num_embeddings
    hidden, head = torch.randn(1, 3, 8), torch.randn(vocab, 8)
    head_elsewhere = "output_embeddings is on meta but hidden_states is on cpu"
    with pytest.raises(ValueError, match=head_elsewhere):
        loss(hidden_states=hidden, output_embeddings=head.to("meta"), references=["a cat"])
    targets = torch.zeros(1, 3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="target_ids is on meta but hidden_states is on cpu"):
        loss(hidden_states=hidden, output_embeddings=head, target_ids=targets, references=["a"])


# ---------------------------------------------------------------- scorer checkpointing
def _layer_runs(loss, call) -> int:
    """How many times the scorer's first layer runs with grad in a forward + backward of
    ``call()``: 1 without checkpointing, 2 when the backward recomputes it."""
    from bsloss.scorer.checkpointing import CheckpointedLayer
    from bsloss.scorer.layers import _find_layer_stack

    owner, leaf = _find_layer_stack(loss.encoder.model)
    first = getattr(owner, leaf)[0]
    inner = first.layer if isinstance(first, CheckpointedLayer) else first
    runs = []
    forward = inner.forward  # (forward hooks do not fire in checkpoint's recomputation)

    def counted(*args, **kwargs):
        runs.append(torch.is_grad_enabled())  # the references' encoding runs without grad
        return forward(*args, **kwargs)

    inner.forward = counted
    try:
        call().backward()
    finally:
        del inner.forward
    return sum(runs)


def test_auto_checkpointing_recomputes_only_calls_whose_activations_are_large(
    encoder, pairs, monkeypatch
):
    import bsloss.scorer.checkpointing as checkpointing

    cands, refs = pairs
    logits, mask = one_hot_logits(encoder, cands[:2], value=3.0)
    logits.requires_grad_(True)
    loss = BERTScoreLoss(encoder=copy.deepcopy(encoder))  # the default: "auto"

    def call():
        return loss(logits=logits, candidate_mask=mask, references=refs[:2])

    value = call()
    (grad,) = torch.autograd.grad(value, logits)
    assert _layer_runs(loss, call) == 1  # a few tokens of MiniLM: nothing worth recomputing
    monkeypatch.setattr(checkpointing, "AUTO_BUDGET_BYTES", 0)  # as if the call were large
    assert _layer_runs(loss, call) == 2
    torch.testing.assert_close(call(), value)
    torch.testing.assert_close(torch.autograd.grad(call(), logits)[0], grad)
    for forced, runs in ((True, 2), (False, 1)):
        forced_loss = BERTScoreLoss(encoder=copy.deepcopy(encoder), gradient_checkpointing=forced)
        assert (
            _layer_runs(
                forced_loss,
                lambda fl=forced_loss: fl(logits=logits, candidate_mask=mask, references=refs[:2]),
            )
            == runs
        )


def test_the_activation_estimate_puts_a_large_scorer_over_the_budget_and_minilm_under():
    from bsloss.scorer.checkpointing import AUTO_BUDGET_BYTES, stored_activation_bytes

    minilm = torch.empty(32, 64, 384)  # the H100 measurement's call: checkpointing paid nothing
    roberta_large = torch.empty(8, 256, 1024)
    assert stored_activation_bytes(minilm, layers=6) < AUTO_BUDGET_BYTES
    assert stored_activation_bytes(roberta_large, layers=24) > AUTO_BUDGET_BYTES


@pytest.mark.parametrize("bad", ["yes", 1.5, None])
def test_gradient_checkpointing_takes_true_false_or_auto(encoder, bad):
    with pytest.raises(ValueError, match="gradient_checkpointing must be True, False or 'auto'"):
        BERTScoreLoss(encoder=copy.deepcopy(encoder), gradient_checkpointing=bad)
