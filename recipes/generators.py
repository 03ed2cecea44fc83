"""Generator models for the recipes: loading (seq2seq or decoder-only, offline names, a BERT2BERT
warm start), the LM head's input and weight instead of logits, token cross-entropy, and greedy or
sampled generation as label-style ids.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from config import ModelConfig
from examples import repository_path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before any tokenizer is loaded


def _pretrained(path: str, kind: str, setting: str):
    """(model, tokenizer) of a folder or hub name, loaded as what its config says it is: an
    encoder-decoder (seq2seq) or a decoder-only (causal) LM. ``kind`` (``model.kind``, one of
    config.py's ``MODEL_KINDS``, checked at load) checks it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    found = (
        "seq2seq"
        if getattr(AutoConfig.from_pretrained(path), "is_encoder_decoder", False)
        else "causal"
    )
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
        check_init_from(model_spec, init_from)
        if not is_adapter(init_from):
            return _pretrained(str(init_from), kind, f"--init_from {init_from}")
        # a LoRA adapter: the configured model underneath, the adapter put on it by with_lora
        return load_generator(model_spec, None, scorer_encoder)
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
        # the scorer's tokenizer (the embedded MiniLM's); without a scorer (answer.py, an
        # adapter's base) the same one from its folder
        if scorer_encoder is not None:
            tokenizer = copy.deepcopy(scorer_encoder.tokenizer)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
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


# What makes two configs the same model: a fine-tuned checkpoint keeps all of these.
IDENTITY_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def model_identity(config) -> dict:
    """The ``IDENTITY_KEYS`` of a transformers config (the decoder's, for an encoder-decoder's
    sizes) and its ``architectures`` when it names them (a config built at random does not)."""
    text = config.get_text_config(decoder=True)
    identity = {"model_type": config.model_type}
    identity.update({key: getattr(text, key, None) for key in IDENTITY_KEYS[1:]})
    if config.architectures:
        identity["architectures"] = tuple(config.architectures)
    return identity


def configured_model_config(model_spec: ModelConfig):
    """The config of the model ``model.generator`` (or ``model.generator_config``) names, without
    its weights; ``None`` when the section names none."""
    from transformers import AutoConfig, AutoTokenizer, EncoderDecoderConfig

    from bsloss.pretrained import resolve_model

    if model_spec.generator_config:
        options = dict(model_spec.generator_config)
        if "vocab_size" not in options and model_spec.tokenizer:
            tokenizer = AutoTokenizer.from_pretrained(repository_path(model_spec.tokenizer))
            options["vocab_size"] = len(tokenizer)
        return AutoConfig.for_model(options.pop("model_type"), **options)
    if model_spec.generator == "bert2bert-minilm":
        from bsloss.scorer.default import embedded_model_path

        encoder = AutoConfig.from_pretrained(embedded_model_path())
        return EncoderDecoderConfig.from_encoder_decoder_configs(encoder, encoder)
    if model_spec.generator is None:
        return None
    return AutoConfig.from_pretrained(resolve_model(model_spec.generator))


def check_init_from(model_spec: ModelConfig, init_from: Path) -> None:
    """Refuse an ``--init_from`` folder that holds another model than ``model.generator``: its
    config's model type, vocabulary size, width, depth or architecture differ."""
    from transformers import AutoConfig

    try:
        found = AutoConfig.from_pretrained(str(init_from))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"--init_from {init_from}: not a saved generator folder ({error})"
        ) from None
    expected = configured_model_config(model_spec)
    if expected is None:
        return
    have, want = model_identity(found), model_identity(expected)
    differ = [
        f"{key} {have[key]!r} (configured: {want[key]!r})"
        for key in want
        if key in have and have[key] != want[key]
    ]
    if differ:
        name = model_spec.generator if not model_spec.generator_config else "generator_config"
        raise ValueError(
            f"--init_from {init_from} is not the configured model (model.generator {name!r}): "
            + "; ".join(differ)
        )


ADAPTER_CONFIG = "adapter_config.json"  # peft's: a folder saved from a LoRA-trained model


def is_adapter(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).exists()


