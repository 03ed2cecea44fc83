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

import inspect
import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

if not __package__:  # run as `python benchmarks/throughput.py`
    import _path  # noqa: F401

import torch

import bsloss
from benchmarks import harness
from benchmarks._data import load_stsb_dev, load_xsum
from bsloss.scorer.default import embedded_model_path

NUM_LAYERS = 6
BATCH_SIZE = 64
DIFF_THRESHOLD = 1e-4
WARMUP_PAIRS = 16
QUICK = {"repeats": 1, "stsb_pairs": 200, "xsum_pairs": 20}
DEFAULTS = {"repeats": 5, "stsb_pairs": None, "xsum_pairs": 200}
GOALS = {  # system key -> throughput vs bert_score, on every dataset
    "bsloss": harness.Goal("bsloss exact vs bert_score throughput", 1.2, ">="),
    "bsloss_fast": harness.Goal("bsloss fast (bf16) vs bert_score throughput", 2.5, ">="),
}


def fast_mode_available() -> bool:
    return "autocast_dtype" in inspect.signature(bsloss.BERTScorer.__init__).parameters


# ----------------------------------------------------------------------------- timing
@dataclass
class System:
    key: str
    label: str
    run: Callable[[list[str], list[str]], torch.Tensor]  # returns F1


def benchmark(
    systems: Sequence[System], name: str, cands: list[str], refs: list[str], repeats: int
) -> tuple[dict[str, float], dict[str, harness.Series]]:
    """One untimed warm-up call of each system (on the first ``WARMUP_PAIRS`` pairs; its
    seconds are returned), then ``repeats`` alternating timed rounds over all pairs."""
    timer = harness.AlternatingTimer(repeats, f"  [{name}]")
    warmup_s = {}
    for system in systems:
        harness.log(f"  [{name}] warm-up {system.label} ...")
        warmup_s[system.key], _ = timer.time(
            lambda s=system: s.run(cands[:WARMUP_PAIRS], refs[:WARMUP_PAIRS])
        )
    series = timer.run({s.key: (lambda s=s: s.run(cands, refs)) for s in systems})
    return warmup_s, series


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
def goals(results: dict) -> list[dict]:
    return [
        GOALS[system["key"]].row(system["vs_bert_score"], dataset=name, system=system["label"])
        for name, data in results["datasets"].items()
        for system in data["systems"]
        if system["key"] in GOALS
    ]


