"""Which layer of a scorer to use, and how to drop the layers above it.

Defaults are bert_score 0.3.13's ``model2layers`` table, whole (the layer that correlated best
with WMT16 human judgments in Zhang et al., 2020, Appendix); the sentence-transformers scorers use
their last layer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__ = ["DEFAULT_LAYERS", "default_num_layers", "truncate_layers", "num_hidden_layers"]

# bert_score 0.3.13's ``model2layers`` table, copied whole (bert_score is MIT-licensed,
# (c) 2019 Tianyi Zhang, Varsha Kishore, Felix Wu, Kilian Q. Weinberger, Yoav Artzi), so that
# ``bsloss.utils.model2layers`` answers every name bert_score does and a scorer named by any of
# them gets bert_score's layer without num_layers.
_BERT_SCORE_LAYERS: dict[str, int] = {
    "bert-base-uncased": 9,
    "bert-large-uncased": 18,
    "bert-base-cased-finetuned-mrpc": 9,
    "bert-base-multilingual-cased": 9,
    "bert-base-chinese": 8,
    "roberta-base": 10,
    "roberta-large": 17,
    "roberta-large-mnli": 19,
    "roberta-base-openai-detector": 7,
    "roberta-large-openai-detector": 15,
    "xlnet-base-cased": 5,
    "xlnet-large-cased": 7,
    "xlm-mlm-en-2048": 6,
    "xlm-mlm-100-1280": 10,
    "allenai/scibert_scivocab_uncased": 8,
    "allenai/scibert_scivocab_cased": 9,
    "nfliu/scibert_basevocab_uncased": 9,
    "distilroberta-base": 5,
    "distilbert-base-uncased": 5,
    "distilbert-base-uncased-distilled-squad": 4,
    "distilbert-base-multilingual-cased": 5,
    "albert-base-v1": 10,
    "albert-large-v1": 17,
    "albert-xlarge-v1": 16,
    "albert-xxlarge-v1": 8,
    "albert-base-v2": 9,
    "albert-large-v2": 14,
    "albert-xlarge-v2": 13,
    "albert-xxlarge-v2": 8,
    "xlm-roberta-base": 9,
    "xlm-roberta-large": 17,
    "google/electra-small-generator": 9,
    "google/electra-small-discriminator": 11,
    "google/electra-base-generator": 10,
    "google/electra-base-discriminator": 9,
    "google/electra-large-generator": 18,
    "google/electra-large-discriminator": 14,
    "google/bert_uncased_L-2_H-128_A-2": 1,
    "google/bert_uncased_L-2_H-256_A-4": 1,
    "google/bert_uncased_L-2_H-512_A-8": 1,
    "google/bert_uncased_L-2_H-768_A-12": 2,
    "google/bert_uncased_L-4_H-128_A-2": 3,
    "google/bert_uncased_L-4_H-256_A-4": 3,
    "google/bert_uncased_L-4_H-512_A-8": 3,
    "google/bert_uncased_L-4_H-768_A-12": 3,
    "google/bert_uncased_L-6_H-128_A-2": 5,
    "google/bert_uncased_L-6_H-256_A-4": 5,
    "google/bert_uncased_L-6_H-512_A-8": 5,
    "google/bert_uncased_L-6_H-768_A-12": 5,
    "google/bert_uncased_L-8_H-128_A-2": 7,
    "google/bert_uncased_L-8_H-256_A-4": 7,
    "google/bert_uncased_L-8_H-512_A-8": 6,
    "google/bert_uncased_L-8_H-768_A-12": 7,
    "google/bert_uncased_L-10_H-128_A-2": 8,
    "google/bert_uncased_L-10_H-256_A-4": 8,
    "google/bert_uncased_L-10_H-512_A-8": 9,
    "google/bert_uncased_L-10_H-768_A-12": 8,
    "google/bert_uncased_L-12_H-128_A-2": 10,
    "google/bert_uncased_L-12_H-256_A-4": 11,
    "google/bert_uncased_L-12_H-512_A-8": 10,
    "google/bert_uncased_L-12_H-768_A-12": 9,
    "amazon/bort": 0,
    "facebook/bart-base": 6,
    "facebook/bart-large": 10,
    "facebook/bart-large-cnn": 10,
    "facebook/bart-large-mnli": 11,
    "facebook/bart-large-xsum": 9,
    "t5-small": 6,
    "t5-base": 11,
    "t5-large": 23,
    "vinai/bertweet-base": 9,
    "microsoft/deberta-base": 9,
    "microsoft/deberta-base-mnli": 9,
    "microsoft/deberta-large": 16,
    "microsoft/deberta-large-mnli": 18,
    "microsoft/deberta-xlarge": 18,
    "microsoft/deberta-xlarge-mnli": 40,
    "YituTech/conv-bert-base": 10,
    "YituTech/conv-bert-small": 10,
    "YituTech/conv-bert-medium-small": 9,
    "microsoft/mpnet-base": 8,
    "squeezebert/squeezebert-uncased": 9,
    "squeezebert/squeezebert-mnli": 9,
    "squeezebert/squeezebert-mnli-headless": 9,
    "tuner007/pegasus_paraphrase": 15,
    "google/pegasus-large": 8,
    "google/pegasus-xsum": 11,
    "sshleifer/tiny-mbart": 2,
    "facebook/mbart-large-cc25": 12,
    "facebook/mbart-large-50": 12,
    "facebook/mbart-large-en-ro": 12,
    "facebook/mbart-large-50-many-to-many-mmt": 12,
    "facebook/mbart-large-50-one-to-many-mmt": 12,
    "allenai/led-base-16384": 6,
    "facebook/blenderbot_small-90M": 7,
    "facebook/blenderbot-400M-distill": 2,
    "microsoft/prophetnet-large-uncased": 4,
    "microsoft/prophetnet-large-uncased-cnndm": 7,
    "SpanBERT/spanbert-base-cased": 8,
    "SpanBERT/spanbert-large-cased": 17,
    "microsoft/xprophetnet-large-wiki100-cased": 7,
    "ProsusAI/finbert": 10,
    "Vamsi/T5_Paraphrase_Paws": 12,
    "ramsrigouthamg/t5_paraphraser": 11,
    "microsoft/deberta-v2-xlarge": 10,
    "microsoft/deberta-v2-xlarge-mnli": 17,
    "microsoft/deberta-v2-xxlarge": 21,
    "microsoft/deberta-v2-xxlarge-mnli": 22,
    "allenai/longformer-base-4096": 7,
    "allenai/longformer-large-4096": 14,
    "allenai/longformer-large-4096-finetuned-triviaqa": 14,
    "zhiheng-huang/bert-base-uncased-embedding-relative-key": 4,
    "zhiheng-huang/bert-base-uncased-embedding-relative-key-query": 7,
    "zhiheng-huang/bert-large-uncased-whole-word-masking-embedding-relative-key-query": 19,
    "google/mt5-small": 8,
    "google/mt5-base": 11,
    "google/mt5-large": 19,
    "google/mt5-xl": 24,
    "google/bigbird-roberta-base": 10,
    "google/bigbird-roberta-large": 14,
    "google/bigbird-base-trivia-itc": 8,
    "princeton-nlp/unsup-simcse-bert-base-uncased": 10,
    "princeton-nlp/unsup-simcse-bert-large-uncased": 18,
    "princeton-nlp/unsup-simcse-roberta-base": 8,
    "princeton-nlp/unsup-simcse-roberta-large": 13,
    "princeton-nlp/sup-simcse-bert-base-uncased": 10,
    "princeton-nlp/sup-simcse-bert-large-uncased": 18,
    "princeton-nlp/sup-simcse-roberta-base": 10,
    "princeton-nlp/sup-simcse-roberta-large": 16,
    "dbmdz/bert-base-turkish-cased": 10,
    "dbmdz/distilbert-base-turkish-cased": 4,
    "google/byt5-small": 1,
    "google/byt5-base": 17,
    "google/byt5-large": 30,
    "microsoft/deberta-v3-xsmall": 10,
    "microsoft/deberta-v3-small": 4,
    "microsoft/deberta-v3-base": 9,
    "microsoft/mdeberta-v3-base": 10,
    "microsoft/deberta-v3-large": 12,
    "khalidalt/DeBERTa-v3-large-mnli": 18,
}

DEFAULT_LAYERS: dict[str, int] = {
    **_BERT_SCORE_LAYERS,
    # sentence-transformers models are trained on their last layer's output
    "sentence-transformers/all-MiniLM-L6-v2": 6,
    "all-MiniLM-L6-v2": 6,
    "sentence-transformers/all-mpnet-base-v2": 12,
    "all-mpnet-base-v2": 12,
}


def default_num_layers(model_name: str, architecture_of: str | None = None) -> int:
    """The table's layer for ``model_name`` (a hub name, or a folder named like one).

    Args:
        model_name: the hub name or folder.
        architecture_of: the known model whose architecture an unrecognised folder has (a
            fine-tuned copy), named in the error as a hint.

    Raises:
        ValueError: ``model_name`` is not in the table (the message says to pass num_layers).
    """
    for key in (model_name, model_name.rstrip("/").split("/")[-1], Path(model_name).name):
        if key in DEFAULT_LAYERS:
            return DEFAULT_LAYERS[key]
    hint = ""
    if architecture_of is not None:
        hint = (
            f" The folder has the architecture of {architecture_of} (which uses layer "
            f"{DEFAULT_LAYERS[architecture_of]}) but other weights (fine-tuned?), so bsloss does "
            "not take it for that model."
        )
    raise ValueError(
        f"num_layers is required for model {model_name!r}: it is not in bsloss's default-layer "
        f"table (bsloss.utils.model2layers, {len(DEFAULT_LAYERS)} models).{hint} Pass "
        "num_layers=N (0 = embedding "
        "output)."
    )


# Where each architecture keeps its stack of layers, as attribute paths from the base model.
_LAYER_STACKS = (
    "encoder.layer",
    "encoder.layers",
    "encoder.block",
    "layers",
    "block",
    "transformer.layer",
    "layer",
)


def _find_layer_stack(model: nn.Module) -> tuple[nn.Module, str] | None:
    for path in _LAYER_STACKS:
        owner: nn.Module | None = model
        *parents, leaf = path.split(".")
        for name in parents:
            owner = getattr(owner, name, None)
        stack = getattr(owner, leaf, None) if owner is not None else None
        if isinstance(stack, nn.ModuleList):
            return owner, leaf
    return None


def num_hidden_layers(model: nn.Module) -> int:
    found = _find_layer_stack(model)
    if found is None:
        return int(model.config.num_hidden_layers)
    owner, leaf = found
    return len(getattr(owner, leaf))


def truncate_layers(model: nn.Module, num_layers: int) -> nn.Module:
    """Drop the layers above ``num_layers`` in place, so that compute stops there.

    ``num_layers=0`` leaves the embedding output. ALBERT shares one layer group, so only its
    layer count is changed.
    """
    total = num_hidden_layers(model)
    if not 0 <= num_layers <= total:
        raise ValueError(
            f"num_layers must be between 0 and {total} for this model, got {num_layers}"
        )
    if hasattr(getattr(model, "encoder", None), "albert_layer_groups"):
        model.config.num_hidden_layers = num_layers
        return model
    found = _find_layer_stack(model)
    if found is None:
        raise ValueError(f"bsloss does not know where {type(model).__name__} keeps its layers")
    owner, leaf = found
    setattr(owner, leaf, nn.ModuleList(list(getattr(owner, leaf))[:num_layers]))
    if hasattr(model.config, "num_hidden_layers"):
        model.config.num_hidden_layers = num_layers
    return model


@torch.no_grad()
def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no parameter requires grad: the scorer is a fixed measuring instrument."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model
