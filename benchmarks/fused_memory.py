"""Peak extra memory of the fused CE + term pass at Gemma 3's sizes, measured on the CPU with the
chunk shapes the pass takes on CUDA: what a GPU run would hold, before a GPU is at hand.

The pass is the GPU benchmark's "bsloss fused, CE + term" row (``benchmarks/gpu.py``, section 2):
V = 262,144, d = 640, bf16 head and hidden states, random MiniLM-shaped scorer through a
synthetic bridge, ``loss.loss_and_cross_entropy(LMHeadInputs(h, W), targets, refs)`` forward
and backward. The chunk policy is CUDA's (``_chunk_shape(..., "cuda", ...)``), called on the CPU.
Peak extra = the process's resident high-water mark over the timed pass (reset before it, via
``/proc/self/clear_refs``) minus the resident memory before it; run it with
``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns each freed buffer at once, as CUDA's
caching allocator's ``max_memory_allocated`` would count it. The gradients the pass makes count,
the weights and cached references do not, as on the GPU.

Calibration: on main at 16827a4 this gave 1,831 MiB at 8 x 256 positions where an H200 measured
2,035 MiB (``results/gpu_h200_run2.md``): the CPU figure runs ~10% low.

Reproduce::

    MALLOC_MMAP_THRESHOLD_=65536 HF_HUB_OFFLINE=1 python benchmarks/fused_memory.py --tokens 8x256
    # another checkout's bsloss (e.g. a git worktree of an older commit):
    ... python benchmarks/fused_memory.py --tree /tmp/bsloss-old --tokens 8x256
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

if not __package__:  # run as `python benchmarks/fused_memory.py`
    import _path  # noqa: F401

from benchmarks import harness

VOCAB, DIM = 262_144, 640


def measure(batch: int, length: int, vocab: int = VOCAB, dim: int = DIM) -> dict:
    import torch

    from benchmarks.gpu import synthetic_bridge, write_random_scorer
    from bsloss import BERTScoreLoss, LMHeadInputs
    from bsloss.functional import fused_expectation
    from bsloss.scorer.encoder import ScorerEncoder

    policy = fused_expectation._chunk_shape

    def cuda_policy(n, vocab, device_type, chunk_elements, itemsize=4, **options):
        return policy(n, vocab, "cuda", chunk_elements, itemsize, **options)

    fused_expectation._chunk_shape = cuda_policy
    try:
        with tempfile.TemporaryDirectory(prefix="bsloss-scorer-") as folder:
            scorer = write_random_scorer(Path(folder) / "scorer")  # MiniLM, random weights
            encoder = ScorerEncoder.from_pretrained(str(scorer), 6, "cpu")
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(vocab, dim, generator=generator) * (2 / dim**0.5)
        weight = weight.to(torch.bfloat16).requires_grad_()
        loss = BERTScoreLoss(
            encoder=encoder, bridge=synthetic_bridge(vocab, encoder.input_embeddings.num_embeddings)
        )
        refs = [f"reference sentence number {i} of the batch" for i in range(batch)]
        loss.encode_references(refs)
        hidden = torch.randn(batch, length, dim, generator=generator).to(torch.bfloat16)
        hidden.requires_grad_()
        targets = torch.randint(0, vocab, (batch, length), generator=generator)

        def run():
            out = loss.loss_and_cross_entropy(LMHeadInputs(hidden, weight), targets, refs)
            (out.loss + out.cross_entropy).backward()
            return out

        run()  # warm-up (lazy state, the bridge's table)
        hidden.grad = weight.grad = None
        before = harness.current_rss_bytes()
        harness.reset_peak_rss()
        began = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - began
        return {
            "tokens": f"{batch}x{length}",
            "chunk_shape": list(cuda_policy(batch * length, vocab, "cuda", None)),
            "peak_extra_mib": (harness.peak_rss_bytes() - before) / 2**20,
            "seconds": seconds,
            "cross_entropy": float(out.cross_entropy),
            "term": float(out.loss),
        }
    finally:  # the caller's process (a test) gets its policy back
        fused_expectation._chunk_shape = policy


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--tokens", default="8x256", help="B x L positions (default 8x256)")
    parser.add_argument("--tree", help="import bsloss from this checkout instead of this one")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    import bsloss

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        harness.log("MALLOC_MMAP_THRESHOLD_ is not set: freed buffers may stay resident")
    batch, length = (int(x) for x in args.tokens.lower().split("x"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = measure(batch, length)
    result["bsloss"] = str(Path(bsloss.__file__).parent)
    env = harness.environment()
    rows = [
        (result["tokens"], " x ".join(map(str, result["chunk_shape"])),
         f"{result['peak_extra_mib']:,.0f}", f"{result['seconds']:.1f}",
         f"{result['cross_entropy']:.4f}", f"{result['term']:.4f}")
    ]  # fmt: skip
    header = ["B x L", "CUDA chunk (rows x vocabulary)", "peak extra MiB", "s (CPU)", "CE", "term"]
    lines = [*harness.header_lines(env), f"- bsloss from `{result['bsloss']}`", ""]
    lines.append(harness.markdown_table(header, rows, "llrrrr"))
    harness.write_outputs("\n".join(lines), args.out, args.json, result)


if __name__ == "__main__":
    sys.exit(main())
