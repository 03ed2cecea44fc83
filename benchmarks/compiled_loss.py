"""The loss eager and compiled (``loss.compile()``), side by side, where the host's work is all
there is.

On a GPU the loss at MiniLM's size is bound by the host (``benchmarks/README.md``, "Runs 4-6"):
Python, the dispatcher and one kernel launch per operation. ``loss.compile()`` compiles the
candidates' encoding (one graph after the logits' finiteness check, its one break) and the
matching (one graph), with the references handled eagerly between them
(``tests/test_loss.py::test_the_compiled_loss_breaks_only_at_its_finite_check``). This times
forward + backward of ``BERTScoreLoss`` defaults, eager and compiled (inductor, the default
mode), alternately in one process, on small logits ``[B, L, V]`` through a random scorer of
MiniLM's vocabulary and depth but 32 wide, so that the arithmetic is small beside the host's
work. The scorer's mask is prepared as on a GPU (``paced_by_host`` forced). A CPU measure of
host work, not a GPU figure: the GPU benchmark's precision section times the compiled loss on
a card.

    HF_HUB_OFFLINE=1 python benchmarks/compiled_loss.py --rounds 7
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

if not __package__:  # run as `python benchmarks/compiled_loss.py`
    import _path  # noqa: F401

from benchmarks import harness
from benchmarks.revisions import narrow_scorer

SAME_VALUE = 1e-6


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30, help="loss calls per timed round")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import logging

    import torch

    import bsloss.scorer.encoder
    from bsloss import BERTScoreLoss
    from bsloss.scorer.encoder import ScorerEncoder

    warnings.simplefilter("ignore")
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    env = harness.environment()
    bsloss.scorer.encoder.paced_by_host = lambda device: True
    with tempfile.TemporaryDirectory(prefix="bsloss-compiled-") as scratch:
        encoder = ScorerEncoder.from_pretrained(narrow_scorer(Path(scratch)), num_layers=6)
    refs = [f"reference sentence number {i} for the timing" for i in range(args.batch)]
    vocab = encoder.input_embeddings.num_embeddings
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.length, vocab, generator=generator)
    logits.requires_grad_(True)
    losses = {"eager": BERTScoreLoss(model=encoder), "compiled": BERTScoreLoss(model=encoder)}
    for loss in losses.values():
        loss.encode_references(refs)
    losses["compiled"].compile(dynamic=False)

    def calls(loss) -> float:
        for _ in range(args.calls):
            logits.grad = None
            value = loss(logits, references=refs)
            value.backward()
        return float(value)

    compile_s = harness.AlternatingTimer(1, report=None).time(lambda: calls(losses["compiled"]))
    calls(losses["eager"])  # warm
    timer = harness.AlternatingTimer(args.rounds, label="loss")
    series = timer.run({name: (lambda loss=loss: calls(loss)) for name, loss in losses.items()})
    eager, compiled = series["eager"], series["compiled"]
    ratio = compiled.median() / eager.median()
    low, high = harness.ratio_range(compiled.seconds, eager.seconds)
    gap = abs(compiled.values[-1] - eager.values[-1])
    per_call = {name: s.median() / args.calls * 1e3 for name, s in series.items()}
    rows = [
        ("eager", f"{per_call['eager']:.2f}", "1", "", ""),
        (
            "compiled (`loss.compile()`)",
            f"{per_call['compiled']:.2f}",
            f"{ratio:.3f}",
            f"{low:.3f}–{high:.3f}",
            f"{gap:.1e}",
        ),
    ]
    lines = [
        *harness.header_lines(env),
        f"- scorer: random, MiniLM's vocabulary and 6 layers, 32 wide; logits "
        f"[{args.batch}, {args.length}, {vocab:,}]; {args.calls} forward + backward calls a "
        f"round, {args.rounds} rounds alternating; the first compiled round (compilation "
        f"included) took {compile_s[0]:.1f} s",
        "",
        harness.markdown_table(
            ["loss", "ms a call (median)", "/ eager", "per-round range", "|Δ value|"],
            rows,
            "lrrrr",
        ),
    ]
    payload = {
        "eager_s": eager.seconds,
        "compiled_s": compiled.seconds,
        "calls": args.calls,
        "value_gap": gap,
    }
    harness.write_outputs("\n".join(lines), args.out, args.json, payload)
    if gap > SAME_VALUE:
        sys.exit(f"the compiled loss's value differs by {gap:.2e}")


if __name__ == "__main__":
    main()
