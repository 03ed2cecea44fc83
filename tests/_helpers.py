"""Small helpers shared by the test files: warnings caught as text, a long text, scorer ids
and one-hot logits, an LM head whose argmax tokens are given, a tiny trainer's arguments, and a
counter of the reads from a device to the host."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
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


# The distributed tests' two modes. FSDP 2 (fully_shard) on CPU tensors, as those tests run it,
# records an event on a CPU stream, which torch.cpu.Stream lacks in older torch (2.6: "'Stream'
# object has no attribute 'record_event'"); on a GPU it runs there too.
DISTRIBUTED_MODES = [
    "ddp",
    pytest.param(
        "fsdp",
        marks=pytest.mark.skipif(
            not hasattr(torch.cpu.Stream, "record_event"),
            reason=f"FSDP 2 does not run on CPU tensors under torch {torch.__version__}",
        ),
    ),
]


def sft_completions(dataset, tokenizer) -> set[str]:
    """The completions an ``SFTTrainer``'s prepared ``dataset`` trains on (the tokens its
    ``completion_mask`` keeps, or, in TRL 1.x, its labels), decoded as ``BERTScoreTerm``
    decodes references. Which tokens those are is TRL's: TRL 0.20 tokenises the prompt alone
    and masks as many tokens, so with a tokenizer that ends every text with ``[SEP]`` the
    completion's first token is masked too; TRL 1.x keeps the whole completion."""
    texts = set()
    for row in dataset:
        if "completion_mask" in row:
            kept = row["completion_mask"]
        else:
            kept = [label != -100 for label in row["labels"]]
        ids = [i for i, keep in zip(row["input_ids"], kept, strict=True) if keep]
        texts.add(tokenizer.decode(ids, skip_special_tokens=True).strip().replace(" [SEP]", ""))
    return texts


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


# Ops whose result the host must read back before it goes on (a value or a data-dependent shape):
# on CUDA each one waits for every queued kernel. (``.tolist()`` and ``.cpu()`` copy without
# reaching the dispatcher on the CPU, so they are not seen here.)
SYNCING_OPS = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten._local_scalar_dense.default,  # .item(), bool(), int()
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.masked_select.default,
}
BOOLEAN_INDEXING_OPS = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
}


class HostReads(TorchDispatchMode):
    """Counts the operations that read a device value back to the host (``.item()``, ``bool()``,
    ``nonzero``, boolean indexing), with the innermost bsloss caller of each in ``where``; and,
    as waits of the same kind, bsloss's ``torch.tensor`` / ``torch.as_tensor`` of host data with
    a ``device=``: on CUDA that copy from pageable memory synchronises the stream (host data
    goes through :func:`bsloss.scorer.batching.to_device`, pinned and asynchronous). Audit h19
    found two such copies in the loss, after the scorer's forward was queued."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where: list[str] = []
        self._factories: list = []
        self._depth = 0  # entered again inside its own block: the factories stay patched

    def __enter__(self):
        if self._depth == 0:
            for name in ("tensor", "as_tensor"):
                made = getattr(torch, name)
                self._factories.append((name, made))
                setattr(torch, name, self._copy_counted(name, made))
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        while self._depth == 0 and self._factories:
            name, made = self._factories.pop()
            setattr(torch, name, made)
        return super().__exit__(*exc)

    def _copy_counted(self, name, made):
        def factory(data, *args, **kwargs):
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                caller = _bsloss_caller()
                if not caller.startswith("outside"):
                    self.count += 1
                    self.where.append(f"torch.{name}(host data, device=) from {caller}")
            return made(data, *args, **kwargs)

        return factory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func in BOOLEAN_INDEXING_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
        if func in SYNCING_OPS or boolean_index:
            self.count += 1
            self.where.append(f"{func} from {_bsloss_caller()}")
        return func(*args, **(kwargs or {}))


def _bsloss_caller() -> str:
    """The innermost bsloss frame of the stack (this file's frames are not bsloss's)."""
    frame = sys._getframe(1)
    while frame is not None:
        if "bsloss" in Path(frame.f_code.co_filename).parts:
            return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside bsloss (the autograd engine)"


def layer_runs(loss, call) -> int:
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
