"""Two bsloss source trees side by side: did a change move the speed of a measured path?

A refactor that moves code (the encoder's split, the loss's special-token splicing) must leave
the measured paths as fast as they were and the scores identical. Each tree runs in its own
worker process (:class:`~benchmarks.harness.Worker`), which imports bsloss from that tree and
holds a scorer and a loss; the two workers then run alternately
(:class:`~benchmarks.harness.AlternatingTimer`), so load from other processes falls on both:

* **metric**: ``BERTScorer.score`` of the 1,500 STS-B dev pairs (batch 64; ``--brown-pairs N``:
  N pairs of distinct Brown sentences), the reference cache off, so every call encodes every text;
* **loss**: ``BERTScoreLoss`` (softmax matching) forward and backward on random logits
  ``[8, 24, V]`` against 8 STS-B references (the references' embeddings cached, as in training);
  ``--loss-shape B,L,CALLS`` sets the logits' size and the calls per round.

``--narrow`` swaps MiniLM for a random scorer of its vocabulary, tokenizer and depth but 32 wide
(seeded, written once to a temporary folder): its arithmetic is then negligible, so the times are
the host's own work (Python, dispatch, tokenisation, padding), which is what sets the pace of
these paths on a GPU (``benchmarks/README.md``, "On a GPU"). Its scores are not meaningful.

The report gives each tree's median seconds, the ratio new / old (about 1: no change; the range of
the per-round ratios shows the noise) and whether the F1 of the metric is bit-identical.

Reproduce (the old tree from git)::

    git worktree add --detach /tmp/bsloss-old <REV>
    HF_HUB_OFFLINE=1 python benchmarks/revisions.py --old /tmp/bsloss-old --rounds 5
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

if not __package__:  # run as `python benchmarks/revisions.py`
    import _path  # noqa: F401

from benchmarks import harness
from benchmarks._data import data_dir, load_stsb_dev

SAME_SPEED = harness.Goal("new / old seconds", 1.05, "<=")


class TreeScoring:
    """A worker's state: bsloss imported from ``tree``, a scorer and a loss built once."""

    def __init__(
        self,
        tree: str,
        threads: int,
        scorer: str | None = None,
        brown_pairs: int = 0,
        loss_shape: tuple[int, int, int] = (8, 24, 1),
    ):
        bsloss = harness.import_bsloss_from(tree)  # before bsloss is first imported here
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        self.cands, self.refs = load_stsb_dev()
        if brown_pairs:  # distinct sentences, shuffled (seed 0): several of the metric's chunks
            self.cands, self.refs = brown_pairs_of(brown_pairs)
        self.scorer = bsloss.BERTScorer(scorer, 6 if scorer else None, device="cpu", batch_size=64)
        self.loss_fn = bsloss.BERTScoreLoss(encoder=self.scorer.encoder, matching="softmax")
        generator = torch.Generator().manual_seed(0)
        vocab = self.scorer.encoder.input_embeddings.num_embeddings
        batch, length, self.loss_calls = loss_shape
        self.logits = torch.randn(batch, length, vocab, generator=generator).requires_grad_()
        self.scorer.score(self.cands[:16], self.refs[:16], progress=False)  # warm-up
        self.loss()

    def metric(self) -> float:
        f1 = self.scorer.score(self.cands, self.refs, progress=False)[2]
        return float(f1.double().sum())

    def loss(self) -> float:
        for _ in range(self.loss_calls):
            self.logits.grad = None
            value = self.loss_fn(logits=self.logits, references=self.refs[: len(self.logits)])
            value.backward()
        return float(value)


def brown_pairs_of(count: int) -> tuple[list[str], list[str]]:
    """``count`` pairs of distinct Brown sentences (shuffled with seed 0), as the GPU
    benchmark's metric section takes them."""
    import random

    lines = (data_dir() / "brown-sentences.txt").read_text(encoding="utf-8").splitlines()
    distinct = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
    random.Random(0).shuffle(distinct)
    return distinct[:count], distinct[count : 2 * count]


def narrow_scorer(folder: Path, width: int = 32) -> str:
    """A random BERT with MiniLM's config, vocabulary and tokenizer but ``width`` wide, written
    in ``folder``'s subfolder ``narrow-scorer`` (seed 0)."""
    from benchmarks.gpu import write_random_scorer

    narrow = {"hidden_size": width, "intermediate_size": 2 * width, "num_attention_heads": 2}
    return str(write_random_scorer(folder / "narrow-scorer", **narrow))


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--old", required=True, help="the other bsloss source tree (a checkout)")
    parser.add_argument("--new", default=str(harness.REPO_ROOT), help="default: this tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--narrow",
        action="store_true",
        help="a random 32-wide scorer of MiniLM's vocabulary: the host's work alone",
    )
    parser.add_argument(
        "--loss-shape",
        default="8,24,1",
        help="B,L,CALLS: the loss's logits [B, L, V], called CALLS times a round (default 8,24,1; "
        "2,8,50 with --narrow: the host's work per call, little arithmetic)",
    )
    parser.add_argument(
        "--brown-pairs",
        type=int,
        default=0,
        help="score this many pairs of distinct Brown sentences instead of STS-B's dev pairs",
    )
    args = parser.parse_args()
    env = harness.environment()
    trees = {"old": args.old, "new": args.new}
    fields = args.loss_shape.split(",")
    loss_shape = tuple(int(x) for x in fields) if all(x.isdigit() for x in fields) else ()
    if len(loss_shape) != 3 or min(loss_shape) < 1:
        parser.error(
            f"--loss-shape must be B,L,CALLS (three positive integers), got {args.loss_shape}"
        )
    scratch = tempfile.TemporaryDirectory(prefix="bsloss-narrow-")
    scorer = narrow_scorer(Path(scratch.name)) if args.narrow else None
    workers = {
        name: harness.Worker(TreeScoring, tree, args.threads, scorer, args.brown_pairs, loss_shape)
        for name, tree in trees.items()
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
        "- scorer: "
        + ("random, 32 wide (--narrow: the host's work)" if args.narrow else "MiniLM")
        + (f"; metric: {args.brown_pairs:,} distinct Brown pairs" if args.brown_pairs else "")
        + f"; loss: logits [{loss_shape[0]}, {loss_shape[1]}, V], {loss_shape[2]} call(s) a round",
        "",
    ]
    lines.append(harness.markdown_table(header, rows, "lrrrrll"))
    harness.write_outputs("\n".join(lines), args.out, args.json, payload)


if __name__ == "__main__":
    sys.exit(main())
