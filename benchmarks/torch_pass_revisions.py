"""The fused LM head's PyTorch pass, two source trees side by side: operations a vocabulary
chunk, and the host's time a call.

On a GPU the PyTorch pass (``fused_expected_inputs(backend="torch")``: the CPU's path, the
reference, and on CUDA the path of float32 / float16 products and of top-k, straight-through
and Gumbel candidates) runs at the pace of the host's launches: tens of vocabulary chunks, each
a few dozen small operations (``head_ce_launches.py``: ~60 a chunk for the CE alone, 945 for
the Gemma-shaped step's CE at a card's 16 chunks). This measures what a change to the chunk
loop does to that count and to the host's time, where the arithmetic is small:

* each tree runs in its own worker process (:class:`~benchmarks.harness.Worker`, importing
  bsloss from that tree), on the same problem: ``--rows`` positions, a ``--dim``-wide bfloat16
  head (as a card's products) of ``--chunks`` x ``--chunk-width`` tokens, cut into
  ``--chunks`` vocabulary chunks (``_chunk_shape`` fixed to all the rows by one chunk, CUDA's
  policy), a float32 table of ``--table-width`` columns, random targets (a quarter of them
  ``-100``);
* three calls, forward and backward: the CE alone (``table=None``, the targets), the CE and
  the expectation in one pass (the mixin's ``BERTScoreTerm``), the expectation alone;
* **operations**: the non-view operations that reach PyTorch's dispatcher in one call (each a
  kernel launch on a card; :class:`~benchmarks.launches.LaunchCounter`), and a chunk's share
  (the count at ``--chunks`` less the count at half as many, over the difference);
* **time**: ``--calls`` calls a timed round, the trees alternating (A B A B ...) for
  ``--rounds`` rounds; the median, new / old and the per-round range;
* **values**: each tree's value and gradients of one call, and the largest difference of the
  new tree's from the old's (the chunk loop's sums run in another order: a few units of the
  float32 roundoff, not bit-identical).

Reproduce (the old tree from git)::

    git worktree add --detach /tmp/bsloss-old <REV>
    HF_HUB_OFFLINE=1 python benchmarks/torch_pass_revisions.py --old /tmp/bsloss-old --rounds 7
"""

from __future__ import annotations

import sys

if not __package__:  # run as `python benchmarks/torch_pass_revisions.py`
    import _path  # noqa: F401

from benchmarks import harness

SAME_OR_FASTER = harness.Goal("new / old seconds", 1.05, "<=")
CALLS = {
    "CE only": {"table": False, "targets": True},
    "CE + term": {"table": True, "targets": True},
    "term only": {"table": True, "targets": False},
}


