"""Large vocabularies on CPU: the BERTScore loss from hidden states and the LM head (fused,
chunked) against the dense logits path, on Gemma 3 270M's real LM head.

What is measured
----------------
The LM head is Gemma 3 270M's (``bsloss.pretrained``; V = 262,144, d_model = 640; tied to the
input embeddings, read from the converted safetensors folder), float32, ``requires_grad=True``.
The scorer is the embedded all-MiniLM-L6-v2 (``BERTScoreLoss`` defaults: softmax matching,
temperature 0.05, F1, gradient checkpointing), reached through the real
:class:`~bsloss.bridge.VocabularyBridge` built from Gemma's tokenizer (built once and cached under
``$BSLOSS_CACHE/bridges``). Hidden states are random normal ``[B, L, 640]`` (seed 0, every
position a candidate), targets random ids; references the first B ``sentence2`` of STS-B dev,
encoded and cached before any measurement.

1. *BERTScore term*, at B x L = 4x40, 8x128, 16x256, four variants, forward + backward into
   ``h`` and ``W``:

   - ``dense``: ``logits = h @ W.T`` then ``loss(logits=logits)``;
   - ``fused``: ``loss(hidden_states=h, output_embeddings=W)``;
   - ``dense+CE``: ``dense`` plus ``F.cross_entropy(logits, targets)`` on the same logits;
   - ``fused+CE``: ``loss(hidden_states=h, output_embeddings=W, target_ids=targets)`` (the CE
     from the same chunked pass).

   The dense variants are skipped above ``--dense-max-rows`` positions (default 1024): at 16x256
   their logits alone are 4.3 GB and a pass peaks near 4x that, past this machine's budget.
2. *Expected-embedding step* (no scorer), at 8x128: ``dense step`` = logits, softmax,
   ``expected_inputs`` against the bridge table, backward of a fixed random gradient into ``h``
   and ``W``; ``top-k=32 fused`` = :func:`fused_expected_inputs` with ``top_k=32``, same
   gradient.
3. *Gemma training step* (the whole model, float32, AdamW lr 1e-5, B = 4, 168 random tokens of
   which the last 40 are the completion): ``CE-only`` = backbone, LM head on the 40 completion
   positions only, cross-entropy; ``CE+BERTScore fused`` = backbone, then ``BERTScoreLoss`` on
   the completion positions' hidden states with ``output_embeddings=model.lm_head`` and
   ``target_ids`` (CE from the same pass), loss = CE + BERTScore loss. Each run: load, one
   warm-up step (allocates AdamW's state), then ``--gemma-steps`` measured steps.

Method
------
Every variant runs in its own worker process (``harness.Worker``, a ``PassSession``). Memory: the
worker's first measured pass, right after one warm-up pass at B x 8: *extra peak* = peak RSS
during the pass (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) minus the RSS
just before it (so the LM head, the bridge table, the scorer and the cached references are not
counted; the gradient of W, 0.67 GB, is, in every variant). Time: the two workers compared are
alive side by side and receive their passes in alternation: the memory pass, then ``--repeats``
more (default 2 at 4x40, 1 at 8x128, 0 at 16x256); the median over all of a variant's passes (the
memory pass does the same work). Gemma steps: one fresh
process per run, runs alternating ``CE-only``, ``CE+BERTScore``, ``--gemma-runs`` times each;
*peak RSS* there is the whole process's high-water mark over the measured steps (model, AdamW
state and gradients included); the medians of the step times.

Reproduce (from the repository root)::

    HF_HUB_OFFLINE=1 python benchmarks/fused_vocab.py --out benchmarks/results/fused_vocab.md

It took 34 minutes on 2 busy cores (load average ~9) and peaks below 10 GB (two workers at a
time); ``--sizes 8x128 --step-sizes 8x128 --gemma-runs 0`` (the goal sizes without the Gemma
step) took 10 minutes. ``--from-json A.json B.json`` rewrites the report from saved runs.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/fused_vocab.py`
    import _path  # noqa: F401

import torch

from benchmarks import harness

TOP_K = 32
HEAD_GRAD_BYTES = 262_144 * 640 * 4
PROMPT, COMPLETION, GEMMA_BATCH = 128, 40, 4
TERM_VARIANTS = ("dense", "fused", "dense+CE", "fused+CE")
STEP_VARIANTS = ("dense step", "top-k=32 fused")
GEMMA_VARIANTS = ("CE-only", "CE+BERTScore fused")
FUSED_MEMORY = harness.Goal(
    "fused BERTScore term at 8x128: extra peak memory fused/dense", 0.25, "<="
)
FUSED_TIME = harness.Goal("fused BERTScore term at 8x128: time fused/dense", 1.2, "<=")
GEMMA_TIME = harness.Goal("Gemma step CE+BERTScore (fused) / CE-only: time", 1.3, "<=")
GEMMA_MEMORY = harness.Goal("Gemma step CE+BERTScore (fused) / CE-only: peak RSS", 1.1, "<=")
TOPK_SPEEDUP = harness.Goal(f"top-k={TOP_K} fused vs the dense expected-embedding step", 10, ">=")

MB = harness.MB


# ----------------------------------------------------------------------------- shared pieces
def gemma_folder() -> Path:
    from bsloss.pretrained import pretrained_folder

    return pretrained_folder("gemma-3-270m")


def bridge_path() -> tuple[Path, dict]:
    """The Gemma -> MiniLM bridge (built once, a few minutes, then cached) and its fidelity."""
    from bsloss import VocabularyBridge
    from bsloss.pretrained import cache_root

    path = cache_root() / "bridges" / "gemma-3-270m__all-MiniLM-L6-v2.safetensors"
    try:
        bridge = VocabularyBridge.load(path)
    except (FileNotFoundError, ValueError) as reason:  # absent, or saved in an older format
        from transformers import AutoTokenizer

        from bsloss.scorer.encoder import ScorerEncoder

        harness.log(f"building the bridge ({reason})")
        tokenizer = AutoTokenizer.from_pretrained(gemma_folder())
        encoder = ScorerEncoder.from_pretrained(None, None, "cpu")
        start = time.perf_counter()
        VocabularyBridge.build(tokenizer, encoder).save(path)
        harness.log(f"bridge built in {time.perf_counter() - start:.0f} s")
        bridge = VocabularyBridge.load(path)
    return path, {k: round(v, 3) for k, v in bridge.fidelity().items()}


def load_head() -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(gemma_folder() / "model.safetensors"), framework="pt") as handle:
        return handle.get_tensor("model.embed_tokens.weight").float()


def make_loss(bridge_file: str):
    from bsloss import BERTScoreLoss, VocabularyBridge

    loss = BERTScoreLoss(bridge=VocabularyBridge.load(bridge_file), device="cpu")
    loss._generator_table()  # the [V, 385] bridge table, built once before any measurement
    return loss


def references(batch: int) -> list[str]:
    from benchmarks._data import load_stsb_dev

    _, refs = load_stsb_dev(batch)
    return refs


# ----------------------------------------------------------------------------- workers
def term_pass(variant, loss, weight, h, targets, refs):
    if variant.startswith("dense"):
        logits = h @ weight.T
        value = loss(logits=logits, references=refs)
        if variant == "dense+CE":
            value = value + torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten()
            )
    else:
        out = loss(
            hidden_states=h,
            output_embeddings=weight,
            references=refs,
            target_ids=targets if variant == "fused+CE" else None,
        )
        value = out if variant == "fused" else out.loss + out.cross_entropy
    value.backward()


def step_pass(variant, table, weight, h, grad):
    from bsloss.distributions import expected_inputs, token_distribution
    from bsloss.functional.fused_expectation import fused_expected_inputs

    if variant == "dense step":
        logits = h @ weight.T
        embeddings, weights = expected_inputs(token_distribution(logits=logits), table)
        out = torch.cat([embeddings, weights[..., None]], dim=-1)
    else:
        out = fused_expected_inputs(h.flatten(0, 1), weight, table, top_k=TOP_K).expected
    (out.reshape(grad.shape) * grad).sum().backward()


class PassSession:
    """One variant in its own process (a :class:`~benchmarks.harness.Worker`): the LM head, the
    loss with its cached references and one warm-up pass at B x 8; then ``run_pass()``."""

    def __init__(self, kind: str, variant: str, batch: int, length: int, bridge_file: str):
        torch.manual_seed(0)
        self.kind, self.variant = kind, variant
        self.weight = load_head().requires_grad_()
        self.loss = make_loss(bridge_file)
        self.table = self.loss._generator_table()
        self.refs = references(batch)
        self.loss.encode_references(self.refs)
        self.generator = torch.Generator().manual_seed(0)
        self._run(*self._inputs(batch, 8))  # warm-up: allocator, kernels, the scorer's buckets
        self.h, self.targets, self.grad = self._inputs(batch, length)

    def _inputs(self, batch: int, rows: int):
        g, weight = self.generator, self.weight
        h = torch.randn(batch, rows, weight.shape[1], generator=g).requires_grad_()
        targets = torch.randint(0, weight.shape[0], (batch, rows), generator=g)
        grad = torch.randn(batch, rows, self.table.shape[1], generator=g)
        return h, targets, grad

    def _run(self, h, targets, grad) -> None:
        if self.kind == "term":
            term_pass(self.variant, self.loss, self.weight, h, targets, self.refs)
        else:
            step_pass(self.variant, self.table, self.weight, h, grad)

    def run_pass(self) -> dict:
        """One measured pass: its seconds and the extra peak RSS above the RSS before it."""
        self.h.grad = self.weight.grad = None
        gc.collect()
        with harness.MemoryMeter() as meter:
            start = time.perf_counter()
            self._run(self.h, self.targets, self.grad)
            seconds = time.perf_counter() - start
        return {
            "s": seconds,
            "rss_before_mb": meter.rss_before / MB,
            "extra_peak_mb": meter.extra_peak / MB,
        }


def gemma_run(variant: str, steps: int, bridge_file: str) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(gemma_folder(), dtype=torch.float32)
    model.train()
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (GEMMA_BATCH, PROMPT + COMPLETION), generator=g)
    targets = ids[:, PROMPT:]
    loss = None
    if variant != "CE-only":
        loss = make_loss(bridge_file)
        refs = references(GEMMA_BATCH)
        loss.encode_references(refs)

    def step() -> None:
        hidden = model.model(input_ids=ids).last_hidden_state
        completion = hidden[:, PROMPT - 1 : -1]  # the positions that predict the completion
        if loss is None:
            logits = head(completion)
            value = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        else:
            out = loss(
                hidden_states=completion,
                output_embeddings=head,
                references=refs,
                target_ids=targets,
            )
            value = out.cross_entropy + out.loss
        value.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: AdamW's state
    gc.collect()
    times = []
    with harness.MemoryMeter() as meter:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return {
        "step_s": times,
        "rss_before_mb": meter.rss_before / MB,
        "peak_rss_mb": meter.peak_rss / MB,
    }


# ----------------------------------------------------------------------------- parent
def compare(kind: str, variants, batch: int, length: int, repeats: int, bridge_file: str) -> dict:
    """Workers side by side, alternating: a memory pass each, then ``repeats`` more rounds (the
    memory pass does the same work, only the RSS is read around it: it counts as a round)."""
    with contextlib.ExitStack() as stack:
        workers = {
            v: stack.enter_context(harness.Worker(PassSession, kind, v, batch, length, bridge_file))
            for v in variants
        }
        for worker in workers.values():  # all loaded before anything is measured
            worker.ready()
        timer = harness.AlternatingTimer(1 + repeats, f"{kind} {batch}x{length}")
        series = timer.run({v: (lambda w=w: w.call("run_pass")) for v, w in workers.items()})
    rows = {}
    for variant, passes in series.items():
        first = passes.values[0]
        harness.log(f"{kind} {batch}x{length} {variant}: memory pass {first}")
        times = [p["s"] for p in passes.values]
        rows[variant] = {**first, "times": times, "median_s": statistics.median(times)}
    return rows


def gemma_compare(runs: int, steps: int, bridge_file: str) -> dict:
    """One fresh process per run, alternating the variants ``runs`` times."""
    timer = harness.AlternatingTimer(runs, "gemma")
    series = timer.run(
        {
            v: (lambda v=v: harness.run_isolated(gemma_run, v, steps, bridge_file))
            for v in GEMMA_VARIANTS
        }
    )
    return {
        variant: {
            "median_step_s": statistics.median(t for r in runs_ for t in r["step_s"]),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs_),
            "rss_before_mb": max(r["rss_before_mb"] for r in runs_),
            "runs": runs_,
        }
        for variant, runs_ in ((v, series[v].values) for v in GEMMA_VARIANTS)
    }


def goals(results: dict) -> tuple[list[dict], list[str]]:
    """The goal rows for the sizes measured, and notes for the diagnosis (no goal)."""
    rows, notes = [], []
    term = results["term"].get("8x128")
    if term and "dense" in term:
        fused, dense = term["fused"], term["dense"]
        memory = fused["extra_peak_mb"] / dense["extra_peak_mb"]
        rows.append(FUSED_MEMORY.row(memory, size="8x128"))
        rows.append(FUSED_TIME.row(fused["median_s"] / dense["median_s"], size="8x128"))
        grad_mb = HEAD_GRAD_BYTES / MB
        ratio = (fused["extra_peak_mb"] - grad_mb) / (dense["extra_peak_mb"] - grad_mb)
        notes.append(
            f"- the same memory ratio without the LM head's gradient (V x d x 4 bytes = "
            f"{grad_mb:.0f} MB, allocated by both variants and by any step that trains the "
            f"head): {ratio:.2f}x (not the goal's figure; for the diagnosis)"
        )
        if "dense+CE" in term:
            fused, dense = term["fused+CE"], term["dense+CE"]
            memory = fused["extra_peak_mb"] / dense["extra_peak_mb"]
            speed = fused["median_s"] / dense["median_s"]
            notes.append(
                f"- with the CE in the same pass at 8x128: memory {memory:.2f}x, time {speed:.2f}x"
            )
    gemma = results.get("gemma")
    if gemma:
        base, fused = gemma["CE-only"], gemma["CE+BERTScore fused"]
        rows.append(GEMMA_TIME.row(fused["median_step_s"] / base["median_step_s"], size="4x168"))
        rows.append(GEMMA_MEMORY.row(fused["peak_rss_mb"] / base["peak_rss_mb"], size="4x168"))
    for size, step in results["step"].items():
        dense, topk = step["dense step"], step[f"top-k={TOP_K} fused"]
        rows.append(TOPK_SPEEDUP.row(dense["median_s"] / topk["median_s"], size=size))
        memory = dense["extra_peak_mb"] / max(topk["extra_peak_mb"], 1)
        notes.append(
            f"- top-k={TOP_K} fused vs the dense expected-embedding step at {size}: "
            f"{memory:.1f}x less extra peak memory"
        )
    return rows, notes


def report(results: dict) -> str:
    env = results.get("env") or harness.environment()  # older JSON files have none
    term_rows = [
        (size, variant, f"{row['median_s']:.2f}", len(row["times"]), f"{row['extra_peak_mb']:.0f}")
        for size, rows in results["term"].items()
        for variant, row in rows.items()
    ]
    term_rows += [
        (size, "dense, dense+CE", "skipped", "", "(logits > --dense-max-rows)")
        for size in results.get("skipped", [])
    ]
    step_rows = [
        (size, variant, f"{row['median_s']:.2f}", f"{row['extra_peak_mb']:.0f}")
        for size, rows in results["step"].items()
        for variant, row in rows.items()
    ]
    gemma_rows = [
        (
            variant,
            f"{r['median_step_s']:.2f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['rss_before_mb']:.0f}",
        )
        for variant, r in results.get("gemma", {}).items()
    ]
    goal_rows, notes = goals(results)
    goal_table = [
        (r["goal"], r["size"], f"{r['ratio']:.2f}x", r["target"] + "x", r["result"])
        for r in goal_rows
    ]
    lines = [
        "# Fused LM-head path vs dense logits (Gemma 3 270M head, V = 262,144)",
        "",
        *harness.header_lines(env),
        f"- bridge: Gemma's tokenizer -> all-MiniLM-L6-v2, fidelity {results['bridge_fidelity']}",
        f"- total wall time {results['wall_s'] / 60:.1f} min; load average (1, 5, 15 "
        f"min) at the start {results['load'][0]}, at the end {results['load'][1]} (the "
        "machine is shared)",
        "",
        "## BERTScore term (forward + backward into h and W)",
        "",
        harness.markdown_table(
            ["B x L", "variant", "median s", "passes", "extra peak RSS MB"],
            term_rows,
            "llrrr",
        ),
        "",
        "## Expected-embedding step (no scorer)",
        "",
        harness.markdown_table(
            ["B x L", "variant", "median s", "extra peak RSS MB"], step_rows, "llrr"
        ),
        "",
        "## Gemma 3 270M training step (fp32, AdamW, B=4, 168 tokens, 40 completion)",
        "",
        harness.markdown_table(
            ["variant", "median step s", "peak RSS MB", "RSS before steps MB"],
            gemma_rows,
            "lrrr",
        ),
        "",
        "## Goals (ratios from this run)",
        "",
        harness.markdown_table(["goal", "B x L", "ratio", "target", "result"], goal_table, "llrll"),
        "",
        *notes,
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--sizes", nargs="*", default=["4x40", "8x128", "16x256"])
    parser.add_argument("--repeats", nargs="+", type=int, default=[2, 1, 0])
    parser.add_argument("--step-sizes", nargs="*", default=["8x128"])
    parser.add_argument("--dense-max-rows", type=int, default=1024)
    parser.add_argument("--gemma-runs", type=int, default=2)
    parser.add_argument("--gemma-steps", type=int, default=1)
    parser.add_argument(
        "--from-json", nargs="+", metavar="FILE", help="rewrite the report from saved JSON files"
    )
    args = parser.parse_args()
    if args.from_json:
        results: dict = {}
        for name in args.from_json:  # later files add their sections (e.g. a re-run's gemma)
            for key, value in json.loads(Path(name).read_text(encoding="utf-8")).items():
                if key in ("term", "step") and key in results:
                    results[key].update(value)
                else:
                    results[key] = value
        harness.write_outputs(report(results), args.out, None, None)
        return
    start = time.perf_counter()
    env = harness.environment()
    path, fidelity = bridge_path()
    results: dict = {"term": {}, "step": {}, "skipped": [], "bridge_fidelity": fidelity}
    repeats_of = dict(zip(args.sizes, args.repeats + [0] * len(args.sizes), strict=False))
    for size, repeats in repeats_of.items():
        batch, length = map(int, size.split("x"))
        dense = batch * length <= args.dense_max_rows
        if not dense:
            results["skipped"].append(size)
        rows = {}
        for pair in (("dense", "fused"), ("dense+CE", "fused+CE")):
            variants = pair if dense else pair[1:]
            rows.update(compare("term", variants, batch, length, repeats, str(path)))
        results["term"][size] = rows
    for size in args.step_sizes:
        batch, length = map(int, size.split("x"))
        results["step"][size] = compare("step", STEP_VARIANTS, batch, length, 1, str(path))
    if args.gemma_runs:
        results["gemma"] = gemma_compare(args.gemma_runs, args.gemma_steps, str(path))
    results["wall_s"] = time.perf_counter() - start
    results["load"] = [env["load_average"], harness.load_average()]
    results["env"] = env
    harness.write_outputs(report(results), args.out, args.json, results)


if __name__ == "__main__":
    main()
