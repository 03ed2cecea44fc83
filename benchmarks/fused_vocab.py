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
Every variant runs in its own worker process (this script with ``--worker``). Memory: the
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

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _env import command_line, cpu_model  # noqa: E402
from _memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss  # noqa: E402

MB = 1e6
TOP_K = 32
HEAD_GRAD_BYTES = 262_144 * 640 * 4
PROMPT, COMPLETION, GEMMA_BATCH = 128, 40, 4
RESULT = "@@RESULT "
TERM_VARIANTS = ("dense", "fused", "dense+CE", "fused+CE")
STEP_VARIANTS = ("dense step", "top-k=32 fused")
GEMMA_VARIANTS = ("CE-only", "CE+BERTScore fused")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- shared pieces
def gemma_folder() -> Path:
    from bsloss.pretrained import pretrained_folder

    return pretrained_folder("gemma-3-270m")


def bridge_path() -> tuple[Path, dict]:
    """The Gemma -> MiniLM bridge (built once, a few minutes, then cached) and its fidelity."""
    from bsloss import VocabularyBridge
    from bsloss.pretrained import cache_root

    path = cache_root() / "bridges" / "gemma-3-270m__all-MiniLM-L6-v2.safetensors"
    if not path.exists():
        from transformers import AutoTokenizer

        from bsloss.scorer.encoder import ScorerEncoder

        tokenizer = AutoTokenizer.from_pretrained(gemma_folder())
        encoder = ScorerEncoder.from_pretrained(None, None, "cpu")
        start = time.perf_counter()
        VocabularyBridge.build(tokenizer, encoder).save(path)
        log(f"bridge built in {time.perf_counter() - start:.0f} s")
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
    from _data import load_stsb_dev

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


def serve(kind: str, variant: str, batch: int, length: int, bridge_file: str) -> None:
    """Answer 'pass' commands on stdin with JSON (time, RSS before, peak)."""
    torch.manual_seed(0)
    weight = load_head().requires_grad_()
    loss = make_loss(bridge_file)
    table = loss._generator_table()
    refs = references(batch)
    loss.encode_references(refs)
    g = torch.Generator().manual_seed(0)

    def inputs(rows: int):
        h = torch.randn(batch, rows, weight.shape[1], generator=g).requires_grad_()
        targets = torch.randint(0, weight.shape[0], (batch, rows), generator=g)
        grad = torch.randn(batch, rows, table.shape[1], generator=g)
        return h, targets, grad

    def run(h, targets, grad):
        if kind == "term":
            term_pass(variant, loss, weight, h, targets, refs)
        else:
            step_pass(variant, table, weight, h, grad)

    run(*inputs(8))  # warm-up: allocator, kernels, the scorer's buckets
    h, targets, grad = inputs(length)
    print(RESULT + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        h.grad = weight.grad = None
        gc.collect()
        before = current_rss_bytes()
        reset = reset_peak_rss()
        start = time.perf_counter()
        run(h, targets, grad)
        seconds = time.perf_counter() - start
        peak = peak_rss_bytes(reset)
        answer = {"s": seconds, "rss_before_mb": before / MB, "extra_peak_mb": (peak - before) / MB}
        print(RESULT + json.dumps(answer), flush=True)


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
    before = current_rss_bytes()
    reset = reset_peak_rss()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "step_s": times,
        "rss_before_mb": before / MB,
        "peak_rss_mb": peak_rss_bytes(reset) / MB,
    }


