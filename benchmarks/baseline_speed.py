"""``compute_baseline`` (``bsloss baseline``) of two trees side by side: alternating
subprocesses, each importing ``bsloss`` from its tree, on Brown sentences (MiniLM, seed 0);
the best wall time of the call of each, their ratio, and the tables' largest difference.

    HF_HUB_OFFLINE=1 BSLOSS_DATA_DIR=/work/shared/data \\
        python benchmarks/baseline_speed.py --old /tmp/bsloss-old --pairs 300 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE = r"""
import json, os, sys, time
import torch
import bsloss
assert bsloss.__file__.startswith(sys.argv[2]), bsloss.__file__  # the tree asked for
from bsloss.baseline_estimation import compute_baseline
torch.set_num_threads(2)
path = os.path.join(os.environ["BSLOSS_DATA_DIR"], "brown-sentences.txt")
lines = [line for line in open(path, encoding="utf-8").read().splitlines() if line.strip()]
compute_baseline(lines[:50], num_pairs=8, seed=0)  # the model's load and first batches
start = time.perf_counter()
table = compute_baseline(lines, num_pairs=int(sys.argv[1]), seed=0)
print(json.dumps({"seconds": time.perf_counter() - start, "table": table.tolist()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the other tree (a git worktree)")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    trees = {"old": str(Path(args.old).resolve()), "new": str(REPO)}
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("BSLOSS_DATA_DIR", str(REPO.parent / "shared" / "data"))
    times: dict[str, list[float]] = {name: [] for name in trees}
    tables = {}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            command = [sys.executable, "-c", CODE, str(args.pairs), tree]
            done = subprocess.run(command, cwd=tree, env={**env, "PYTHONPATH": tree},
                                  capture_output=True, text=True, check=True)  # fmt: skip
            result = json.loads(done.stdout.strip().splitlines()[-1])
            times[name].append(result["seconds"])
            tables[name] = result["table"]
    difference = max(
        abs(a - b)
        for old_row, new_row in zip(tables["old"], tables["new"], strict=True)
        for a, b in zip(old_row, new_row, strict=True)
    )
    best = {name: min(values) for name, values in times.items()}
    print(
        f"{args.pairs} pairs: old {best['old']:.2f} s, new {best['new']:.2f} s (best of "
        f"{args.rounds}); old / new = {best['old'] / best['new']:.2f}x; largest table "
        f"difference {difference:.1e}"
    )


if __name__ == "__main__":
    main()
