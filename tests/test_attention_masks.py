"""Attention masks the scorer's model takes without reading them back on the host
(``bsloss/scorer/attention_masks.py``): the same hidden states as the plain ``[B, L]`` mask, for
every attention implementation and the architectures that build their masks with
transformers' ``create_bidirectional_mask`` (5.x), or, under transformers 4.x, the BERT family
that takes a ``[B, L, L]`` mask; other models keep the plain mask. (CI runs transformers 5;
``make floor-versions`` runs these under 4.57.)"""

from __future__ import annotations

import pytest
import torch
from _helpers import HostReads

from bsloss.scorer.attention_masks import _mask_builder, prepared_attention_mask

# the dimensions of a prepared mask: transformers 5's [B, 1, L, L], 4.x's [B, L, L]
PREPARED_DIM = 3 if _mask_builder() is None else 4
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 64, "vocab_size": 120}  # fmt: skip


def _model(kind: str, attention: str):
    from transformers import (
        BertConfig,
        BertModel,
        DebertaConfig,
        DebertaModel,
        MPNetConfig,
        MPNetModel,
        RobertaConfig,
        RobertaModel,
    )

    torch.manual_seed(0)
    config_class, model_class = {
        "bert": (BertConfig, BertModel),
        "mpnet": (MPNetConfig, MPNetModel),
        "roberta": (RobertaConfig, RobertaModel),
        "deberta": (DebertaConfig, DebertaModel),
    }[kind]
    config = config_class(**SMALL, attn_implementation=attention)
    return model_class(config).eval()


def _batch():
    lengths = torch.tensor([7, 3, 5, 1])
    attended = torch.arange(7)[None, :] < lengths[:, None]
    input_ids = torch.randint(5, 120, (4, 7), generator=torch.Generator().manual_seed(1))
    return input_ids, attended


@pytest.mark.parametrize(
    "kind, attention",
    [("bert", "sdpa"), ("bert", "eager"), ("roberta", "sdpa"), ("mpnet", "eager")],  # no MPNet SDPA
)
def test_prepared_mask_gives_the_same_states_without_a_host_read(kind, attention):
    model = _model(kind, attention)
    input_ids, attended = _batch()
    prepared = prepared_attention_mask(model, attended)
    if _mask_builder() is None and kind == "mpnet":  # 4.x's MPNet: the plain mask, never read
        assert prepared is attended
    else:
        assert prepared is not None and prepared.dim() == PREPARED_DIM
    with torch.no_grad():
        with HostReads() as plain_reads:
            plain = model(input_ids=input_ids, attention_mask=attended.long()).last_hidden_state
        with HostReads() as prepared_reads:
            ours = model(input_ids=input_ids, attention_mask=prepared).last_hidden_state
    real = attended[..., None]
    torch.testing.assert_close(ours * real, plain * real, atol=1e-6, rtol=1e-6)
    if attention == "sdpa":  # transformers asks the plain mask whether all of it is set
        assert plain_reads.count >= 1
    assert prepared_reads.count == 0


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.long])
def test_prepared_mask_is_the_builders_mask(attention, dtype, mask_dtype):
    """SDPA's and eager attention's masks are made here, not by transformers' builder (a dozen
    kernels a call): the same shape, dtype and values as the builder's; SDPA's a view of a
    boolean padding mask (no kernel at all)."""
    if _mask_builder() is None:
        pytest.skip("transformers 4.x: no create_bidirectional_mask to compare with")
    model = _model("bert", attention).to(dtype)
    _, attended = _batch()
    padding = attended.to(mask_dtype)
    ours = prepared_attention_mask(model, padding)
    theirs = _mask_builder()(
        config=model.config,
        inputs_embeds=torch.empty((*attended.shape, 0), dtype=dtype),
        attention_mask=padding,
        allow_is_bidirectional_skip=False,
    )
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)
    if attention == "sdpa" and mask_dtype == torch.bool:
        assert ours.untyped_storage().data_ptr() == padding.untyped_storage().data_ptr()


def test_a_host_batch_without_padding_gives_no_mask(encoder, monkeypatch):
    """embed_token_ids knows on the host whether a batch pads: without padding the model gets
    no mask (what transformers chooses after reading an all-ones one back), with it a mask."""
    from bsloss.scorer.inference import embed_token_ids

    masks = []
    original = encoder.encode_without_grad

    def recording(input_ids, attention_mask):
        masks.append(attention_mask)
        return original(input_ids, attention_mask)

    monkeypatch.setattr(encoder, "encode_without_grad", recording)
    same_length = [[101, 2000 + i, 2001 + i, 102] for i in range(4)]
    with torch.no_grad():
        embed_token_ids(encoder, same_length, batch_size=8)
        embed_token_ids(encoder, [*same_length, [101, 102]], batch_size=8)
    assert masks[0] is None
    assert masks[1] is not None and not bool(masks[1].all())


def test_other_models_keep_the_plain_mask():
    input_ids, attended = _batch()
    bert = _model("bert", "sdpa")
    assert prepared_attention_mask(bert, attended).dim() == PREPARED_DIM
    deberta = _model("deberta", "eager")  # builds its masks itself
    assert prepared_attention_mask(deberta, attended) is attended


def test_the_encoder_prepares_its_mask_where_the_host_sets_the_pace(encoder, monkeypatch):
    """The loss's path (``ScorerEncoder.forward`` with input embeddings and a device mask): on
    a GPU the mask is prepared without a read, the states and gradients as with the plain
    mask (forced here on the CPU)."""
    import bsloss.scorer.encoder

    _, attended = _batch()
    torch.manual_seed(0)
    embeds = torch.randn(4, 7, encoder.hidden_size, requires_grad=True)

    def run():
        embeds.grad = None
        with HostReads() as reads:
            hidden = encoder(inputs_embeds=embeds, attention_mask=attended.long())
        (hidden * attended[..., None]).square().sum().backward()
        return hidden.detach() * attended[..., None], embeds.grad.clone(), reads.count

    plain, plain_grad, plain_reads = run()
    monkeypatch.setattr(bsloss.scorer.encoder, "paced_by_host", lambda device: True)
    ours, grad, reads = run()
    assert plain_reads >= 1 and reads == 0
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=1e-5)
