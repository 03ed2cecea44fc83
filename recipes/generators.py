"""Generator models for the recipes: loading (seq2seq or decoder-only, offline names, a BERT2BERT
warm start), the LM head's input and weight instead of logits, token cross-entropy, and greedy or
sampled generation as label-style ids.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from config import ModelConfig
from examples import repository_path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before any tokenizer is loaded


MODEL_KINDS = ("auto", "seq2seq", "causal")


def _pretrained(path: str, kind: str, setting: str):
    """(model, tokenizer) of a folder or hub name, loaded as what its config says it is: an
    encoder-decoder (seq2seq) or a decoder-only (causal) LM. ``kind`` (``model.kind``) checks it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    found = (
        "seq2seq"
        if getattr(AutoConfig.from_pretrained(path), "is_encoder_decoder", False)
        else "causal"
    )
    if kind not in MODEL_KINDS:
        raise ValueError(f"model.kind must be one of {MODEL_KINDS}, got {kind!r}")
    if kind != "auto" and kind != found:
        raise ValueError(
            f"model.kind is {kind!r} but {setting} is a {found} model; "
            f"set model.kind: {found} (or auto)"
        )
    loader = AutoModelForSeq2SeqLM if found == "seq2seq" else AutoModelForCausalLM
    return loader.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def load_generator(model_spec: ModelConfig, init_from: Path | None, scorer_encoder):  # noqa: C901
    """(model, tokenizer): a seq2seq or causal generator. ``generator: bert2bert-minilm``
    warm-starts a BERT2BERT model from the embedded scorer's weights; a hub name, folder or offline
    name (:mod:`bsloss.pretrained`, e.g. ``gemma-3-270m``) loads that model as the kind its config
    says; with ``generator_config`` a seq2seq model is built at random from a config and
    ``tokenizer``."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

    from bsloss.pretrained import resolve_model

    kind = model_spec.kind
    if init_from is not None:
        return _pretrained(str(init_from), kind, f"--init_from {init_from}")
    name = model_spec.generator
    if model_spec.generator_config:
        if not model_spec.tokenizer:
            raise ValueError("config model: generator_config needs model.tokenizer (a folder)")
        options = dict(model_spec.generator_config)
        tokenizer = AutoTokenizer.from_pretrained(repository_path(model_spec.tokenizer))
        options.setdefault("vocab_size", len(tokenizer))
        options.setdefault("pad_token_id", tokenizer.pad_token_id)
        options.setdefault("eos_token_id", tokenizer.eos_token_id)
        options.setdefault("decoder_start_token_id", tokenizer.pad_token_id)
        config = AutoConfig.for_model(options.pop("model_type"), **options)
        torch.manual_seed(model_spec.init_seed)
        return AutoModelForSeq2SeqLM.from_config(config), tokenizer
    if name == "bert2bert-minilm":
        from transformers import EncoderDecoderModel

        from bsloss.scorer.default import embedded_model_path

        path = embedded_model_path()
        import transformers

        # the decoder's cross-attention and LM-head transform are new: the load report that
        # lists them is expected, so it is kept quiet
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            model = EncoderDecoderModel.from_encoder_decoder_pretrained(
                path, path, encoder_add_pooling_layer=False
            )
        finally:
            transformers.logging.set_verbosity(verbosity)
        tokenizer = copy.deepcopy(scorer_encoder.tokenizer)
        tokenizer.bos_token, tokenizer.eos_token = tokenizer.cls_token, tokenizer.sep_token
        model.config.decoder_start_token_id = tokenizer.cls_token_id
        model.config.eos_token_id = tokenizer.sep_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.vocab_size = model.config.decoder.vocab_size
        for config in (model.generation_config,):
            config.decoder_start_token_id = tokenizer.cls_token_id
            config.eos_token_id = tokenizer.sep_token_id
            config.pad_token_id = tokenizer.pad_token_id
            config.bos_token_id = tokenizer.cls_token_id
        return model, tokenizer
    return _pretrained(resolve_model(name), kind, f"model.generator {name!r}")


def pad_labels(label_sets: list[torch.Tensor]) -> list[torch.Tensor]:
    width = max(labels.shape[1] for labels in label_sets)
    return [torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-100) for x in label_sets]


class _Head(torch.nn.Module):
    """The LM head's weight and bias (references, not copies), as BERTScoreLoss takes them, and
    the model's final logit soft-cap (Gemma 2's 30; ``None`` for most models)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None):
        super().__init__()
        self.weight, self.bias, self.softcap = weight, bias, softcap


class _PassThrough(torch.nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@contextlib.contextmanager
def lm_head_inputs(model) -> Iterator[_Head]:
    """Within the block the model's ``.logits`` are the LM head's input ``[B, L, d]``, not
    ``[B, L, V]``: the output-embedding module is swapped for a pass-through (and BART's
    ``final_logits_bias`` for 0). Yields the head (weight, bias) to give ``BERTScoreLoss``
    with ``hidden_states=``, so the step never materialises the logits."""
    head = model.get_output_embeddings()
    parent, name = next(
        (module, child_name)
        for module in model.modules()
        for child_name, child in module.named_children()
        if child is head
    )
    bias = head.bias
    extra = getattr(model, "final_logits_bias", None)  # BART adds it after the head
    if isinstance(extra, torch.Tensor):
        bias = extra[0] if bias is None else bias + extra[0]
        model.final_logits_bias = torch.zeros_like(extra[:, :1])
    # A soft-capping model applies its cap after the head: off here, given to the loss instead.
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap is not None:
        model.config.final_logit_softcapping = None
    setattr(parent, name, _PassThrough())
    try:
        yield _Head(head.weight, bias, softcap)
    finally:
        setattr(parent, name, head)
        if softcap is not None:
            model.config.final_logit_softcapping = softcap
        if isinstance(extra, torch.Tensor):
            model.final_logits_bias = extra


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), labels, ignore_index=-100
    )


def token_cross_entropy_from_hidden(
    hidden: torch.Tensor, head, labels: torch.Tensor
) -> torch.Tensor:
    """:func:`token_cross_entropy` from the LM head's input, chunked (no ``[B, L, V]``)."""
    from bsloss.functional.fused_expectation import fused_token_log_likelihood

    log_likelihood = fused_token_log_likelihood(hidden.flatten(0, 1), head, labels.flatten())
    return -log_likelihood.sum() / (labels != -100).sum().clamp_min(1)


def generated_labels(sequences: torch.Tensor, pad: int, eos: int) -> torch.Tensor:
    """``generate()`` output (decoder start first) -> labels-style ids: padding and everything
    after the first eos are ``-100``."""
    labels = sequences[:, 1:].clone()
    ended = (labels == eos).long().cumsum(1)
    after_eos = (ended - (labels == eos).long()) > 0
    labels[after_eos | (labels == pad)] = -100
    return labels


@torch.no_grad()
def generate_ids(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    *,
    sample: bool = False,
    top_k: int = 0,
    num_beams: int = 1,
    **special_ids,
) -> torch.Tensor:
    """``model.generate`` in eval mode (the training mode restored after), greedy or sampled."""
    was_training = model.training
    model.eval()
    try:
        return model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=sample,
            top_k=top_k if sample else None,
            num_beams=num_beams,
            max_new_tokens=max_new_tokens,
            **special_ids,
        )
    finally:
        model.train(was_training)


def decode_texts(tokenizer, sequences: torch.Tensor) -> list[str]:
    return [
        " ".join(t.split()) for t in tokenizer.batch_decode(sequences, skip_special_tokens=True)
    ]