class TreePass:
    """A worker's state: bsloss imported from ``tree``, the problem built once."""

    def __init__(
        self,
        tree: str,
        rows: int,
        dim: int,
        chunks: int,
        chunk_width: int,
        table_width: int,
        calls: int,
    ):
        harness.import_bsloss_from(tree)  # before bsloss is first imported in this process
        import torch

        from bsloss.functional import fused_expectation

        torch.set_num_threads(1)  # the host's work; one thread as a GPU's host thread
        self.torch, self.module, self.calls = torch, fused_expectation, calls
        self.rows, self.chunks, self.chunk_width = rows, chunks, chunk_width
        generator = torch.Generator().manual_seed(0)
        vocab = chunks * chunk_width
        self.hidden = torch.randn(rows, dim, generator=generator).bfloat16().requires_grad_()
        weight = torch.randn(vocab, dim, generator=generator) * dim**-0.5
        self.weight = weight.bfloat16().requires_grad_()
        self.table = torch.randn(vocab, table_width, generator=generator)
        self.targets = torch.randint(0, vocab, (rows,), generator=generator)
        self.targets[torch.randperm(rows, generator=generator)[: rows // 4]] = -100
        self.upstream = torch.randn(rows, table_width, generator=generator)
        for name in CALLS:
            self.call(name)  # warm

    def _pass(self, name: str, chunks: int):
        """One forward and backward of call ``name`` cut into ``chunks`` vocabulary chunks."""
        torch, options = self.torch, CALLS[name]
        width = self.chunks * self.chunk_width // chunks
        policy = self.module._chunk_shape
        self.module._chunk_shape = lambda n, vocab, *args, **kwargs: (n, width)
        try:
            self.hidden.grad = self.weight.grad = None
            out = self.module.fused_expected_inputs(
                self.hidden,
                self.weight,
                self.table if options["table"] else None,
                target_ids=self.targets if options["targets"] else None,
                backend="torch",
            )
            value = torch.zeros(())
            if out.expected is not None:
                value = value + (out.expected * self.upstream).sum()
            if out.log_likelihood is not None:
                value = value - out.log_likelihood.sum()
            value.backward()
        finally:
            self.module._chunk_shape = policy
        return value

    def call(self, name: str) -> float:
        """``calls`` passes of call ``name`` (the timed work); the last value."""
        for _ in range(self.calls):
            value = self._pass(name, self.chunks)
        return float(value)

    def count(self, name: str) -> dict:
        """Dispatcher operations of one pass at ``chunks`` and at half as many chunks."""
        from benchmarks.launches import LaunchCounter

        counts = {}
        for chunks in (self.chunks, self.chunks // 2):
            with LaunchCounter() as counter:
                self._pass(name, chunks)
            counts[chunks] = sum(counter.by_caller.values())
        return {"full": counts[self.chunks], "half": counts[self.chunks // 2]}

    def results(self, name: str) -> dict:
        """One pass's value and gradients, as lists (compared across the trees)."""
        value = self._pass(name, self.chunks)
        return {
            "value": float(value),
            "grad_h": self.hidden.grad.float().flatten().tolist(),
            "grad_w": self.weight.grad.float().flatten().tolist(),
        }


def largest_difference(a: dict, b: dict) -> float:
    """The largest absolute difference of the value and the gradients, relative to the largest
    magnitude of each."""
    worst = abs(a["value"] - b["value"]) / max(abs(a["value"]), 1e-30)
    for key in ("grad_h", "grad_w"):
        scale = max(max(abs(x) for x in a[key]), 1e-30)
        worst = max(worst, max(abs(x - y) for x, y in zip(a[key], b[key], strict=True)) / scale)
    return worst


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--old", required=True, help="the other bsloss source tree (a checkout)")
    parser.add_argument("--new", default=str(harness.REPO_ROOT), help="default: this tree")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=16, help="even; a card's 16 by default")
    parser.add_argument("--chunk-width", type=int, default=32)
    parser.add_argument("--table-width", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20, help="passes a timed round")
    args = parser.parse_args()
    if args.chunks < 2 or args.chunks % 2:
        parser.error(f"--chunks must be even and >= 2, got {args.chunks}")
    env = harness.environment()
    problem = (args.rows, args.dim, args.chunks, args.chunk_width, args.table_width, args.calls)
    trees = {"old": args.old, "new": args.new}
    workers = {name: harness.Worker(TreePass, tree, *problem) for name, tree in trees.items()}
    rows, payload = [], {}
    try:
        for worker in workers.values():
            worker.ready()
        for name in CALLS:
            counts = {tree: w.call("count", name) for tree, w in workers.items()}
            per_chunk = {
                tree: (c["full"] - c["half"]) / (args.chunks // 2) for tree, c in counts.items()
            }
            results = {tree: w.call("results", name) for tree, w in workers.items()}
            difference = largest_difference(results["old"], results["new"])
            timer = harness.AlternatingTimer(args.rounds, label=name)
            series = timer.run(
                {tree: (lambda w=w, n=name: w.call("call", n)) for tree, w in workers.items()}
            )
            old, new = series["old"], series["new"]
            ratio = new.median() / old.median()
            low, high = harness.ratio_range(new.seconds, old.seconds)
            rows.append(
                (name, counts["old"]["full"], counts["new"]["full"], f"{per_chunk['old']:.0f}",
                 f"{per_chunk['new']:.0f}", f"{old.median() / args.calls * 1e3:.2f}",
                 f"{new.median() / args.calls * 1e3:.2f}", f"{ratio:.3f}",
                 f"{low:.3f}–{high:.3f}", f"{difference:.1e}", SAME_OR_FASTER.verdict(ratio))
            )  # fmt: skip
            payload[name] = {
                "operations": counts,
                "per_chunk": per_chunk,
                "old_s": old.seconds,
                "new_s": new.seconds,
                "largest_relative_difference": difference,
            }
    finally:
        for worker in workers.values():
            worker.close()
    header = ["call (forward + backward)", "operations old", "new", "a chunk old", "new",
              "ms a call old", "new", "new / old", "per-round range", "largest difference",
              "≤ 1.05"]  # fmt: skip
    lines = [
        *harness.header_lines(env),
        f"- old: `{args.old}`; new: `{args.new}`; each worker 1 torch thread",
        f"- problem: {args.rows} rows x {args.dim} wide, bf16 head of {args.chunks} chunks x "
        f"{args.chunk_width} tokens, float32 table of {args.table_width} columns; "
        f"{args.calls} calls a timed round, {args.rounds} rounds",
        "- largest difference: of the value and the gradients of h and W, new against old, "
        "relative to each one's largest magnitude",
        "",
        harness.markdown_table(header, rows, "lrrrrrrrrrl"),
    ]
    harness.write_outputs("\n".join(lines), args.out, args.json, payload)


if __name__ == "__main__":
    sys.exit(main())