# ----------------------------------------------------------------------------- parent
class Worker:
    def __init__(self, kind: str, variant: str, batch: int, length: int, bridge_file: str):
        self.variant = variant
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            kind,
            "--variant",
            variant,
            "--batch",
            str(batch),
            "--length",
            str(length),
            "--bridge-file",
            bridge_file,
        ]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.read()

    def read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT) :])
        raise RuntimeError(f"worker {self.variant} ended (exit {self.process.wait()})")

    def one(self) -> dict:
        self.process.stdin.write("pass\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
        except OSError:
            pass
        self.process.wait()


def compare(kind: str, variants, batch: int, length: int, repeats: int, bridge_file: str) -> dict:
    """Workers side by side: a memory pass each, then ``repeats`` alternating timed passes."""
    workers = [Worker(kind, v, batch, length, bridge_file) for v in variants]
    try:
        rows = {}
        for worker in workers:
            first = worker.one()
            rows[worker.variant] = {**first, "times": []}
            log(f"{kind} {batch}x{length} {worker.variant}: memory pass {first}")
        for _ in range(repeats):
            for worker in workers:
                rows[worker.variant]["times"].append(worker.one()["s"])
        for row in rows.values():
            # the memory pass does the same work (only the RSS is read around it): it counts
            row["times"].insert(0, row["s"])
            row["median_s"] = statistics.median(row["times"])
        return rows
    finally:
        for worker in workers:
            worker.close()


def gemma_compare(runs: int, steps: int, bridge_file: str) -> dict:
    rows = {v: [] for v in GEMMA_VARIANTS}
    for _ in range(runs):
        for variant in GEMMA_VARIANTS:
            done = subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--worker",
                    "gemma",
                    "--variant",
                    variant,
                    "--steps",
                    str(steps),
                    "--bridge-file",
                    bridge_file,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            result = json.loads(done.stdout.strip().splitlines()[-1][len(RESULT) :])
            rows[variant].append(result)
            log(f"gemma {variant}: {result}")
    return {
        variant: {
            "median_step_s": statistics.median(t for r in results for t in r["step_s"]),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "rss_before_mb": max(r["rss_before_mb"] for r in results),
            "runs": results,
        }
        for variant, results in rows.items()
    }


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(results: dict, args) -> str:
    lines = [
        "# Fused LM-head path vs dense logits (Gemma 3 270M head, V = 262,144)",
        "",
        f"- command: `{command_line()}`",
        f"- CPU: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- bridge: Gemma's tokenizer -> all-MiniLM-L6-v2, fidelity {results['bridge_fidelity']}",
        f"- total wall time {results['wall_s'] / 60:.1f} min; load average (1, 5, 15 min) at the "
        f"start {results['load'][0]}, at the end {results['load'][1]} (the machine is shared)",
        "",
        "## BERTScore term (forward + backward into h and W)",
        "",
        "| B x L | variant | median s | passes | extra peak RSS MB |",
        "|---|---|---:|---:|---:|",
    ]
    for size, rows in results["term"].items():
        for variant, row in rows.items():
            lines.append(
                f"| {size} | {variant} | {row['median_s']:.2f} | {len(row['times'])} | "
                f"{row['extra_peak_mb']:.0f} |"
            )
    for size in results.get("skipped", []):
        lines.append(f"| {size} | dense, dense+CE | skipped | | (logits > --dense-max-rows) |")
    lines += ["", "## Expected-embedding step (no scorer)", ""]
    lines += ["| B x L | variant | median s | extra peak RSS MB |", "|---|---|---:|---:|"]
    for size, rows in results["step"].items():
        for variant, row in rows.items():
            lines.append(
                f"| {size} | {variant} | {row['median_s']:.2f} | {row['extra_peak_mb']:.0f} |"
            )
    lines += ["", "## Gemma 3 270M training step (fp32, AdamW, B=4, 168 tokens, 40 completion)", ""]
    lines += [
        "| variant | median step s | peak RSS MB | RSS before steps MB |",
        "|---|---:|---:|---:|",
    ]
    for variant, row in results.get("gemma", {}).items():
        lines.append(
            f"| {variant} | {row['median_step_s']:.2f} | {row['peak_rss_mb']:.0f} | "
            f"{row['rss_before_mb']:.0f} |"
        )
    lines += ["", "## Goals (ratios from this run)", ""]
    term = results["term"].get("8x128")
    if term and "dense" in term:
        memory = term["fused"]["extra_peak_mb"] / term["dense"]["extra_peak_mb"]
        speed = term["fused"]["median_s"] / term["dense"]["median_s"]
        lines.append(
            f"- fused BERTScore term at 8x128, extra peak memory fused/dense: {memory:.2f}x "
            f"(goal <= 0.25x: {verdict(memory <= 0.25)}); time fused/dense: {speed:.2f}x "
            f"(goal <= 1.2x: {verdict(speed <= 1.2)})"
        )
        grad_mb = HEAD_GRAD_BYTES / MB
        fused_mb = term["fused"]["extra_peak_mb"] - grad_mb
        dense_mb = term["dense"]["extra_peak_mb"] - grad_mb
        lines.append(
            f"- the same memory ratio without the LM head's gradient (V x d x 4 bytes = "
            f"{grad_mb:.0f} MB, allocated by both variants and by any step that trains the "
            f"head): {fused_mb / dense_mb:.2f}x (not the goal's figure; for the diagnosis)"
        )
        if "dense+CE" in term:
            memory = term["fused+CE"]["extra_peak_mb"] / term["dense+CE"]["extra_peak_mb"]
            speed = term["fused+CE"]["median_s"] / term["dense+CE"]["median_s"]
            lines.append(
                f"- with the CE in the same pass at 8x128: memory {memory:.2f}x, time {speed:.2f}x"
            )
    gemma = results.get("gemma")
    if gemma:
        base, fused = gemma["CE-only"], gemma["CE+BERTScore fused"]
        speed = fused["median_step_s"] / base["median_step_s"]
        memory = fused["peak_rss_mb"] / base["peak_rss_mb"]
        lines.append(
            f"- Gemma step CE+BERTScore (fused) / CE-only: time {speed:.2f}x (goal <= 1.3x: "
            f"{verdict(speed <= 1.3)}), peak RSS {memory:.2f}x (goal <= 1.1x: "
            f"{verdict(memory <= 1.1)})"
        )
    for size, rows in results["step"].items():
        speed = rows["dense step"]["median_s"] / rows[f"top-k={TOP_K} fused"]["median_s"]
        memory = rows["dense step"]["extra_peak_mb"] / max(
            rows[f"top-k={TOP_K} fused"]["extra_peak_mb"], 1
        )
        lines.append(
            f"- top-k={TOP_K} fused vs the dense expected-embedding step at {size}: "
            f"{speed:.1f}x faster (goal >= 10x: {verdict(speed >= 10)}), {memory:.1f}x less "
            "extra peak memory"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=["4x40", "8x128", "16x256"])
    parser.add_argument("--repeats", nargs="+", type=int, default=[2, 1, 0])
    parser.add_argument("--step-sizes", nargs="*", default=["8x128"])
    parser.add_argument("--dense-max-rows", type=int, default=1024)
    parser.add_argument("--gemma-runs", type=int, default=2)
    parser.add_argument("--gemma-steps", type=int, default=1)
    parser.add_argument("--out", metavar="MD")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument(
        "--from-json", nargs="+", metavar="FILE", help="rewrite the report from saved JSON files"
    )
    parser.add_argument("--worker", choices=["term", "step", "gemma"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--bridge-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "gemma":
        print(RESULT + json.dumps(gemma_run(args.variant, args.steps, args.bridge_file)))
        return
    if args.worker:
        serve(args.worker, args.variant, args.batch, args.length, args.bridge_file)
        return
    if args.from_json:
        results: dict = {}
        for name in args.from_json:  # later files add their sections (e.g. a re-run's gemma)
            for key, value in json.loads(Path(name).read_text(encoding="utf-8")).items():
                if key in ("term", "step") and key in results:
                    results[key].update(value)
                else:
                    results[key] = value
        text = report(results, args)
        print(text)
        if args.out:
            Path(args.out).write_text(text, encoding="utf-8")
        return
    start = time.perf_counter()
    load_before = os.getloadavg()
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
    results["load"] = [load_before, os.getloadavg()]
    text = report(results, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
