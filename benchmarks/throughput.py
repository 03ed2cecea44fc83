"""Throughput of bsloss.BERTScorer against the reference bert_score.BERTScorer (0.3.13).

Method
------
Both scorers use the same model (the embedded all-MiniLM-L6-v2, layer 6, no idf, no rescaling),
the same device and the same pairs, in one process. Each scorer is built once (model loading is
not timed). For each dataset:

* STS-B dev: 1,500 short sentence pairs (candidate = sentence1, reference = sentence2);
* XSum test: the first ``--xsum-pairs`` (default 200) pairs of candidate = one-sentence summary,
  reference = the whole BBC article (long inputs, truncated at 512 tokens by both scorers);

each scorer gets one untimed warm-up call (on the first 16 pairs), then ``--repeats`` (default
5) repetitions in which the scorers run alternately (A B A B ...), so that load from other
processes sharing the CPU falls on both alike. Each call scores the whole dataset and is timed
with ``time.perf_counter``; the report gives the median seconds per call, pairs/second
(pairs / median) and the ratio of bsloss's throughput to bert_score's (> 1: bsloss is faster).

bert_score runs at its default ``batch_size=64`` (passed explicitly to ``score()``, whose own
``batch_size`` argument overrides the constructor's) with its default slow tokenizer, the way
users run it; bsloss runs at ``batch_size=64``.

Agreement (STS-B only, from the F1 of the first timed round; bert_score at ``batch_size=1`` is
run once more, untimed): the F1 of bsloss against bert_score at ``batch_size=1``, where
bert_score has no padding artifact (the numbers should be identical to float precision), and
against bert_score at ``batch_size=64`` (bert_score's padded batches shift some scores slightly;
the report counts the pairs that differ by more than 1e-4).

``--mode fast`` / ``both`` adds bsloss's fast mode (``autocast_dtype=torch.bfloat16``) when the
installed bsloss.BERTScorer accepts that argument; it also reports max |F_fast - F_exact| and
Pearson(F_fast, F_exact) on STS-B. ``--compile`` adds fast mode with ``compile=True``
(torch.compile with weight freezing); its warm-up call compiles, and the report gives each
system's warm-up seconds. Besides the ratio of medians, the report gives the range of the
per-round ratios (the two systems' times within one alternating round), a measure of how much
the load on a shared machine moved the ratio.

Reproduce (from the repository root; the data folder is ``../shared/data`` or
``$BSLOSS_DATA_DIR``)::

    HF_HUB_OFFLINE=1 python benchmarks/throughput.py --repeats 3 \\
        --out /tmp/throughput_exact.md --json /tmp/throughput_exact.json

``--quick`` (1 repeat, 200 STS-B pairs, 20 XSum pairs) is a smoke test that runs in well under a
minute on a CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from importlib.metadata import PackageNotFoundError, version  # noqa: E402

import torch  # noqa: E402
from _data import load_stsb_dev, load_xsum  # noqa: E402
from _env import command_line, cpu_model  # noqa: E402

import bsloss  # noqa: E402
from bsloss.scorer.default import embedded_model_path  # noqa: E402

NUM_LAYERS = 6
BATCH_SIZE = 64
DIFF_THRESHOLD = 1e-4
WARMUP_PAIRS = 16
QUICK = {"repeats": 1, "stsb_pairs": 200, "xsum_pairs": 20}
DEFAULTS = {"repeats": 5, "stsb_pairs": None, "xsum_pairs": 200}


# ----------------------------------------------------------------------------- environment
def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def fast_mode_available() -> bool:
    return "autocast_dtype" in inspect.signature(bsloss.BERTScorer.__init__).parameters


# ----------------------------------------------------------------------------- timing
@dataclass
class System:
    key: str
    label: str
    run: Callable[[list[str], list[str]], torch.Tensor]  # returns F1
    times: dict[str, list[float]] = field(default_factory=dict)
    warmup_s: dict[str, float] = field(default_factory=dict)
    first_f: dict[str, torch.Tensor] = field(default_factory=dict)


def _timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    gc.collect()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def benchmark(
    systems: Sequence[System], name: str, cands: list[str], refs: list[str], repeats: int
) -> None:
    """One untimed warm-up call of each system (on the first ``WARMUP_PAIRS`` pairs), then
    ``repeats`` alternating timed rounds over all pairs. The F1 of the first round is kept."""
    for system in systems:
        print(f"  [{name}] warm-up {system.label} ...", file=sys.stderr, flush=True)
        system.warmup_s[name], _ = _timed(
            lambda s=system: s.run(cands[:WARMUP_PAIRS], refs[:WARMUP_PAIRS])
        )
        system.times[name] = []
    for r in range(repeats):
        for system in systems:
            seconds, f1 = _timed(lambda s=system: s.run(cands, refs))
            system.times[name].append(seconds)
            system.first_f.setdefault(name, f1)
            print(
                f"  [{name}] repeat {r + 1}/{repeats} {system.label}: {seconds:.3f} s",
                file=sys.stderr,
                flush=True,
            )


def token_stats(scorer: bsloss.BERTScorer, texts: list[str]) -> dict[str, float]:
    """Mean token count (with special tokens, before truncation) and number truncated."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = scorer.encoder.tokenizer(
            [t.strip() for t in texts], add_special_tokens=True, truncation=False, verbose=False
        )["input_ids"]
    lengths = [len(row) for row in ids]
    limit = scorer.encoder.max_length
    return {
        "mean_tokens": statistics.fmean(lengths),
        "max_tokens": max(lengths),
        "truncated": sum(n > limit for n in lengths),
    }


