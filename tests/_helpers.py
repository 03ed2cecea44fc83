"""Small helpers shared by the test files: warnings caught as text, a long text, scorer ids
and one-hot logits, an LM head whose argmax tokens are given, a tiny trainer's arguments, and a
counter of the reads from a device to the host."""

from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LONG_WORDS = [
    "the",
    "river",
    "ran",
    "past",
    "old",
    "stone",
    "houses",
    "while",
    "children",
    "played",
    "near",
    "a",
    "bridge",
]


def long_text(words: int = 600) -> str:
    return " ".join(LONG_WORDS[i % len(LONG_WORDS)] for i in range(words))


def caught_warnings(fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, [str(w.message) for w in caught]


def token_ids(encoder, texts):
    """``[B, L]`` scorer ids (no special tokens), 0-padded, and the mask."""
    rows = [encoder.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = True
    return ids, mask


def one_hot(ids, vocab, value=1e4):
    return torch.zeros(*ids.shape, vocab).scatter_(-1, ids[..., None], value)


def head_for(token_ids: list[int], vocab: int, width: int = 64, seed: int = 0):
    """An LM head ``[V, width]`` and hidden states ``[1, L, width]`` whose argmax tokens are
    ``token_ids`` (each hidden state is its token's head row, scaled up)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, width, generator=generator)
    weight = weight / weight.norm(dim=1, keepdim=True)
    hidden = weight[token_ids][None] * 40.0
    return hidden, weight


def tiny_training_arguments(tmp_path, cls=None, **extra):
    """The arguments of a trainer over a tiny model on the CPU: 2 steps of batch 2, nothing
    saved or reported; ``cls`` (default ``TrainingArguments``: ``Seq2SeqTrainingArguments``,
    TRL's ``SFTConfig``, ...) and ``extra`` override."""
    import transformers

    cls = cls or transformers.TrainingArguments
    options = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    return cls(**{**options, **extra})


class HostReads(TorchDispatchMode):
    """Counts the operations that copy a device value to the host (``.item()``, ``bool()``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.count += 1
        return func(*args, **(kwargs or {}))
