"""Kernel-launching operations per loss call, counted at PyTorch's dispatcher on the CPU.

On a GPU the loss's small calls are bound by the host (``benchmarks/README.md``, "Runs 4-6"):
each operation that reaches the dispatcher and is not a view costs a kernel launch and its
Python around it, whatever the sizes. This counts them for one forward + backward, so that a
change to the host's work can be judged without a card:

* **loss**: ``BERTScoreLoss`` defaults on random logits ``[32, 64, 30,522]`` (the GPU benchmark's
  precision section);
* **fused**: CE + term through ``LMHeadInputs`` at ``8 x 256`` positions with a 4,096-token head
  (two vocabulary chunks on the CPU; each further chunk of the PyTorch pass adds ~56 launches,
  forward and backward: 700 with an 8,192-token head) through the benchmarks' synthetic
  bridge;
* **term**: one step of ``BERTScoreTerm`` through the LM head (the mixin's fused path) on a
  tiny Gemma 3 (the GPU benchmark's smoke config: 2 layers, 64 wide, a 4,096-token head through
  the synthetic bridge), 2 x 24 tokens of which 8 are the completion: forward + backward, the
  model's own operations included;
* **metric**: ``BERTScorer.score`` of 2,000 distinct Brown pairs (batch_size 64), as the CPU
  batches them and as a GPU does (:func:`~bsloss.scorer.batching.paced_by_host`, forced here),
  with the number of encoder calls.

Beside the launches, the **host reads**: operations whose result the host must read back
before it goes on (``.item()``, ``bool()``, ``nonzero``, boolean indexing). On a GPU each one
waits for every kernel queued before it. (``.tolist()`` copies without reaching the dispatcher
on the CPU: not counted.) The loss, fused and term rows run with the scorer's mask prepared as on
a GPU (``paced_by_host`` forced), as the metric's GPU row does. Two kinds of operation are not
counted as launches: ``aten.scalar_tensor`` (a Python number wrapped on the CPU, as
``torch.where(mask, x, 0.0)`` does; no kernel on a GPU) and ``aten.promote_types`` (a dtype
computation).

The scorer is MiniLM's architecture, vocabulary and tokenizer with random weights, 32 wide (the
count does not depend on the width). Operations are attributed to the innermost bsloss or
transformers frame that called them; the autograd engine's own (the backward) are one line.

    HF_HUB_OFFLINE=1 python benchmarks/launches.py
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import warnings
from pathlib import Path

if not __package__:  # run as `python benchmarks/launches.py`
    import _path  # noqa: F401

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu import synthetic_bridge
from benchmarks.revisions import brown_pairs_of, narrow_scorer

NOT_LAUNCHES = {"aten::scalar_tensor", "aten::promote_types"}
READS = {"aten::nonzero", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::masked_select"}
INDEXING = {"aten::index", "aten::index_put", "aten::index_put_"}


class LaunchCounter(TorchDispatchMode):
    """Non-view operations by their caller: ``file:function`` of the innermost bsloss or
    transformers frame, else ``autograd engine or caller`` (the backward, or the step itself);
    and the host reads among them, by caller and line."""

    def __init__(self):
        super().__init__()
        self.by_caller: collections.Counter[str] = collections.Counter()
        self.reads: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not func.is_view and name not in NOT_LAUNCHES:
            frame, caller, line = sys._getframe(1), "autograd engine or caller", ""
            while frame is not None:
                path = frame.f_code.co_filename
                if "bsloss" in Path(path).parts or "transformers" in Path(path).parts:
                    caller = f"{Path(path).name}:{frame.f_code.co_name}"
                    line = f":{frame.f_lineno}"
                    break
                frame = frame.f_back
            self.by_caller[caller] += 1
            boolean_index = name in INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in args[1]
                if i is not None
            )
            if name in READS or boolean_index:
                self.reads[caller + line] += 1
        return func(*args, **(kwargs or {}))


def count(step) -> LaunchCounter:
    step()  # warm: caches (references, tables) filled outside the count
    with LaunchCounter() as counter:
        step()
    return counter


def main() -> None:
    from unittest.mock import patch

    import bsloss.metric
    import bsloss.scorer.encoder
    import bsloss.scorer.inference
    from bsloss import BERTScoreLoss, BERTScorer, LMHeadInputs
    from bsloss.scorer.encoder import ScorerEncoder

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bsloss-launches-") as scratch:
        encoder = ScorerEncoder.from_pretrained(narrow_scorer(Path(scratch)), num_layers=6)
    refs = [f"reference sentence number {i} for the count" for i in range(32)]
    vocab = encoder.input_embeddings.num_embeddings

    loss = BERTScoreLoss(model=encoder)
    logits = torch.randn(32, 64, vocab, requires_grad=True)
    loss.encode_references(refs)

    def loss_step():
        loss(logits, references=refs).backward()

    head_vocab, dim = 4096, 64
    fused = BERTScoreLoss(model=encoder, bridge=synthetic_bridge(head_vocab, vocab))
    hidden = torch.randn(8, 256, dim, requires_grad=True)
    weight = torch.randn(head_vocab, dim, requires_grad=True)
    targets = torch.randint(0, head_vocab, (8, 256))
    fused.encode_references(refs[:8])

    def fused_step():
        out = fused.loss_and_cross_entropy(LMHeadInputs(hidden, weight), targets, refs[:8])
        (out.loss + out.cross_entropy).backward()

    term_step = gemma_term_step(encoder, refs[:2])

    scorer = BERTScorer(encoder=encoder, batch_size=64)
    metric_cands, metric_refs = brown_pairs_of(2000)
    encoder_calls = collections.Counter()
    encode = encoder.encode_without_grad

    def counted_encode(*args, **kwargs):
        encoder_calls["calls"] += 1
        return encode(*args, **kwargs)

    encoder.encode_without_grad = counted_encode

    def metric_step(fill: bool):
        def step():
            with (
                patch.object(bsloss.metric, "paced_by_host", lambda device: fill),
                patch.object(bsloss.scorer.inference, "paced_by_host", lambda device: fill),
                patch.object(bsloss.scorer.encoder, "paced_by_host", lambda device: fill),
            ):
                scorer.score(metric_cands, metric_refs, progress=False)

        return step

    def paced(step):
        def run():
            with patch.object(bsloss.scorer.encoder, "paced_by_host", lambda device: True):
                step()

        return run

    print("| call | launches | host reads | the largest callers; where the reads are |")
    print("|---|---:|---:|---|")
    for label, step in (
        ("loss, 32 x 64 logits, V 30,522", paced(loss_step)),
        ("fused CE + term, 8 x 256, 4,096-token head", paced(fused_step)),
        ("BERTScoreTerm step through the LM head, tiny Gemma, 2 x 24", paced(term_step)),
        ("metric, 2,000 Brown pairs, batched as on the CPU", metric_step(False)),
        ("metric, 2,000 Brown pairs, batched as on a GPU", metric_step(True)),
    ):
        encoder_calls.clear()
        counter = count(step)
        top = ", ".join(f"{name} {n}" for name, n in counter.by_caller.most_common(4))
        calls = encoder_calls["calls"] // 2  # count() calls the step twice
        top += f" ({calls} encoder calls)" if calls else ""
        reads = sum(counter.reads.values())
        if 0 < reads <= 12:
            top += "; reads: " + ", ".join(f"{w} {n}" for w, n in counter.reads.items())
        launches = sum(counter.by_caller.values())
        print(f"| {label} | {launches} | {reads} | {top} |")


def gemma_term_step(encoder, refs: list[str]):
    """One forward + backward of ``BERTScoreTerm`` through ``lm_head_inputs`` on a tiny random
    Gemma 3 (the GPU benchmark's smoke config), the last 8 of 24 tokens the completion."""
    import transformers

    from benchmarks.gpu import SMOKE, ReferencesGiven
    from bsloss import BERTScoreLoss
    from bsloss.integrations.huggingface import BERTScoreTerm
    from bsloss.integrations.lm_head import lm_head_inputs

    config = transformers.Gemma3TextConfig(**SMOKE.gemma)
    model = transformers.Gemma3ForCausalLM(config).train()
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (2, 24))
    labels = ids.clone()
    labels[:, :16] = -100
    bridge = synthetic_bridge(vocab, encoder.input_embeddings.num_embeddings)
    loss = BERTScoreLoss(model=encoder, bridge=bridge)
    loss.encode_references(refs)
    term = BERTScoreTerm(loss, ReferencesGiven(), weight=1.0, causal=True)

    def step():
        model.zero_grad(set_to_none=True)
        with lm_head_inputs(model) as head:
            outputs = model(input_ids=ids)
        term(outputs, labels, references=refs, head=head).backward()

    return step


if __name__ == "__main__":
    # no options: --help prints the docstring instead of running the benchmark
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    main()
