"""The fused CE alone through the LM head, in launches, at the vocabulary chunk counts of a card.

The GPU benchmark's Gemma-shaped step (8 x 256 tokens, the last 128 of each row the completion:
1,016 target rows x V = 262,144) found the mixin's fused CE alone 1.15-1.40x the model's own CE
step on an H200 (runs 4-6, both backends), where the CPU proxy of that step
(``gemma_step_host.py``) finds 1.01x: its 4,096-token head makes one vocabulary chunk, a card's
262,144 make many. This counts, for one forward + backward of ``token_cross_entropy(labels,
hidden_states=h, head=head)``, the operations that reach PyTorch's dispatcher (each a kernel
launch on a card) and the Triton kernel launches, with the vocabulary cut into as many chunks as
on CUDA at those sizes (the PyTorch pass: ``_chunk_shape``; the kernels: ``_vocab_chunk``), on a
small problem (the counts do not depend on the sizes, only on the number of chunks), against
the dense CE (``cross_entropy(h @ W.T)``, what the model's own step launches for its head).

The kernels run under Triton's interpreter (switched on here, before triton is imported); the
interpreter's own copies of their arguments are not counted (on a card, a launch is one kernel).
Off CUDA the backward's float32 products upcast their operands (two more operations a product,
``_float32_product``), where CUDA multiplies them as they are: on a card the Triton row is two
operations a chunk fewer.

    HF_HUB_OFFLINE=1 python benchmarks/head_ce_launches.py
"""

from __future__ import annotations

import argparse
import collections
import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (through bsloss or torch)

if not __package__:  # run as `python benchmarks/head_ce_launches.py`
    import _path  # noqa: F401

from unittest.mock import patch

import torch

from benchmarks.gpu import forced_backend
from benchmarks.launches import LaunchCounter

ROWS, VOCAB = 1016, 262_144  # the Gemma step's target rows (8 x 127) and Gemma 3's vocabulary
WIDTH = 40  # vocabulary entries per chunk of the small problem's finer cut
SMALL_ROWS, DIM = 64, 16
INTERPRETER_COPIES = "triton_fused_head.py:_launch"


def card_chunks() -> dict[str, int]:
    """Vocabulary chunks of each backend at ``ROWS`` x ``VOCAB`` on CUDA (bf16 head)."""
    from bsloss.functional import fused_expectation, triton_fused_head

    _, torch_chunk = fused_expectation._chunk_shape(ROWS, VOCAB, "cuda", None, itemsize=4)
    with patch.object(triton_fused_head, "interpreter_active", lambda: False):
        triton_chunk = triton_fused_head._vocab_chunk(ROWS, VOCAB)
    return {"torch": math.ceil(VOCAB / torch_chunk), "triton": math.ceil(VOCAB / triton_chunk)}


def kernels(launches: collections.Counter) -> str:
    return "; kernels: " + ", ".join(f"{k} {n}" for k, n in launches.items()) if launches else ""


def main() -> None:
    from bsloss.functional import fused_expectation, triton_fused_head
    from bsloss.functional.triton_fused_head import interpreter_active, interpreter_problem
    from bsloss.integrations.lm_head import LMHead, token_cross_entropy

    assert interpreter_active(), "triton was imported before TRITON_INTERPRET was set"
    if (problem := interpreter_problem()) is not None:
        raise SystemExit(f"head_ce_launches.py: {problem}")
    chunks = card_chunks()
    torch.manual_seed(0)
    vocab = max(chunks.values()) * WIDTH
    labels = torch.randint(0, vocab, (2, SMALL_ROWS))
    labels[:, : SMALL_ROWS // 2] = -100  # half the positions a prompt, as in the step
    hidden = torch.randn(2, SMALL_ROWS, DIM).bfloat16().requires_grad_(True)
    weight = (torch.randn(vocab, DIM) * 0.2).bfloat16().requires_grad_(True)
    launches: collections.Counter[str] = collections.Counter()
    launch = triton_fused_head._launch

    def counted_launch(kernel, *args, **kwargs):
        launches[kernel.__name__] += 1
        return launch(kernel, *args, **kwargs)

    def dense():
        logits = hidden @ weight.T
        ce = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100
        )
        ce.backward()

    def fused(backend: str):
        def run():
            head = LMHead(weight, None, None)
            with forced_backend(backend):
                ce = token_cross_entropy(labels, hidden_states=hidden, head=head)
            ce.backward()  # the pass's own backward, whichever backend ran it

        return run

    rows = (
        ("dense CE on the logits (the model's own head and loss)", dense, None),
        (f"fused CE, PyTorch pass, {chunks['torch']} chunks", fused("torch"), "torch"),
        (f"fused CE, Triton kernels, {chunks['triton']} chunks", fused("triton"), "triton"),
    )
    print(
        f"Vocabulary chunks on CUDA at {ROWS:,} rows x {VOCAB:,}: PyTorch pass {chunks['torch']}, "
        f"Triton kernels {chunks['triton']}; counted on {SMALL_ROWS * 2} positions x "
        f"{DIM} wide, a {vocab:,}-token head cut into as many chunks\n"
    )
    print("| call | dispatcher operations | Triton launches | host reads | largest callers |")
    print("|---|---:|---:|---:|---|")
    for label, run, backend in rows:
        width = vocab // chunks[backend] if backend else vocab  # each backend's chunk count
        with (
            patch.object(fused_expectation, "_chunk_shape", lambda n, v, *a, w=width, **k: (n, w)),
            patch.object(triton_fused_head, "_vocab_chunk", lambda n, v, w=width: w),
            patch.object(triton_fused_head, "_launch", counted_launch),
        ):
            run()  # warm
            hidden.grad = weight.grad = None
            launches.clear()
            with LaunchCounter() as counter:
                run()
            hidden.grad = weight.grad = None
        operations = {k: n for k, n in counter.by_caller.items() if k != INTERPRETER_COPIES}
        top = ", ".join(f"{k} {n}" for k, n in collections.Counter(operations).most_common(4))
        print(
            f"| {label} | {sum(operations.values())} | {sum(launches.values())} | "
            f"{sum(counter.reads.values())} | {top}{kernels(launches)} |"
        )


if __name__ == "__main__":
    # no options: --help prints the docstring instead of running the benchmark
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    main()
