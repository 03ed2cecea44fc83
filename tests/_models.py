"""Tiny randomly initialised generators for the trainer and reward tests."""

from __future__ import annotations

import copy

import torch


def scorer_vocabulary_tokenizer(scorer):
    """The embedded scorer's tokenizer as a causal LM's: [CLS] as bos, [SEP] as eos (a BERT
    tokenizer has neither)."""
    tokenizer = copy.deepcopy(scorer.encoder.tokenizer)
    tokenizer.bos_token, tokenizer.eos_token = "[CLS]", "[SEP]"
    return tokenizer


def tiny_gpt2(tokenizer):
    """A one-layer GPT-2 over ``tokenizer``'s vocabulary, seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)