def render(meta: dict, results: dict) -> str:
    lines = ["# bsloss vs bert_score throughput", ""]
    threads = "set by --threads" if meta["threads_arg"] else "torch default"
    lines += harness.header_lines(meta["env"], threads)
    lines += [
        f"- device: {meta['device']}",
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

    rows = []
    for name, data in results["datasets"].items():
        tokens = (
            f"{data['cand_tokens']['mean_tokens']:.0f} · {data['ref_tokens']['mean_tokens']:.0f}"
        )
        if data["ref_tokens"]["truncated"]:
            tokens += f" ({data['ref_tokens']['truncated']} refs truncated)"
        for system in data["systems"]:
            low, high = system["per_round_vs_bert_score"]
            rows.append(
                (
                    name,
                    data["pairs"],
                    tokens,
                    system["label"],
                    f"{system['warmup_s']:.1f}",
                    f"{system['median_s']:.3f}",
                    f"{system['pairs_per_s']:.1f}",
                    f"{system['vs_bert_score']:.2f}×",
                    f"{low:.2f}–{high:.2f}",
                )
            )
    header = ["dataset", "pairs", "tokens/text (cand · ref)", "system", "warm-up s", "median s"]
    header += ["pairs/s", "vs bert_score", "per-round range"]
    lines += ["## Throughput", "", harness.markdown_table(header, rows, "lrllrrrrr"), ""]
    lines.append(
        "`vs bert_score` = pairs/s of the system ÷ pairs/s of bert_score "
        "(> 1: faster than bert_score), from the median times; per-round range: the smallest "
        "and largest ratio of the times within one alternating round. warm-up s: the untimed "
        f"first call on {WARMUP_PAIRS} pairs (it includes compilation for `compile=True`)."
    )
    lines.append("")

    agree = results["agreement"]
    rows = [
        (row["label"], f"{row['max_abs_diff']:.2e}", row["over_threshold"]) for row in agree["rows"]
    ]
    lines += [
        f"## Agreement on STS-B ({agree['pairs']} pairs, F1, not timed)",
        "",
        harness.markdown_table(
            ["comparison", "max abs diff", "pairs with abs diff > 1e-4"], rows, "lrr"
        ),
        "",
    ]
    if "fast" in agree:
        fast = agree["fast"]
        rows = [
            ("max abs diff F", f"{fast['max_abs_diff']:.2e}"),
            ("Pearson(F_fast, F_exact)", f"{fast['pearson']:.6f}"),
        ]
        lines += [harness.markdown_table(["fast mode vs exact", "value"], rows, "lr"), ""]
    if results["goals"]:
        rows = [
            (r["goal"], r["dataset"], f"{r['ratio']:.2f}×", r["target"] + "×", r["result"])
            for r in results["goals"]
        ]
        header = ["goal", "dataset", "measured", "target", "result"]
        lines += ["## Goals", "", harness.markdown_table(header, rows, "llrll"), ""]
    return "\n".join(lines)


def _agreement(label: str, ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    diff = (ours.double() - theirs.double()).abs()
    return {
        "label": label,
        "max_abs_diff": diff.max().item(),
        "over_threshold": int((diff > DIFF_THRESHOLD).sum().item()),
    }


# ----------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None):
    parser = harness.argument_parser(__doc__)
    repeats = "timed repetitions per dataset (default 5; 1 with --quick)"
    parser.add_argument("--repeats", type=int, help=repeats)
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
        harness.log(fast_note)
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
    bert_score_version = harness.package_version("bert-score")
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
        "env": harness.environment(bert_score=bert_score_version),
        "threads_arg": args.threads,
        "device": str(torch.device(device))
        + (f" ({torch.cuda.get_device_name()})" if cuda else ""),
        "model": f"all-MiniLM-L6-v2 (embedded, {model_path})",
        "repeats": args.repeats,
        "mode": args.mode,
        "fast_note": fast_note,
    }

    results: dict = {"datasets": {}}
    first_f: dict[str, dict[str, torch.Tensor]] = {}  # dataset -> system key -> F1, round 1
    for name, (cands, refs) in datasets.items():
        harness.log(f"{name}: {len(cands)} pairs")
        cand_tokens = token_stats(ours, cands)
        ref_tokens = token_stats(ours, refs)
        with warnings.catch_warnings():
            # both scorers truncate the long XSum articles; bsloss warns on every call
            warnings.filterwarnings("ignore", message=r".*were truncated")
            warmup_s, series = benchmark(systems, name, cands, refs, args.repeats)
        first_f[name] = {key: run.values[0] for key, run in series.items()}
        rate = {s.key: len(cands) / series[s.key].median() for s in systems}
        anchor = series["bert_score"].seconds
        results["datasets"][name] = {
            "pairs": len(cands),
            "cand_tokens": cand_tokens,
            "ref_tokens": ref_tokens,
            "systems": [
                {
                    "key": s.key,
                    "label": s.label,
                    "times_s": series[s.key].seconds,
                    "warmup_s": warmup_s[s.key],
                    "per_round_vs_bert_score": harness.ratio_range(anchor, series[s.key].seconds),
                    "median_s": series[s.key].median(),
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
    harness.log("agreement: bert_score at batch_size=1 (untimed) ...")
    f_theirs_1 = theirs.score(stsb_cands, stsb_refs, batch_size=1)[2]
    f_exact = (
        first_f["STS-B dev"]["bsloss"]
        if want_exact
        else ours.score(stsb_cands, stsb_refs, progress=False)[2]
    )
    f_theirs_64 = first_f["STS-B dev"]["bert_score"]
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
    if "bsloss_fast" in first_f["STS-B dev"]:
        f_fast = first_f["STS-B dev"]["bsloss_fast"].double().cpu()
        pearson = torch.corrcoef(torch.stack([f_fast, f_exact.double().cpu()]))[0, 1].item()
        agreement["fast"] = {
            "max_abs_diff": (f_fast - f_exact.double()).abs().max().item(),
            "pearson": pearson,
        }
        agreement["rows"].append(_agreement("bsloss fast vs bsloss exact", f_fast, f_exact))
    results["agreement"] = agreement

    results["goals"] = goals(results)
    harness.write_outputs(render(meta, results), args.out, args.json, {"meta": meta, **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
