"""The layers a loss wraps for gradient checkpointing (``bsloss.scorer.checkpointing``) keep
the scorer's state-dict format: its keys, ``load_state_dict`` of a plain Hugging Face state
and a ``save_pretrained`` round trip are those of the model as it was loaded."""

from __future__ import annotations

import pytest
import torch

import bsloss
from bsloss.scorer.checkpointing import CheckpointedLayer
from bsloss.scorer.encoder import ScorerEncoder

PAIRS = (["A cat sat on a mat."], ["The cat sat on the mat."])


@pytest.mark.parametrize("checkpointing", ["auto", True])
def test_a_loss_leaves_the_scorers_state_dict_keys(checkpointing, tmp_path):
    """Building a loss (``gradient_checkpointing="auto"``, the default, wraps every layer too)
    renamed the shared scorer's keys (``encoder.layer.0.layer.attention...``): a plain state
    dict no longer loaded ("Missing key(s)"), and ``save_pretrained`` wrote a folder whose
    layers reloaded randomly initialised (F 0.86 instead of 0.96)."""
    encoder = ScorerEncoder.from_pretrained(device="cpu")
    model = encoder.model
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    scored = bsloss.BERTScorer(encoder=encoder).score(*PAIRS)[2]
    bsloss.BERTScoreLoss(encoder, gradient_checkpointing=checkpointing)
    assert all(isinstance(layer, CheckpointedLayer) for layer in model.encoder.layer)
    assert list(model.state_dict()) == list(plain)
    assert model.load_state_dict(plain, strict=True)  # no missing or unexpected keys
    model.save_pretrained(tmp_path)
    encoder.tokenizer.save_pretrained(tmp_path)
    reloaded = bsloss.BERTScorer(model_type=str(tmp_path), num_layers=6, device="cpu")
    torch.testing.assert_close(reloaded.score(*PAIRS)[2], scored, rtol=0, atol=1e-6)


def test_a_wrapped_layer_loads_its_own_state_and_checkpoints_as_before():
    """The hooks map the keys only: the wrapped layer's state loads into it (the values
    change), and a checkpointed backward equals the plain one."""
    encoder = ScorerEncoder.from_pretrained(device="cpu")
    loss = bsloss.BERTScoreLoss(encoder, gradient_checkpointing=True, reduction="none")
    layer = encoder.model.encoder.layer[0]
    state = {k: v + 1.0 for k, v in layer.state_dict().items()}
    assert not any(k.startswith("layer.") for k in state)
    layer.load_state_dict(state)
    torch.testing.assert_close(layer.state_dict(), state, rtol=0, atol=0)
    plain = bsloss.BERTScoreLoss(encoder, gradient_checkpointing=False, reduction="none")
    logits = torch.randn(2, 5, encoder.input_embeddings.num_embeddings, requires_grad=True)
    (checkpointed,) = torch.autograd.grad(
        loss(logits=logits, references=["a", "b c"]).sum(), logits
    )
    (eager,) = torch.autograd.grad(plain(logits=logits, references=["a", "b c"]).sum(), logits)
    torch.testing.assert_close(checkpointed, eager, rtol=0, atol=1e-6)
