"""Where the fused LM-head pass's time goes at Gemma 3's sizes: ``fused_expected_inputs`` alone
(no loss, no scorer), forward + backward, per backend, with and without the table and the CE,
then torch.profiler's table of one CE + table pass, and Cut Cross-Entropy's CE for scale.
A diagnostic beside ``benchmarks/gpu.py`` (whose ``--profile`` profiles whole loss rows).

    python benchmarks/fused_head_profile.py [triton] [torch]   # on a GPU machine

On a CPU it runs tiny sizes on the PyTorch pass (a check of the script, not a measurement).
Wall time with a synchronisation per pass, the median of three after one warm-up.
"""

from __future__ import annotations

import argparse
import time

if not __package__:  # run as `python benchmarks/fused_head_profile.py`
    import _path  # noqa: F401

import torch
from torch.profiler import ProfilerActivity, profile

from bsloss.functional.fused_expectation import fused_expected_inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# positions (8 x 1024), d_model, vocabulary, table columns (MiniLM's 384 + the weight column)
N, D, V, C = (8192, 640, 262_144, 385) if CUDA else (64, 32, 1000, 17)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def main(backends: list[str]) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    h = torch.randn(N, D, device=DEVICE, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, D, device=DEVICE, generator=g) * (2 / D**0.5)).bfloat16()
    w.requires_grad_()
    table = torch.randn(V, C, device=DEVICE, generator=g)
    targets = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    grad_e = torch.randn(N, C, device=DEVICE, generator=g)

    def step(backend: str, with_table: bool = True, with_ce: bool = True) -> None:
        out = fused_expected_inputs(
            h,
            w,
            table if with_table else None,
            target_ids=targets if with_ce else None,
            backend=backend,
        )
        loss = 0
        if with_table:
            loss = loss + (out.expected * grad_e).sum()
        if with_ce:
            loss = loss - out.log_likelihood.mean()
        loss.backward()
        h.grad = w.grad = None

    def median_ms(run) -> float:
        run()
        sync()
        times = []
        for _ in range(3):
            began = time.perf_counter()
            run()
            sync()
            times.append((time.perf_counter() - began) * 1e3)
        return sorted(times)[1]

    for backend in backends:
        for with_table, with_ce in ((True, True), (False, True), (True, False)):
            label = f"{backend} table={with_table} ce={with_ce}"
            try:
                ms = median_ms(lambda: step(backend, with_table, with_ce))  # noqa: B023
                print(f"{label}: median {ms:.1f} ms", flush=True)
            except Exception as error:  # a row's failure is its line, the next still runs
                print(f"{label}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        with profile(activities=activities) as prof:
            step(backend)
            sync()
        key = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=14), flush=True)
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        print("Cut Cross-Entropy: not installed")
        return

    def cce() -> None:
        linear_cross_entropy(h, w, targets).backward()
        h.grad = w.grad = None

    print(f"CCE linear_cross_entropy: median {median_ms(cce):.1f} ms", flush=True)


def parse_backends(argv: list[str] | None = None) -> list[str]:
    """The backends to time, from the command line (default: both on a GPU, torch on a CPU)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "backends",
        nargs="*",
        choices=["triton", "torch"],
        help="the fused pass's backends to time (default: triton and torch on a GPU, torch on "
        "a CPU)",
    )
    return parser.parse_args(argv).backends or (["triton", "torch"] if CUDA else ["torch"])


if __name__ == "__main__":
    main(parse_backends())
