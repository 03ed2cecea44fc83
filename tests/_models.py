"""Tiny randomly initialised generators, shared by the test files (one copy of each builder):
GPT-2, BERT2BERT and Gemma 3 over a given tokenizer, BART, T5, BERT2BERT and T5Gemma over a small
vocabulary, PaliGemma; every builder seeds torch first, so a test's numbers do not depend on
what ran before it."""

from __future__ import annotations

import copy

import torch


def scorer_vocabulary_tokenizer(scorer):
    """The embedded scorer's tokenizer as a causal LM's: [CLS] as bos, [SEP] as eos (a BERT
    tokenizer has neither)."""
    tokenizer = copy.deepcopy(scorer.encoder.tokenizer)
    tokenizer.bos_token, tokenizer.eos_token = "[CLS]", "[SEP]"
    return tokenizer


def tiny_gpt2(tokenizer, **config):
    """A one-layer GPT-2 over ``tokenizer``'s vocabulary, seeded; ``config`` overrides its sizes
    or token ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        **{
            "vocab_size": len(tokenizer),
            "n_positions": 64,
            "n_embd": 32,
            "n_layer": 1,
            "n_head": 2,
            "bos_token_id": tokenizer.cls_token_id,
            "eos_token_id": tokenizer.sep_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **config,
        }
    )
    return GPT2LMHeadModel(config)


def tiny_bert2bert(tokenizer):
    """A one-layer BERT2BERT (encoder-decoder) over ``tokenizer``'s vocabulary, seeded: [CLS]
    starts the decoder, [SEP] ends it."""
    import transformers

    torch.manual_seed(0)
    small = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    encoder = transformers.BertConfig(**small)
    decoder = transformers.BertConfig(**small, is_decoder=True, add_cross_attention=True)
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = tokenizer.cls_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.sep_token_id
    return transformers.EncoderDecoderModel(config=config)


def tiny_gemma(
    tokenizer,
    *,
    tied: bool = True,
    softcap: float | None = None,
    hidden_size: int = 48,
    intermediate_size: int = 64,
    num_hidden_layers: int = 1,
    head_dim: int = 24,
    **config,
):
    """A Gemma 3 causal LM over ``tokenizer``'s vocabulary (a real 262,144-token one in the LM-head
    and training-signal tests), seeded: one layer, 48 wide, by default; ``tied`` input and output
    embeddings, the final logit soft-cap ``softcap``; other sizes and ``config`` (token ids,
    positions) as given."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
        final_logit_softcapping=softcap,
        **config,
    )
    return Gemma3ForCausalLM(config)


def tiny_seq2seq(kind: str, vocab_size: int = 97, softcap: float | None = None):
    """A tiny random BART, T5, BERT2BERT or T5Gemma (whose final logit soft-cap ``softcap`` sits
    in its decoder's config) over ``vocab_size`` tokens, seeded, for the LM-head tests."""
    import transformers

    torch.manual_seed(0)
    if kind == "t5gemma":
        module = transformers.T5GemmaModuleConfig(
            vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, final_logit_softcapping=softcap,
        )  # fmt: skip
        config = transformers.T5GemmaConfig(
            encoder=module.to_dict(), decoder=module.to_dict(), vocab_size=vocab_size
        )
        return transformers.T5GemmaForConditionalGeneration(config)
    if kind == "bart":
        config = transformers.BartConfig(
            vocab_size=vocab_size, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=32,
        )  # fmt: skip
        model = transformers.BartForConditionalGeneration(config)
        with torch.no_grad():  # BART's bias after the head, nonzero so that it counts
            model.final_logits_bias.normal_()
        return model
    if kind == "t5":
        config = transformers.T5Config(
            vocab_size=vocab_size, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            decoder_start_token_id=0, tie_word_embeddings=True,
        )  # fmt: skip
        return transformers.T5ForConditionalGeneration(config)
    bert = transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    decoder = transformers.BertConfig(**{**bert.to_dict(), "is_decoder": True})
    decoder.add_cross_attention = True
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(bert, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return transformers.EncoderDecoderModel(config=config)


def scripted(model, answers: list[list[int]]):
    """``model.generate`` replaced by fixed answers, laid out as ``generate`` lays them out:
    after the prompts, each answer cut after its first end token (the call's ``eos_token_id``)
    and to ``max_new_tokens``, then padded with the call's ``pad_token_id`` to the longest."""

    def generate(input_ids, pad_token_id, eos_token_id, max_new_tokens, **options):
        ends = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        rows = []
        for answer in answers:
            answer = answer[:max_new_tokens]
            stops = [i for i, token in enumerate(answer) if token in ends]
            rows.append(answer[: stops[0] + 1] if stops else answer)
        width = max(len(row) for row in rows)
        rows = [row + [pad_token_id] * (width - len(row)) for row in rows]
        return torch.cat([input_ids, torch.tensor(rows, dtype=input_ids.dtype)], dim=1)

    model.generate = generate
    return model


def tiny_paligemma(vocab_size: int = 97, softcap: float | None = None):
    """A tiny random PaliGemma over a Gemma 2 text model: a conditional-generation model that
    reads its final logit soft-cap from ``config.get_text_config()``, as Gemma 3n and 4 do."""
    import transformers

    torch.manual_seed(0)
    text = transformers.Gemma2Config(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0,
        final_logit_softcapping=softcap,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=16, patch_size=8,
    )  # fmt: skip
    config = transformers.PaliGemmaConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(),
        image_token_index=vocab_size - 1, projection_dim=16,
    )  # fmt: skip
    return transformers.PaliGemmaForConditionalGeneration(config)
