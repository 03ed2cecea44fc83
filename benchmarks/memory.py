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

import sys

if not __package__:  # run as `python benchmarks/memory.py`
    import _path  # noqa: F401

from benchmarks import harness
from benchmarks._data import data_dir

MIB = 2**20
GROWTH = harness.Goal("peak RSS, largest / smallest number of pairs", 1.2, "<=")


def score_pairs(num_pairs: int, mode: str, chunk_size: int) -> dict:
    """In a fresh process (:func:`~benchmarks.harness.run_isolated`): score ``num_pairs``."""
    import time

    import torch

    import bsloss
    from bsloss.baseline_estimation import random_pairs

    sentences = (data_dir() / "brown-sentences.txt").read_text(encoding="utf-8").splitlines()
    cands, refs = random_pairs(sentences, num_pairs, seed=0)
    dtype = torch.bfloat16 if mode == "fast" else None
    scorer = bsloss.BERTScorer(autocast_dtype=dtype, chunk_size=chunk_size)
    scorer.score(cands[:64], refs[:64])  # warm-up: allocator and kernels
    with harness.MemoryMeter(reset_peak=False) as meter:  # the process's lifetime peak, as measured
        start = time.perf_counter()
        _, _, f = scorer.score(cands, refs, progress=False)
        seconds = time.perf_counter() - start
    return {
        "pairs": num_pairs,
        "rss_before_mb": meter.rss_before / MIB,
        "peak_rss_mb": meter.peak_rss / MIB,
        "peak_minus_before_mb": meter.extra_peak / MIB,
        "seconds": seconds,
        "mean_f": f.mean().item(),
    }


def main() -> None:
    parser = harness.argument_parser(__doc__, out=False)
    parser.add_argument("--pairs", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--mode", choices=["exact", "fast"], default="fast")
    parser.add_argument("--chunk-size", type=int, default=8192)
    args = parser.parse_args()
    env = harness.environment()
    rows = []
    for n in args.pairs:
        rows.append(harness.run_isolated(score_pairs, n, args.mode, args.chunk_size))
        harness.log(f"{n} pairs: {rows[-1]}")
    table = [
        (
            row["pairs"],
            f"{row['seconds']:.1f}",
            f"{row['rss_before_mb']:.0f}",
            f"{row['peak_rss_mb']:.0f}",
            f"{row['peak_minus_before_mb']:.0f}",
        )
        for row in rows
    ]
    header = ["pairs", "seconds", "RSS before scoring MB", "peak RSS MB", "peak − before MB"]
    lines = [*harness.header_lines(env), f"- mode {args.mode}, chunk_size {args.chunk_size}", ""]
    lines.append(harness.markdown_table(header, table, "rrrrr"))
    if len(rows) >= 2:
        ratio = rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"]
        lines.append(
            f"\npeak RSS ratio {rows[-1]['pairs']} / {rows[0]['pairs']} pairs: {ratio:.2f}× "
            f"(goal {GROWTH.target}×: {GROWTH.verdict(ratio)})"
        )
    harness.write_outputs("\n".join(lines), None, args.json, rows)


if __name__ == "__main__":
    sys.exit(main())