def with_lora(model, rank: int, alpha: float | None, init_from: Path | None):
    """The model to train: ``model`` itself (``rank`` 0, full fine-tuning), or a peft LoRA model
    with rank-``rank`` adapters (scale ``alpha / rank``; ``alpha`` None: ``2 * rank``) on every
    linear layer but the LM head, the base frozen. An ``--init_from`` folder that holds an adapter
    (a LoRA run's ``best/`` or ``model/``) is loaded and trained on; its rank must be ``rank``.
    Why LoRA in the recipes: a saved adapter is a few MB, so a study's converged start can be
    committed and outlive the machine it was trained on (a full Gemma 3 270M is 1 GB)."""
    adapter = init_from is not None and is_adapter(init_from)
    if not rank:
        if adapter:
            raise ValueError(
                f"--init_from {init_from} holds a LoRA adapter; set train.lora_rank to its rank "
                "(stage 2 trains the adapter stage 1 trained)"
            )
        return model
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter:
        saved = json.loads((Path(init_from) / ADAPTER_CONFIG).read_text())
        if saved.get("r") != rank:
            raise ValueError(
                f"train.lora_rank is {rank} but --init_from {init_from} holds a rank-"
                f"{saved.get('r')} adapter"
            )
        return PeftModel.from_pretrained(model, str(init_from), is_trainable=True)
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        lora_dropout=0.0,
        target_modules="all-linear",  # peft leaves the output layer (LM head) out
        task_type="SEQ_2_SEQ_LM" if model.config.is_encoder_decoder else "CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def save_generator(model, tokenizer, folder: Path) -> None:
    """The model (or, LoRA-trained, its adapter and the base's config, which ``--init_from``'s
    identity check reads) and the tokenizer into ``folder``."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if is_adapter(folder):
        model.get_base_model().config.save_pretrained(folder)


ADAPTER_FILES = (ADAPTER_CONFIG, "config.json")  # what a committed adapter folder keeps


def compact_adapter(folder: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A LoRA adapter of ``folder`` (:func:`save_generator`'s) written to ``out`` in ``dtype``,
    with its config and the base model's: half the size in bfloat16 (a rank-8 Gemma 3 270M
    adapter: 7.6 to 3.8 MB), small enough to commit. ``--init_from out`` loads it as it loads
    the original (peft copies the weights into the model's float32 adapter)."""
    import shutil

    from safetensors.torch import load_file, save_file

    if not is_adapter(folder):
        raise ValueError(f"{folder} holds no LoRA adapter ({ADAPTER_CONFIG})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = load_file(Path(folder) / "adapter_model.safetensors")
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()},
              out / "adapter_model.safetensors")  # fmt: skip
    for name in ADAPTER_FILES:
        shutil.copyfile(Path(folder) / name, out / name)
    return out


def load_saved_weights(model, folder: Path) -> None:
    """Load what :func:`save_generator` wrote into ``folder`` into ``model`` (the same kind)."""
    if is_adapter(folder):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(Path(folder) / "adapter_model.safetensors"))
        return
    saved = type(model).from_pretrained(folder, dtype=torch.float32)
    own = model.state_dict()  # BERT2BERT's reload adds an unused pooler: dropped
    model.load_state_dict({k: v for k, v in saved.state_dict().items() if k in own})


def freeze_embeddings(model) -> int:
    """Freeze the input embedding and the LM head (one tied matrix in Gemma and GPT-2; both
    matrices when untied; the decoder's own input embedding in an encoder-decoder). Returns the
    number of parameters frozen (a tied matrix counted once)."""
    modules = [model.get_input_embeddings(), model.get_output_embeddings()]
    if getattr(model.config, "is_encoder_decoder", False):
        modules.append(model.get_decoder().get_input_embeddings())
    frozen = {}
    for module in modules:
        if module is not None:
            frozen[id(module.weight)] = module.weight
    for weight in frozen.values():
        weight.requires_grad_(False)
    return sum(weight.numel() for weight in frozen.values())


def decode_texts(tokenizer, sequences: torch.Tensor) -> list[str]:
    return [
        " ".join(t.split()) for t in tokenizer.batch_decode(sequences, skip_special_tokens=True)
    ]
