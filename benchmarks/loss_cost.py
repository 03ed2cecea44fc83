"""Cost of bsloss.BERTScoreLoss on CPU: gradient checkpointing and top-k distributions.

What is measured
----------------
``BERTScoreLoss`` on the embedded scorer (all-MiniLM-L6-v2, layer 6, hidden 384, vocabulary
V = 30,522), ``matching="softmax"``, ``temperature=0.05``, F1 target, on CPU. Candidates are
random normal logits ``[B, L, V]`` (``requires_grad=True``, seed 0, every position a real token);
references are the first B ``sentence2`` of STS-B dev (``../shared/data/stsb-dev.tsv``, read by
``benchmarks/_data.py``). Sizes B×L = 16×64 and 64×128. Three configurations:

* ``ckpt dense``: ``gradient_checkpointing=True``, ``top_k=None`` (the defaults);
* ``no-ckpt dense``: ``gradient_checkpointing=False``, ``top_k=None``;
* ``ckpt top_k=32``: ``gradient_checkpointing=True``, ``top_k=32``.

Method
------
For each size, one fresh worker process per configuration (``harness.Worker``, a
``LossSession``) builds the loss, encodes and caches its B references (so no measurement
includes reference encoding) and warms up with one forward+backward at B×8. The workers stay
alive side by side; the parent sends each a command in turn, so the configurations alternate
within every repetition and only one computes at a time.

* Memory (the first command to each worker, one forward+backward, in a fresh process):

  - *saved activations*: the bytes of the distinct storages that autograd saves for backward
    during the forward pass (a ``torch.autograd.graph.saved_tensors_hooks`` pack hook,
    deduplicated by storage pointer; the scorer's parameters and buffers and the input logits
    excluded), plus the layer inputs that ``torch.utils.checkpoint`` keeps for recomputation
    (counted by wrapping the ``checkpoint`` function bsloss calls; the checkpoint's own pack hook
    hides everything saved inside a checkpointed layer). Split into tensors with a
    vocabulary-sized dimension (the distribution over V) and the rest (scorer and matching);
  - *peak allocated*: the peak, over forward+backward, of the bytes allocated by PyTorch's CPU
    allocator since the pass began (``torch.profiler`` with ``profile_memory=True``, the
    ``Total Allocated`` of its memory events); *retained* is the same at the end of the forward
    pass. Both include the gradient of the logits (B·L·V·4 bytes) that backward returns;
  - *peak RSS Δ*: the process's peak resident set size during the pass minus its RSS just before
    (the high-water mark is reset through ``/proc/self/clear_refs``; where that is not allowed,
    ``ru_maxrss`` of the fresh process is used instead). It includes the logits gradient and
    anything outside PyTorch's allocator (BLAS workspaces, allocator slack).

* Time: ``--repeats`` (default 5) plain forward+backward passes per configuration at 16×64 and
  ``--large-repeats`` (default 1: at 64×128 a pass costs ~4-8× as much, ~30 s on two cores,
  and the whole run takes ~9 minutes) at 64×128, alternating, timed with ``time.perf_counter``;
  the tables give medians. The memory pass runs under the profiler and is not counted (its wall
  time is in the JSON).

The distribution→embedding step (``bsloss.distributions.token_distribution`` +
``expected_embeddings`` against the scorer's input-embedding table, forward+backward with a fixed
random output gradient) is timed on its own in the parent process, dense against ``top_k=32``, at
the same sizes and repetitions (one warm-up each at B×8), alternating; the first repetition also
counts its saved tensors. A third, reference row (*not* bsloss code,
``reference_topk_embeddings``) computes the same expected embeddings with nothing V-sized beyond
the top-k itself: ``topk`` of the logits and a softmax over the k values (renormalised top-k
probabilities do not depend on the full softmax's denominator), ``embedding_bag`` with
per-sample weights, and a finiteness check by ``aminmax``; it shows what the step can cost.

Goals (from the issue): gradient checkpointing at least halves the peak activation memory at no
more than 1.4× the time; ``top_k=32`` cuts the cost of the distribution→embedding step at least
10× at V≈30k. The report prints the measured ratios next to them, met or NOT met.

Reproduce (from the repository root; the data folder is ``../shared/data`` or
``$BSLOSS_DATA_DIR``)::

    HF_HUB_OFFLINE=1 python benchmarks/loss_cost.py --out /tmp/loss_cost.md \\
        --json /tmp/loss_cost.json

``--quick`` (1 repetition, 16×64 only) is a smoke test of about two minutes on two cores.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if not __package__:  # run as `python benchmarks/loss_cost.py`
    import _path  # noqa: F401

import torch

from benchmarks import harness

MATCHING, TEMPERATURE, TOP_K = "softmax", 0.05, 32
SIZES = ((16, 64), (64, 128))
WARMUP_LENGTH = 8
CONFIGS: dict[str, dict] = {
    "ckpt dense": {"gradient_checkpointing": True, "top_k": None},
    "no-ckpt dense": {"gradient_checkpointing": False, "top_k": None},
    f"ckpt top_k={TOP_K}": {"gradient_checkpointing": True, "top_k": TOP_K},
}
CKPT, NOCKPT, TOPK = CONFIGS
PASS_PARTS = ("total_s", "forward_s", "backward_s")  # fwd+bwd, fwd, bwd seconds of a pass
CKPT_TIME = harness.Goal("checkpointing: time ≤ 1.4× no-checkpointing", 1.4, "<=")
CKPT_MEMORY = harness.Goal("checkpointing: ≤ 0.5× activation memory", 0.5, "<=")
TOPK_SPEEDUP = harness.Goal(f"top_k={TOP_K}: distribution→embedding step ≥ 10× cheaper", 10.0, ">=")

MB = harness.MB


# ----------------------------------------------------------------------------- memory meters
class SavedTensorMeter:
    """Distinct storages saved for backward (pack hook) plus tensors held by checkpoint."""

    def __init__(self, exclude: Sequence[torch.Tensor], vocab: int):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.vocab = vocab
        self.storages: dict[int, dict] = {}

    def add(self, tensor: torch.Tensor, source: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.exclude or ptr in self.storages:
            return
        self.storages[ptr] = {
            "bytes": storage.nbytes(),
            "vocab_dim": self.vocab in tensor.shape,
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).replace("torch.", ""),
            "source": source,
        }

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor, "autograd")
        return tensor

    @contextlib.contextmanager
    def recording(self):
        """Count during the forward pass: saved tensors and checkpointed layers' inputs."""
        import bsloss.scorer.checkpointing as ckpt_module

        original = ckpt_module.checkpoint

        def counting_checkpoint(function, *args, **kwargs):
            for value in (*args, *kwargs.values()):
                self.add(value, "checkpoint input")
            return original(function, *args, **kwargs)

        ckpt_module.checkpoint = counting_checkpoint
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            ckpt_module.checkpoint = original

    def summary(self) -> dict:
        rows = list(self.storages.values())
        total = sum(r["bytes"] for r in rows)
        vocab = sum(r["bytes"] for r in rows if r["vocab_dim"])
        ckpt = sum(r["bytes"] for r in rows if r["source"] == "checkpoint input")
        largest = sorted(rows, key=lambda r: -r["bytes"])[:8]
        return {
            "saved_mb": total / MB,
            "saved_vocab_mb": vocab / MB,
            "saved_other_mb": (total - vocab) / MB,
            "checkpoint_inputs_mb": ckpt / MB,
            "saved_count": len(rows),
            "largest_saved": largest,
        }


