"""Peak memory of BERTScorer.score against the number of pairs: streaming keeps it bounded.

Each size runs in a fresh subprocess: it loads the embedded scorer, builds N random pairs of
distinct Brown-corpus sentences (``../shared/data/brown-sentences.txt``; texts repeat once N
exceeds the corpus, as in any large evaluation), records its resident set size, scores the pairs
(``chunk_size`` pairs at a time) and reports the peak RSS (``ru_maxrss``) minus the RSS before
scoring. The input strings themselves are allocated before that point.

Reproduce::

    HF_HUB_OFFLINE=1 python benchmarks/memory.py --pairs 10000 100000 --mode fast

The environment passes to the worker processes, so an allocator setting can be compared, e.g.
``MALLOC_MMAP_THRESHOLD_=1048576``. Before the encoder padded its batches to bucketed shapes,
glibc's heap fragmented and the peak grew chunk after chunk (1.36x from 10k to 100k pairs; see
the README).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _data import data_dir  # noqa: E402
from _env import command_line, cpu_model  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(num_pairs: int, mode: str, chunk_size: int) -> dict:
    import torch

    import bsloss
    from bsloss.baseline import random_pairs

    sentences = (data_dir() / "brown-sentences.txt").read_text(encoding="utf-8").splitlines()
    cands, refs = random_pairs(sentences, num_pairs, seed=0)
    dtype = torch.bfloat16 if mode == "fast" else None
    scorer = bsloss.BERTScorer(autocast_dtype=dtype, chunk_size=chunk_size)
    scorer.score(cands[:64], refs[:64])  # warm-up: allocator and kernels
    before = _rss_mb()
    start = time.perf_counter()
    _, _, f = scorer.score(cands, refs, progress=False)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "pairs": num_pairs,
        "rss_before_mb": before,
        "peak_rss_mb": peak,
        "peak_minus_before_mb": peak - before,
        "seconds": seconds,
        "mean_f": f.mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--mode", choices=["exact", "fast"], default="fast")
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.mode, args.chunk_size)))
        return
    rows = []
    for n in args.pairs:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--worker",
                str(n),
                "--mode",
                args.mode,
                "--chunk-size",
                str(args.chunk_size),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{n} pairs: {rows[-1]}", file=sys.stderr)
    print(
        f"- command: `{command_line()}`\n- CPU: {cpu_model()}; mode {args.mode}, "
        f"chunk_size {args.chunk_size}\n"
    )
    print("| pairs | seconds | RSS before scoring MB | peak RSS MB | peak − before MB |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['pairs']} | {row['seconds']:.1f} | {row['rss_before_mb']:.0f} | "
            f"{row['peak_rss_mb']:.0f} | {row['peak_minus_before_mb']:.0f} |"
        )
    if len(rows) >= 2:
        ratio = rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"]
        print(
            f"\npeak RSS ratio {rows[-1]['pairs']} / {rows[0]['pairs']} pairs: {ratio:.2f}× "
            "(goal ≤ 1.2×)"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