# ----------------------------------------------------------------------------- report
def _fmt_ratio(x: float) -> str:
    return f"{x:.2f}×"


def render(meta: dict, results: dict) -> str:
    lines = ["# bsloss vs bert_score throughput", ""]
    lines += [
        f"- command: `{meta['command']}`",
        f"- date (UTC): {meta['date']}",
        f"- CPU: {meta['cpu']} ({meta['logical_cpus']} logical CPUs); "
        f"torch threads: {meta['torch_threads']}"
        + (" (set by --threads)" if meta["threads_arg"] else " (torch default)"),
        f"- device: {meta['device']}",
        f"- versions: python {meta['python']}, torch {meta['torch']}, transformers "
        f"{meta['transformers']}, bert_score {meta['bert_score']}, bsloss {meta['bsloss']}",
        f"- model: {meta['model']} (layer {NUM_LAYERS}), no idf, no rescaling; "
        f"batch_size {BATCH_SIZE} for both",
        f"- method: model load not timed; one untimed warm-up call each "
        f"({WARMUP_PAIRS} pairs), then "
        f"{meta['repeats']} alternating repetition(s); median of perf_counter seconds per "
        "call over the whole dataset",
        "",
    ]
    if meta.get("fast_note"):
        lines += [f"- note: {meta['fast_note']}", ""]

    lines += [
        "## Throughput",
        "",
        "| dataset | pairs | tokens/text (cand · ref) | system | warm-up s | median s | pairs/s "
        "| vs bert_score | per-round range |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, data in results["datasets"].items():
        tokens = (
            f"{data['cand_tokens']['mean_tokens']:.0f} · {data['ref_tokens']['mean_tokens']:.0f}"
        )
        if data["ref_tokens"]["truncated"]:
            tokens += f" ({data['ref_tokens']['truncated']} refs truncated)"
        for system in data["systems"]:
            low, high = system["per_round_vs_bert_score"]
            lines.append(
                f"| {name} | {data['pairs']} | {tokens} | {system['label']} "
                f"| {system['warmup_s']:.1f} | {system['median_s']:.3f} "
                f"| {system['pairs_per_s']:.1f} | {_fmt_ratio(system['vs_bert_score'])} "
                f"| {low:.2f}–{high:.2f} |"
            )
    lines.append("")
    lines.append(
        "`vs bert_score` = pairs/s of the system ÷ pairs/s of bert_score "
        "(> 1: faster than bert_score), from the median times; per-round range: the smallest "
        "and largest ratio of the times within one alternating round. warm-up s: the untimed "
        f"first call on {WARMUP_PAIRS} pairs (it includes compilation for `compile=True`)."
    )
    lines.append("")

    agree = results["agreement"]
    lines += [
        f"## Agreement on STS-B ({agree['pairs']} pairs, F1, not timed)",
        "",
        "| comparison | max abs diff | pairs with abs diff > 1e-4 |",
        "|---|---:|---:|",
    ]
    for row in agree["rows"]:
        lines.append(f"| {row['label']} | {row['max_abs_diff']:.2e} | {row['over_threshold']} |")
    lines.append("")
    if "fast" in agree:
        fast = agree["fast"]
        lines += [
            "| fast mode vs exact | value |",
            "|---|---:|",
            f"| max abs diff F | {fast['max_abs_diff']:.2e} |",
            f"| Pearson(F_fast, F_exact) | {fast['pearson']:.6f} |",
            "",
        ]
    return "\n".join(lines)


def _round_ratio_range(system: System, anchor: System, name: str) -> tuple[float, float]:
    ratios = [a / t for a, t in zip(anchor.times[name], system.times[name], strict=True)]
    return min(ratios), max(ratios)


def _agreement(label: str, ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    diff = (ours.double() - theirs.double()).abs()
    return {
        "label": label,
        "max_abs_diff": diff.max().item(),
        "over_threshold": int((diff > DIFF_THRESHOLD).sum().item()),
    }


# ----------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repetitions per dataset (default 5; 1 with --quick)",
    )
    parser.add_argument(
        "--stsb-pairs",
        type=int,
        default=None,
        help="use only the first N STS-B dev pairs (default all 1,500)",
    )
    parser.add_argument(
        "--xsum-pairs",
        type=int,
        default=None,
        help="the first N XSum pairs (default 200; 20 with --quick)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) (default: leave torch's default)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="device for both scorers (default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--mode",
        choices=["exact", "fast", "both"],
        default="exact",
        help="bsloss modes to time: exact (default), fast (bf16 autocast, when available) or both",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time fast mode with compile=True (torch.compile; the warm-up compiles)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 1 repeat, 200 STS-B pairs, 20 XSum pairs"
    )
    parser.add_argument("--out", metavar="FILE.md", help="also write the markdown report here")
    parser.add_argument("--json", metavar="FILE", help="write machine-readable results here")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import bert_score
    import transformers

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"

    def sync(f: torch.Tensor) -> torch.Tensor:
        if cuda:
            torch.cuda.synchronize()
        return f

    want_exact = args.mode in ("exact", "both")
    want_fast = args.mode in ("fast", "both")
    fast_note = None
    if want_fast and not fast_mode_available():
        fast_note = (
            "fast mode is not available yet (bsloss.BERTScorer has no `autocast_dtype` "
            "parameter); skipped"
        )
        print(fast_note, file=sys.stderr)
        want_fast = False

    # Build the scorers once (not timed). Exact bsloss is always built: it is the reference for
    # the fast mode's agreement numbers even when only fast is timed.
    print("loading scorers ...", file=sys.stderr, flush=True)
    model_path = embedded_model_path()
    ours = bsloss.BERTScorer(num_layers=NUM_LAYERS, batch_size=BATCH_SIZE, device=device)
    theirs = bert_score.BERTScorer(
        model_type=model_path, num_layers=NUM_LAYERS, batch_size=BATCH_SIZE, device=device
    )

    def bsloss_system(key: str, mode: str, scorer: bsloss.BERTScorer) -> System:
        return System(
            key,
            f"bsloss {bsloss.__version__} {mode}",
            lambda c, r: sync(scorer.score(c, r, progress=False)[2]),
        )

    fast_variants = {"bsloss_fast": ("fast (bf16)", False)}
    if args.compile:
        fast_variants["bsloss_fast_compiled"] = ("fast (bf16) + compile", True)
    fast_systems = [
        bsloss_system(
            key,
            mode,
            bsloss.BERTScorer(
                num_layers=NUM_LAYERS,
                batch_size=BATCH_SIZE,
                device=device,
                autocast_dtype=torch.bfloat16,
                compile=compile_,
            ),
        )
        for key, (mode, compile_) in fast_variants.items()
        if want_fast
    ]

    systems: list[System] = []
    if want_exact:
        systems.append(bsloss_system("bsloss", "exact", ours))
    bert_score_version = _package_version("bert-score")
    systems.append(
        System(
            "bert_score",
            f"bert_score {bert_score_version}",
            lambda c, r: sync(theirs.score(c, r, batch_size=BATCH_SIZE)[2]),
        )
    )
    systems += fast_systems

    datasets = {
        "STS-B dev": load_stsb_dev(args.stsb_pairs),
        "XSum test": load_xsum(args.xsum_pairs),
    }
    meta = {
        "command": command_line(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "threads_arg": args.threads,
        "device": str(torch.device(device))
        + (f" ({torch.cuda.get_device_name()})" if cuda else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "bert_score": bert_score_version,
        "bsloss": bsloss.__version__,
        "model": f"all-MiniLM-L6-v2 (embedded, {model_path})",
        "repeats": args.repeats,
        "mode": args.mode,
        "fast_note": fast_note,
    }

    results: dict = {"datasets": {}}
    by_key = {s.key: s for s in systems}
    for name, (cands, refs) in datasets.items():
        print(f"{name}: {len(cands)} pairs", file=sys.stderr, flush=True)
        cand_tokens = token_stats(ours, cands)
        ref_tokens = token_stats(ours, refs)
        with warnings.catch_warnings():
            # both scorers truncate the long XSum articles; bsloss warns on every call
            warnings.filterwarnings("ignore", message=r".*were truncated")
            benchmark(systems, name, cands, refs, args.repeats)
        rate = {s.key: len(cands) / statistics.median(s.times[name]) for s in systems}
        results["datasets"][name] = {
            "pairs": len(cands),
            "cand_tokens": cand_tokens,
            "ref_tokens": ref_tokens,
            "systems": [
                {
                    "key": s.key,
                    "label": s.label,
                    "times_s": s.times[name],
                    "warmup_s": s.warmup_s[name],
                    "per_round_vs_bert_score": _round_ratio_range(s, by_key["bert_score"], name),
                    "median_s": statistics.median(s.times[name]),
                    "pairs_per_s": rate[s.key],
                    "vs_bert_score": rate[s.key] / rate["bert_score"],
                }
                for s in systems
            ],
        }
        if want_exact:
            results["datasets"][name]["ratio_bsloss_over_bert_score"] = (
                rate["bsloss"] / rate["bert_score"]
            )

    # Agreement on STS-B, not timed: reuse the first round's F1; run bert_score once at bs=1.
    stsb_cands, stsb_refs = datasets["STS-B dev"]
    print("agreement: bert_score at batch_size=1 (untimed) ...", file=sys.stderr, flush=True)
    f_theirs_1 = theirs.score(stsb_cands, stsb_refs, batch_size=1)[2]
    f_exact = (
        by_key["bsloss"].first_f["STS-B dev"]
        if want_exact
        else ours.score(stsb_cands, stsb_refs, progress=False)[2]
    )
    f_theirs_64 = by_key["bert_score"].first_f["STS-B dev"]
    agreement: dict = {
        "pairs": len(stsb_cands),
        "rows": [
            _agreement("bsloss exact vs bert_score batch_size=1", f_exact, f_theirs_1),
            _agreement(f"bsloss exact vs bert_score batch_size={BATCH_SIZE}", f_exact, f_theirs_64),
            _agreement(
                f"bert_score batch_size=1 vs batch_size={BATCH_SIZE}", f_theirs_1, f_theirs_64
            ),
        ],
    }
    if "bsloss_fast" in by_key:
        f_fast = by_key["bsloss_fast"].first_f["STS-B dev"].double().cpu()
        pearson = torch.corrcoef(torch.stack([f_fast, f_exact.double().cpu()]))[0, 1].item()
        agreement["fast"] = {
            "max_abs_diff": (f_fast - f_exact.double()).abs().max().item(),
            "pearson": pearson,
        }
        agreement["rows"].append(_agreement("bsloss fast vs bsloss exact", f_fast, f_exact))
    results["agreement"] = agreement

    report = render(meta, results)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(report + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"meta": meta, **results}, handle, indent=2)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
