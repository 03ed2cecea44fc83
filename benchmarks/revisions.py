"""Two bsloss source trees side by side: did a change move the speed of a measured path?

A refactor that moves code (the encoder's split, the loss's special-token splicing) must leave
the measured paths as fast as they were and the scores identical. Each tree runs in its own
worker process (:class:`~benchmarks.harness.Worker`), which imports bsloss from that tree and
holds a scorer and a loss; the two workers then run alternately
(:class:`~benchmarks.harness.AlternatingTimer`), so load from other processes falls on both:

* **metric**: ``BERTScorer.score`` of the 1,500 STS-B dev pairs (batch 64), the reference cache
  off, so every call encodes every text;
* **loss**: ``BERTScoreLoss`` (softmax matching) forward and backward on random logits
  ``[8, 24, V]`` against 8 STS-B references (the references' embeddings cached, as in training).

The report gives each tree's median seconds, the ratio new / old (about 1: no change; the range of
the per-round ratios shows the noise) and whether the F1 of the metric is bit-identical.

Reproduce (the old tree from git)::

    git worktree add --detach /tmp/bsloss-old <REV>
    HF_HUB_OFFLINE=1 python benchmarks/revisions.py --old /tmp/bsloss-old --rounds 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/revisions.py`
    import _path  # noqa: F401

from benchmarks import harness
from benchmarks._data import load_stsb_dev

SAME_SPEED = harness.Goal("new / old seconds", 1.05, "<=")


class TreeScoring:
    """A worker's state: bsloss imported from ``tree``, a scorer and a loss built once."""

    def __init__(self, tree: str, threads: int):
        sys.path.insert(0, tree)  # before bsloss is first imported in this process
        import torch

        import bsloss

        if not Path(bsloss.__file__).resolve().is_relative_to(Path(tree).resolve()):
            raise RuntimeError(f"bsloss came from {bsloss.__file__}, not from {tree}")
        torch.set_num_threads(threads)
        self.torch = torch
        self.cands, self.refs = load_stsb_dev()
        self.scorer = bsloss.BERTScorer(device="cpu", batch_size=64)
        self.loss_fn = bsloss.BERTScoreLoss(encoder=self.scorer.encoder, matching="softmax")
        generator = torch.Generator().manual_seed(0)
        vocab = self.scorer.encoder.input_embeddings.num_embeddings
        self.logits = torch.randn(8, 24, vocab, generator=generator).requires_grad_()
        self.scorer.score(self.cands[:16], self.refs[:16], progress=False)  # warm-up
        self.loss()

    def metric(self) -> float:
        f1 = self.scorer.score(self.cands, self.refs, progress=False)[2]
        return float(f1.double().sum())

    def loss(self) -> float:
        self.logits.grad = None
        value = self.loss_fn(logits=self.logits, references=self.refs[:8])
        value.backward()
        return float(value)


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--old", required=True, help="the other bsloss source tree (a checkout)")
    parser.add_argument("--new", default=str(harness.REPO_ROOT), help="default: this tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    env = harness.environment()
    trees = {"old": args.old, "new": args.new}
    workers = {
        name: harness.Worker(TreeScoring, tree, args.threads) for name, tree in trees.items()
    }
    try:
        for worker in workers.values():
            worker.ready()
        rows, payload = [], {}
        for path in ("metric", "loss"):
            timer = harness.AlternatingTimer(args.rounds, label=path)
            calls = {name: (lambda w=w, p=path: w.call(p)) for name, w in workers.items()}
            series = timer.run(calls)
            old, new = series["old"], series["new"]
            ratio = new.median() / old.median()
            low, high = harness.ratio_range(new.seconds, old.seconds)
            same = old.values[0] == new.values[0]
            rows.append(
                (path, f"{old.median():.3f}", f"{new.median():.3f}", f"{ratio:.3f}",
                 f"{low:.3f}–{high:.3f}", "yes" if same else "no",
                 SAME_SPEED.verdict(ratio))
            )  # fmt: skip
            payload[path] = {"old": old.seconds, "new": new.seconds, "values_equal": same}
    finally:
        for worker in workers.values():
            worker.close()
    header = ["path", "old s", "new s", "new / old", "per-round range", "same value", "≤ 1.05"]
    lines = [
        *harness.header_lines(env),
        # header_lines reports this process's threads; the timed work runs in the workers
        f"- old: `{args.old}`; new: `{args.new}`; each worker {args.threads} torch thread(s)",
        "",
    ]
    lines.append(harness.markdown_table(header, rows, "lrrrrll"))
    harness.write_outputs("\n".join(lines), args.out, args.json, payload)


if __name__ == "__main__":
    sys.exit(main())