def allocator_profile(prof, backward_marker: str) -> dict:
    """Peak and end-of-forward 'Total Allocated' (CPU) from the profiler's memory events."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
    starts = [e["ts"] for e in events if e.get("name") == backward_marker]
    backward_start = min(starts) if starts else float("inf")
    memory = sorted(
        (
            e
            for e in events
            if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0
        ),
        key=lambda e: e["ts"],
    )
    # 'Total Allocated' counts what is allocated while profiling, cumulated over the process's
    # profiling sessions: measure from the total just before the pass's first allocation.
    base = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"] if memory else 0
    totals = [(e["ts"], e["args"]["Total Allocated"] - base) for e in memory]
    forward = [total for ts, total in totals if ts < backward_start]
    return {
        "peak_alloc_mb": max((t for _, t in totals), default=0) / MB,
        "forward_peak_alloc_mb": max(forward, default=0) / MB,
        "retained_alloc_mb": (forward[-1] if forward else 0) / MB,
        "memory_events": len(totals),
    }


# ----------------------------------------------------------------------------- worker
def _make_logits(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, vocab, generator=generator).requires_grad_(True)


class LossSession:
    """One configuration in its own process (a :class:`~benchmarks.harness.Worker`): the loss
    built, its references cached, one warm-up pass at B×8; then ``memory()`` and ``time()``."""

    def __init__(self, batch: int, length: int, config: str):
        from benchmarks._data import load_stsb_dev
        from bsloss import BERTScoreLoss

        torch.manual_seed(0)
        self.loss = BERTScoreLoss(
            matching=MATCHING, temperature=TEMPERATURE, device="cpu", **CONFIGS[config]
        )
        self.vocab = self.loss.encoder.input_embeddings.num_embeddings
        _, self.references = load_stsb_dev(batch)
        if len(self.references) != batch:
            raise SystemExit(f"STS-B dev has only {len(self.references)} sentences")
        self.loss.encode_references(self.references)  # the measured passes do not encode them
        warm = _make_logits(batch, WARMUP_LENGTH, self.vocab, seed=1)
        self.loss(logits=warm, references=self.references).backward()
        self.logits = _make_logits(batch, length, self.vocab, seed=0)
        self.exclude = [*self.loss.parameters(), *self.loss.buffers(), self.logits]

    def _forward(self) -> torch.Tensor:
        return self.loss(logits=self.logits, references=self.references)

    def _clear(self) -> None:
        self.logits.grad = None
        gc.collect()

    def time(self) -> dict:
        self._clear()
        start = time.perf_counter()
        value = self._forward()
        middle = time.perf_counter()
        value.backward()
        end = time.perf_counter()
        return {"forward_s": middle - start, "backward_s": end - middle, "total_s": end - start}

    def memory(self) -> dict:
        from torch.profiler import ProfilerActivity, profile, record_function

        self._clear()
        saved = SavedTensorMeter(self.exclude, self.vocab)
        with harness.MemoryMeter() as rss:
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                with saved.recording():
                    value = self._forward()
                with record_function("loss_cost_backward"):
                    value.backward()
        instrumented_s = time.perf_counter() - start
        del value
        return {
            **saved.summary(),
            **allocator_profile(prof, "loss_cost_backward"),
            "rss_before_mb": rss.rss_before / MB,
            "peak_rss_delta_mb": rss.extra_peak / MB,
            "rss_method": rss.method,
            "logits_grad_mb": self.logits.numel() * self.logits.element_size() / MB,
            "instrumented_pass_s": instrumented_s,
        }


def measure_loss(batch: int, length: int, repeats: int) -> dict:
    label = f"[loss {batch}×{length}]"
    harness.log(f"{label} starting {len(CONFIGS)} workers (model load, reference cache, warm-up)")
    with contextlib.ExitStack() as stack:
        # they load side by side; nothing is measured until all are ready
        workers = {
            c: stack.enter_context(harness.Worker(LossSession, batch, length, c)) for c in CONFIGS
        }
        results: dict[str, dict] = {}
        for config, worker in workers.items():
            memory = worker.ready().call("memory")
            results[config] = {"memory": memory}
            harness.log(
                f"{label} {config}: saved {memory['saved_mb']:.0f} MB, peak alloc "
                f"{memory['peak_alloc_mb']:.0f} MB, peak RSS Δ {memory['peak_rss_delta_mb']:.0f} "
                "MB"
            )
        timer = harness.AlternatingTimer(repeats, label)
        series = timer.run({c: (lambda w=w: w.call("time")) for c, w in workers.items()})
    for config, data in results.items():
        data["times"] = series[config].values  # the worker's own clock, without the pipe
        for key in PASS_PARTS:
            data[f"median_{key}"] = series[config].median(key=lambda t, k=key: t[k])
    return results


# ----------------------------------------------------------------------------- step benchmark
def reference_topk_embeddings(logits: torch.Tensor, table: torch.Tensor, k: int) -> torch.Tensor:
    """Reference (not bsloss): the same expected embeddings as ``top_k=k``, computing nothing
    V-sized but the top-k itself. A finiteness check by ``aminmax`` (NaN propagates, ±inf
    shows), ``topk`` of the logits, softmax over the k values (renormalised top-k probabilities
    do not depend on the full softmax's denominator) and ``embedding_bag`` with per-sample
    weights (its backward does not keep the gathered rows)."""
    low, high = torch.aminmax(logits.detach())
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        raise ValueError("logits contains NaN or Inf")
    values, indices = logits.float().topk(k, dim=-1)
    weights = torch.softmax(values, dim=-1).to(table.dtype)
    batch, length, _ = logits.shape
    flat = torch.nn.functional.embedding_bag(
        indices.reshape(-1, k), table, per_sample_weights=weights.reshape(-1, k), mode="sum"
    )
    return flat.view(batch, length, -1)


def measure_step(batch: int, length: int, repeats: int, table: torch.Tensor) -> dict:
    from bsloss.distributions import expected_embeddings, token_distribution

    vocab, hidden = table.shape
    reference = f"top_k={TOP_K} reference (not bsloss): topk of logits + embedding_bag"
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "dense": lambda x: expected_embeddings(token_distribution(x), table),
        f"top_k={TOP_K}": lambda x: expected_embeddings(token_distribution(x, top_k=TOP_K), table),
        reference: lambda x: reference_topk_embeddings(x, table, TOP_K),
    }
    generator = torch.Generator().manual_seed(2)
    warm_logits = _make_logits(batch, WARMUP_LENGTH, vocab, seed=1)
    warm_grad = torch.randn(batch, WARMUP_LENGTH, hidden, generator=generator)
    for run in variants.values():
        run(warm_logits).backward(warm_grad)
    del warm_logits, warm_grad
    logits = _make_logits(batch, length, vocab, seed=0)
    grad = torch.randn(batch, length, hidden, generator=generator)
    outputs: dict[str, torch.Tensor] = {}
    saved_mb: dict[str, float] = {}

    def one_pass(name: str) -> dict:
        logits.grad = None
        # The first repetition also counts the saved tensors (a pack hook: a Python call per
        # saved tensor, a handful here) and keeps the output for the agreement check.
        first = name not in outputs
        meter = SavedTensorMeter([table, logits], vocab)
        start = time.perf_counter()
        with meter.recording() if first else contextlib.nullcontext():
            out = variants[name](logits)
        middle = time.perf_counter()
        out.backward(grad)
        end = time.perf_counter()
        if first:
            outputs[name] = out.detach()
            saved_mb[name] = meter.summary()["saved_mb"]
        return {"forward_s": middle - start, "backward_s": end - middle, "total_s": end - start}

    timer = harness.AlternatingTimer(repeats, f"[step {batch}×{length}]")
    series = timer.run({name: (lambda n=name: one_pass(n)) for name in variants})
    names = list(variants)
    results: dict[str, dict] = {}
    for name in names:
        results[name] = {"times": series[name].values, "saved_mb": saved_mb[name]}
        for key in PASS_PARTS:
            results[name][f"median_{key}"] = series[name].median(key=lambda t, k=key: t[k])
    dense = results[names[0]]["median_total_s"]
    for name in names:
        results[name]["speedup_vs_dense"] = dense / results[name]["median_total_s"]
    results[reference]["max_abs_diff_vs_bsloss_top_k"] = (
        (outputs[reference] - outputs[names[1]]).abs().max().item()
    )
    return results


# ----------------------------------------------------------------------------- report
MEMORY_MEASURES = (
    ("saved_mb", "saved activations (total)"),
    ("saved_other_mb", "saved activations without V-sized tensors"),
    ("peak_alloc_mb", "peak allocated"),
    ("peak_rss_delta_mb", "peak RSS Δ"),
)


def goals(loss: dict, step: dict) -> list[dict]:
    rows = []
    for size, res in loss.items():
        on, off = res[CKPT], res[NOCKPT]
        ratio = on["median_total_s"] / off["median_total_s"]
        rows.append(CKPT_TIME.row(ratio, size=size, measure="median fwd+bwd time, ckpt / no-ckpt"))
        for key, what in MEMORY_MEASURES:
            ratio = on["memory"][key] / off["memory"][key]
            rows.append(CKPT_MEMORY.row(ratio, size=size, measure=f"{what}, ckpt / no-ckpt"))
    for size, res in step.items():
        speedup = res[f"top_k={TOP_K}"]["speedup_vs_dense"]
        rows.append(
            TOPK_SPEEDUP.row(speedup, size=size, measure="median fwd+bwd time, dense / top_k")
        )
    return rows


def _median_cells(data: dict, scale: float, digits: int) -> list[str]:
    """The median fwd+bwd, fwd and bwd times, times ``scale``, to ``digits`` decimals."""
    return [f"{data[f'median_{key}'] * scale:.{digits}f}" for key in PASS_PARTS]


def render(meta: dict, loss: dict, step: dict, goal_rows: list[dict]) -> str:
    lines = ["# BERTScoreLoss cost on CPU: gradient checkpointing and top-k", ""]
    lines += harness.header_lines(meta["env"], "torch default")
    lines += [
        f"- loss: embedded all-MiniLM-L6-v2 (layer 6, V = {meta['vocab']:,}), "
        f"matching={MATCHING!r}, temperature={TEMPERATURE}, F1; candidates: random normal "
        "logits [B, L, V]; references: the first B STS-B dev sentence2 (cached)",
        f"- time: median of {meta['repeats']} (16×64) / {meta['large_repeats']} (64×128) "
        "alternating forward+backward passes per configuration, after a B×8 warm-up",
        "- memory: one forward+backward in a fresh process per configuration "
        "(see the module docstring)",
        "",
        "## Loss forward+backward",
        "",
    ]
    loss_rows = [
        (
            size,
            config,
            *_median_cells(data, 1, 2),
            f"{m['saved_mb']:.0f} ({m['saved_vocab_mb']:.0f} · {m['saved_other_mb']:.0f})",
            f"{m['retained_alloc_mb']:.0f}",
            f"{m['peak_alloc_mb']:.0f}",
            f"{m['peak_rss_delta_mb']:.0f}",
        )
        for size, res in loss.items()
        for config, data in res.items()
        for m in [data["memory"]]
    ]
    header = ["B×L", "configuration", "fwd+bwd s", "fwd s", "bwd s"]
    header += ["saved activations MB (V-sized · rest)", "retained after fwd MB"]
    header += ["peak allocated MB", "peak RSS Δ MB"]
    lines.append(harness.markdown_table(header, loss_rows, "llrrrrrrr"))
    first = next(iter(loss.values()))[CKPT]["memory"]
    lines += [
        "",
        "Saved activations: storages autograd keeps for backward plus the layer inputs "
        "checkpointing keeps, deduplicated (V-sized: tensors with a dimension of size V). "
        "Retained / peak allocated: PyTorch CPU allocator, relative to the start of the "
        "pass; they and the peak RSS Δ include the logits' gradient "
        f"({first['logits_grad_mb']:.0f} MB at {next(iter(loss))}; 8× that at 64×128). "
        f"RSS method: {first['rss_method']}.",
        "",
        "## Distribution→embedding step (token_distribution + expected_embeddings)",
        "",
    ]
    step_rows = [
        (
            size,
            name,
            *_median_cells(data, 1e3, 0),
            f"{data['saved_mb']:.1f}",
            f"{data['speedup_vs_dense']:.2f}×",
        )
        for size, res in step.items()
        for name, data in res.items()
    ]
    header = ["B×L", "variant", "fwd+bwd ms", "fwd ms", "bwd ms", "saved MB", "dense / variant"]
    lines.append(harness.markdown_table(header, step_rows, "llrrrrr"))
    diffs = [
        res[name]["max_abs_diff_vs_bsloss_top_k"]
        for res in step.values()
        for name in res
        if "reference" in name
    ]
    lines += [
        "",
        "The reference row is not bsloss code (see `reference_topk_embeddings`); its "
        f"output matches bsloss's top_k={TOP_K} to {max(diffs):.1e} (max abs diff).",
        "",
        "## Goals",
        "",
    ]
    rows = [
        (r["goal"], r["size"], r["measure"], f"{r['ratio']:.2f}", r["target"], r["result"])
        for r in goal_rows
    ]
    header = ["goal", "B×L", "measure", "ratio", "target", "result"]
    lines += [harness.markdown_table(header, rows, "lllrll"), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None):
    parser = harness.argument_parser(__doc__)
    repeats = "timed repetitions at 16×64 (default 5; 1 with --quick)"
    parser.add_argument("--repeats", type=int, help=repeats)
    parser.add_argument(
        "--large-repeats", type=int, default=1, help="timed repetitions at 64×128 (default 1)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repetition, 16×64")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.repeats < 1 or args.large_repeats < 1:
        parser.error("--repeats and --large-repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from bsloss.scorer.encoder import ScorerEncoder

    started = time.perf_counter()
    env = harness.environment()  # before measuring: other people may edit the tree meanwhile
    sizes = SIZES[:1] if args.quick else SIZES
    repeats = {SIZES[0]: args.repeats, SIZES[1]: 1 if args.quick else args.large_repeats}
    table = ScorerEncoder.from_pretrained(None, device="cpu").input_embeddings.weight.detach()
    loss = {f"{b}×{n}": measure_loss(b, n, repeats[(b, n)]) for b, n in sizes}
    harness.log("distribution→embedding step ...")
    step = {f"{b}×{n}": measure_step(b, n, repeats[(b, n)], table) for b, n in sizes}
    meta = {
        "env": env,
        "vocab": int(table.shape[0]),
        "repeats": repeats[SIZES[0]],
        "large_repeats": repeats[SIZES[1]],
        "quick": args.quick,
    }
    goal_rows = goals(loss, step)
    report = render(meta, loss, step, goal_rows)
    meta["runtime_s"] = time.perf_counter() - started
    payload = {"meta": meta, "loss": loss, "step": step, "goals": goal_rows}
    harness.write_outputs(report, args.out, args.json, payload)
    harness.log(f"total runtime {meta['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
