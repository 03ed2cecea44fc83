"""What every recipe does around its trainer's training step (:class:`RecipeRun`): config,
accelerator, data, scorer, generator, collator, evaluator; the run's log, dev evaluations and
early stopping; the final model, test scores, results file and plot. The trainer's side
(arguments, checkpoints, resume) is :mod:`trainer_run`'s.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import shlex
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from causal import CausalCollator
from config import load_config
from evaluation import Evaluator
from examples import check_dev_split, load_splits
from generators import (
    freeze_embeddings,
    load_generator,
    load_saved_weights,
    save_generator,
    with_lora,
)
from seq2seq import Collator

from bsloss.integrations.candidates import position_limit


class RunLog:
    """Append-only JSONL log; on resume, entries after the checkpoint are dropped."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        if not self.enabled or not self.path.exists():
            return
        kept = [
            line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, **entry) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")

    def entries(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]


class EarlyStopping:
    """Patience on a dev metric: ``update(value, step)`` says whether ``value`` is the best so
    far (strictly; lower is better for ``dev_ce``, higher for ``dev_bertscore_f``) and counts
    the evaluations since the best; ``exhausted`` once ``patience`` of them did not improve."""

    def __init__(self, metric: str, patience: int | None):
        self.metric, self.patience = metric, patience or 0
        self.lower_is_better = metric == "dev_ce"
        self.best: float | None = None
        self.best_step: int | None = None
        self.since_best = 0

    def update(self, value: float, step: int) -> bool:
        better = self.best is None or (
            value < self.best if self.lower_is_better else value > self.best
        )
        if better:
            self.best, self.best_step, self.since_best = value, step, 0
        else:
            self.since_best += 1
        return better

    @property
    def exhausted(self) -> bool:
        return self.patience > 0 and self.since_best >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "since_best": self.since_best}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.since_best = int(state["since_best"])


def linear_warmup(weight: float, warmup_steps: int, step: int) -> float:
    if warmup_steps <= 0:
        return weight
    return weight * min(1.0, step / warmup_steps)


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start): per-step losses of a small
    batch are noise around the trend."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


TRAIN_LABELS = {
    "loss": "training loss",
    "ce": "training CE",
    "bertscore_loss": "training 1 − F_BERT",
    "reward": "training reward",
}
EVAL_LABELS = {"f_bert": "held-out F_BERT (hard)", "ce": "held-out CE (per token)"}


def plot_curves(log: RunLog, path: Path, title: str, term: str | None = None) -> Path:
    """The training losses against the step (faint: per step; bold: smoothed), and the held-out
    F_BERT and CE at each evaluation (validation points joined; test before and after
    training as squares); ``term`` says what the training term was computed with (its
    matching, its candidates), in its panel's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = log.entries()
    train = [e for e in entries if e.get("kind") == "train"]
    evals = [e for e in entries if e.get("kind") == "eval"]
    train_keys = [k for k in TRAIN_LABELS if any(k in e for e in train)]
    eval_keys = [k for k in EVAL_LABELS if any(k in e for e in evals)]
    panels = len(train_keys) + len(eval_keys)
    columns = min(3, max(panels, 1))
    rows = max(1, math.ceil(panels / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    flat = list(axes.flat)
    window = max(3, len(train) // 5)
    for ax, key in zip(flat, train_keys, strict=False):
        steps, values = zip(*[(e["step"], e[key]) for e in train if key in e], strict=True)
        ax.plot(steps, values, lw=0.6, alpha=0.35, color="tab:blue", label="per step")
        ax.plot(
            steps, smoothed(list(values), window), lw=2, color="tab:blue",
            label=f"mean of {window} steps",
        )  # fmt: skip
        # on a line of its own: beside the name it runs past a 4-inch panel
        suffix = f"\n({term})" if key == "bertscore_loss" and term else ""
        ax.set_title(TRAIN_LABELS[key] + suffix)
        ax.legend(fontsize=7)
    for ax, key in zip(flat[len(train_keys) :], eval_keys, strict=False):
        for split, style in (("validation", dict(marker="o")), ("test", dict(marker="s", ls=""))):
            points = [(e["step"], e[key]) for e in evals if e.get("split") == split and key in e]
            if points:
                count = next(e.get("examples") for e in evals if e.get("split") == split)
                label = f"{split} ({count} examples)" if count else split
                ax.plot(*zip(*points, strict=True), label=label, **style)
        ax.set_title(EVAL_LABELS[key])
        ax.legend(fontsize=7)
    for ax in flat:
        ax.set_xlabel("training step")
    for ax in flat[panels:]:
        ax.axis("off")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def summary_table(
    before: dict,
    after: dict,
    examples: int,
    steps: int,
    *,
    started_from: str | None = None,
    metrics_note: str = "",
) -> str:
    """The test metrics before training (zero-shot, or the ``started_from`` checkpoint's)
    against after ``steps`` steps, on ``examples`` held-out examples, with the change."""
    keys = [k for k in before if isinstance(before[k], float) and k in after]
    start = "zero-shot" if started_from is None else "start"
    what = "the generator before training" if started_from is None else started_from
    lines = [
        f"Held-out test set ({examples} examples never trained on): {start} = {what}, "
        f"fine-tuned = after {steps} steps",
        f"| metric (test, {examples} examples) | {start} | fine-tuned ({steps} steps) | change |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {k} | {before[k]:.4f} | {after[k]:.4f} | {after[k] - before[k]:+.4f} |" for k in keys
    ]
    notes = ["f_bert: hard BERTScore F1 against the reference", metrics_note,
             "ce: teacher-forced cross-entropy per reference token (lower is better)",
             "mean_length: words per generated answer"]  # fmt: skip
    lines.append("; ".join(n for n in notes if n))
    return "\n".join(lines)


# Where no progress bar shows (output not to a terminal), a long phase says where it is this often
HEARTBEAT_SECONDS = 30.0

# The run's settings as it started (resolved config, script, precision, starting weights):
# a --resume with other settings is refused, naming them
RUN_CONFIG = "run_config.json"
# what a resumed run may change: how long it trains, how often it saves and evaluates, how it
# batches its evaluations; not what or how it trains
RESUMABLE_CHANGES = frozenset(
    {
        "train.steps",
        "train.eval_every",
        "train.save_every",
        "train.checkpoints_total_limit",
        "train.save_model",
        "eval.batch_size",
        "eval.before",
    }
)


def run_record(config, script: str | None, mixed_precision: str, init_from) -> dict:
    """The settings a run started with, flat (``section.key``), as JSON writes them."""
    settings = _flat(dataclasses.asdict(config))
    settings["train.mixed_precision"] = mixed_precision  # --mixed_precision overrides the file's
    settings["init_from"] = None if init_from is None else str(Path(init_from).resolve())
    record = {"script": script, "settings": settings, "command": shlex.join(sys.argv)}
    return json.loads(json.dumps(record, default=str))


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_same_run(output_dir: Path, record: dict) -> dict | None:
    """A ``--resume`` continues the run in ``output_dir`` with its settings: any other setting
    than :data:`RESUMABLE_CHANGES` is refused, named (a new seed, batch size or term weight
    would mix two runs in one, and a new learning rate was ignored: the scheduler comes back
    from the checkpoint; audit h32). Returns the run's first record (``None`` for a run that
    started before runs kept one: nothing to compare).

    Raises:
        ValueError: a changed setting (each named with both values).
    """
    path = output_dir / RUN_CONFIG
    if not path.is_file():
        return None
    started = json.loads(path.read_text(encoding="utf-8"))
    old, new = started.get("settings", {}), record["settings"]
    missing = object()
    changed = [
        f"{key} {old.get(key, missing)!r} -> {new.get(key, missing)!r}".replace(
            repr(missing), "(unset)"
        )
        for key in sorted(old.keys() | new.keys())
        if key not in RESUMABLE_CHANGES and old.get(key, missing) != new.get(key, missing)
    ]
    if started.get("script") != record["script"]:
        changed.insert(0, f"script {started.get('script')!r} -> {record['script']!r}")
    if changed:
        raise ValueError(
            f"--resume: {output_dir} holds a run started with other settings ({'; '.join(changed)}"
            f"); a resumed run continues that run: resume with its settings ({path}), or start "
            "a new run (another --output_dir, or --overwrite)"
        )
    return started


def keep_run_settings(output_dir: Path, record: dict, resumed: bool) -> None:
    """Write the run's first record (:data:`RUN_CONFIG`), which later ``--resume`` calls are
    checked against (:func:`check_same_run`). ``resumed``: a ``--resume`` of a run that
    started before runs kept one; its own settings cannot be checked, which is said (once),
    and this resume's settings become the run's, so that the next resume is checked."""
    if resumed:
        print(
            f"warning: {output_dir} holds a run started before runs kept their settings (no "
            f"{RUN_CONFIG}): this --resume's settings are not checked against it, and are kept "
            "as the run's from now on",
            file=sys.stderr,
        )
    (output_dir / RUN_CONFIG).write_text(json.dumps(record, indent=2) + "\n")


# What a run writes into its --output_dir: a run is there when any of them is, and
# --overwrite removes them all (only these: the folder may hold the user's own files)
RUN_FILES = (
    "log.jsonl",
    "results.json",
    RUN_CONFIG,
    "curves.png",
    "test_outputs.txt",
    "test_outputs_before.txt",
)
RUN_FOLDERS = ("checkpoints", "model", "best", "dev_outputs")


def last_checkpoint(checkpoints: Path) -> Path:
    """The trainer's newest ``checkpoint-N`` under ``checkpoints``.

    Raises:
        FileNotFoundError: there is none (named).
    """
    saved = sorted(checkpoints.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if not saved:
        raise FileNotFoundError(
            f"--resume: no checkpoint under {checkpoints} (a run saves one every "
            "train.save_every steps; with save_every 0 it saves none)"
        )
    return saved[-1]


def check_fresh_output(
    output_dir: Path,
    resume: bool,
    overwrite: bool,
    artefacts: tuple[str, ...] = RUN_FILES + RUN_FOLDERS,
) -> None:
    """Refuse to mix two runs in one folder: a second run would append to the first's log (the
    plot would join them), overwrite half of its results, and a later ``--resume`` would take
    the first run's newest checkpoint for its own (audit h32). ``overwrite`` deletes every
    artefact of the old run (``artefacts``: the names a run writes) instead. ``resume`` needs
    a checkpoint to resume from, found here, before any model is loaded.

    Raises:
        FileExistsError: ``output_dir`` holds a run and neither ``resume`` nor ``overwrite``.
        FileNotFoundError: ``resume`` and no checkpoint under ``output_dir/checkpoints``.
    """
    if resume:
        last_checkpoint(output_dir / "checkpoints")
        return
    old = [output_dir / name for name in artefacts if (output_dir / name).exists()]
    if not old:
        return
    if not overwrite:
        raise FileExistsError(
            f"--output_dir {output_dir} already holds a run ({', '.join(p.name for p in old)}); "
            "pass another --output_dir, --resume to continue that run, or --overwrite to replace it"
        )
    for path in old:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _metrics_line(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))


class Timer:
    """Wall-clock seconds since the start; ``cpu()``: this process's CPU seconds (all its threads),
    the core-seconds a run costs on a shared machine, where wall time depends on the neighbours."""

    def __init__(self):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def continue_from(self, seconds: float, cpu_seconds: float) -> None:
        """A resumed run counts on from a checkpoint's totals (the work an interruption lost
        after its last checkpoint is done again, and counted once)."""
        self.start = time.perf_counter() - seconds
        self.cpu_start = time.process_time() - cpu_seconds

    def __call__(self) -> float:
        return round(time.perf_counter() - self.start, 2)

    def cpu(self) -> float:
        return round(time.process_time() - self.cpu_start, 2)


def memory_reading() -> str:
    """This process's resident memory now and its peak so far (``/proc/self/status``: VmRSS,
    VmHWM), for the phase lines: what each phase adds to the run's peak. Empty where there is
    no ``/proc`` (macOS, Windows)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return ""
    kib = {
        line.split(":")[0]: int(line.split()[1])
        for line in status.splitlines()
        if line.startswith(("VmRSS:", "VmHWM:"))
    }
    if len(kib) < 2:
        return ""
    return f"memory {kib['VmRSS'] / 2**20:.2f} GiB, peak {kib['VmHWM'] / 2**20:.2f} GiB"


M_ARENA_MAX, M_MMAP_THRESHOLD = -8, -3  # glibc's mallopt parameters (malloc.h)


def limit_malloc_arenas(arenas: int = 2, mmap_threshold: int | None = None) -> None:
    """At most ``arenas`` glibc heaps (``mallopt(M_ARENA_MAX)``, as ``MALLOC_ARENA_MAX`` does):
    each thread that allocates otherwise gets a heap of its own, and the freed activations
    that each keeps add to the peak (Gemma's sampled step, one thread: 3.82 GiB peak with one
    heap a thread, 3.68 with two; the time the same). ``mmap_threshold`` (bytes): blocks from
    that size up are mapped and unmapped one by one, so a freed activation goes back to the
    system at once (the demo's 4 MiB: 3.98 -> 3.32 GiB, about 5% more wall time in page
    faults; left to glibc otherwise). A no-op without glibc."""
    with suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, arenas)
        if mmap_threshold is not None:
            libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)


def release_freed_memory() -> None:
    """Hand the memory a phase freed back to the system (glibc's ``malloc_trim``). A training
    step's activations (about 3 GB for Gemma 3 270M at batch 8 with sampled candidates) are
    mostly tensors under glibc's mmap threshold, freed into its heap, which kept them: the
    process stayed at the step's peak between steps, and the heap's fragmentation added to the
    next peak. Only the resident pages go; what the next step allocates is faulted in again, so
    nothing computed changes. A no-op without glibc (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # no dlopen of the process, or not glibc
        pass


def _memory_suffix() -> str:
    memory = memory_reading()
    return f" ({memory})" if memory else ""


def check_encoder_decoder_lengths(config, model) -> None:
    """An encoder-decoder's length settings against its positions, before any batch: past them
    the embeddings failed inside transformers (``data.max_source_length`` 1000 against BERT's
    512 on XSum's 723-token articles; ``eval.max_new_tokens`` 530 after a minute of
    generating; audit h32). The decoder's answers start after its start token.

    Raises:
        ValueError: naming the setting, its value and the model's positions.
    """
    encoder, decoder = position_limit(model), position_limit(model, decoder=True)
    settings = (
        ("data.max_source_length", config.data.max_source_length, encoder, "encoder", 0),
        ("data.max_target_length", config.data.max_target_length, decoder, "decoder", 0),
        ("eval.max_new_tokens", config.eval.max_new_tokens, decoder, "decoder", 1),
    )
    for name, value, limit, part, start in settings:
        if limit is not None and value is not None and value + start > limit:
            after = " after its start token" if start else ""
            raise ValueError(
                f"config {name} {value} exceeds the {part}'s {limit} positions{after} "
                f"({type(model).__name__}); set it to at most {limit - start}"
            )


def make_collator(config, model, tokenizer) -> Collator | CausalCollator:
    """The batches of the config's generator: an encoder-decoder's (:class:`seq2seq.Collator`)
    or a decoder-only LM's (:class:`causal.CausalCollator`, prompted as ``data`` says)."""
    data_spec = config.data
    if getattr(model.config, "is_encoder_decoder", False):
        for setting in ("prompt_format", "chat_template"):
            if getattr(data_spec, setting) not in (None, "auto"):
                raise ValueError(
                    f"data.{setting} is for decoder-only generators; "
                    "this generator is an encoder-decoder"
                )
        check_encoder_decoder_lengths(config, model)
        return Collator(tokenizer, model, data_spec.max_source_length, data_spec.max_target_length)
    return CausalCollator(
        tokenizer,
        model,
        config.task,
        data_spec.max_source_length,
        data_spec.max_target_length,
        data_spec.prompt_format,
        data_spec.chat_template,
    )


class RecipeRun:
    """What every recipe does around its own training step: config, accelerator, data, scorer,
    generator, collator, evaluator; resume and the test score before training; periodic
    validation and checkpoints; the final model, test score, results file and plot. The config
    is checked first (``script``: also against what that training script reads,
    :func:`config.load_config`), before any model is loaded."""

    def __init__(self, args: argparse.Namespace, script: str | None = None):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        from bsloss import BERTScorer
        from bsloss.scorer.encoder import ScorerEncoder

        self.args = args
        self.timer = Timer()
        limit_malloc_arenas()
        self.config = load_config(args.config, args.overrides, script=script)
        self.train = self.config.train
        self.output_dir = args.output_dir
        check_fresh_output(self.output_dir, args.resume, getattr(args, "overwrite", False))
        precision = args.mixed_precision or self.train.mixed_precision
        record = run_record(self.config, script, precision, args.init_from)
        self.started = check_same_run(self.output_dir, record) if args.resume else record
        started_before_settings_were_kept = args.resume and self.started is None
        # the trainer's too (trainer_run.trainer_arguments: use_configured_state); the trainer
        # accumulates gradients and writes the checkpoints
        self.accelerator = Accelerator(mixed_precision=precision, cpu=args.cpu)
        self.early_stopping = EarlyStopping(
            self.train.early_stopping_metric, self.train.early_stopping_patience
        )
        self.stopped_at: int | None = None  # the step early stopping ended the run at
        set_seed(self.train.seed)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.accelerator.is_main_process and (
            not args.resume or started_before_settings_were_kept
        ):
            keep_run_settings(self.output_dir, record, resumed=args.resume)
        self.log = RunLog(self.output_dir / "log.jsonl", self.accelerator.is_main_process)
        self.data = load_splits(self.config.data)
        self.say("data: " + ", ".join(f"{len(rows)} {split}" for split, rows in self.data.items()))
        if self.train.eval_every:
            check_dev_split(self.data)
        scorer_spec = self.config.scorer
        with self.phase("loading the scorer"):
            self.encoder = ScorerEncoder.from_pretrained(
                scorer_spec.model, scorer_spec.num_layers, self.accelerator.device
            )
        # references repeat (validation set, reward): their embeddings are kept across calls
        self.scorer = BERTScorer(encoder=self.encoder, reference_cache_size=100_000)
        with self.phase(f"loading the generator {self.config.model.generator}"):
            self.model, self.tokenizer = load_generator(
                self.config.model, args.init_from, self.encoder
            )
        self.frozen_parameters = 0
        if self.train.freeze_embeddings:
            self.frozen_parameters = freeze_embeddings(self.model)
        with warnings.catch_warnings():
            # PEFT still reads transformers' old name (is_gradient_checkpointing, a FutureWarning
            # since transformers 5.2x): nothing a recipe's user can act on
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
            self.model = with_lora(
                self.model, self.train.lora_rank, self.train.lora_alpha, args.init_from
            )
        if self.train.gradient_checkpointing:
            # transformers' new name where it has one (the old one warns that it will go)
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)()
            self.model.config.use_cache = False
        self.collator = make_collator(self.config, self.model, self.tokenizer)
        self.evaluator = Evaluator(self.config.task, self.scorer, self.config.eval)
        self.results_path = self.output_dir / "results.json"
        self.results: dict = {}

    def log_setup(self, **extra) -> None:
        """The log's first line (a new run's only): the generator, its parameters (all and
        trainable), the scorer and the number of processes, with the recipe's ``extra``."""
        if self.args.resume:
            return
        parameters = list(self.model.parameters())
        self.log.write(
            kind="setup",
            step=0,
            generator=type(self.model).__name__,
            parameters=sum(p.numel() for p in parameters),
            trainable_parameters=sum(p.numel() for p in parameters if p.requires_grad),
            scorer=self.encoder.describe(),
            world_size=self.accelerator.num_processes,
            **extra,
        )

    @contextmanager
    def heartbeat(self, status: Callable[[], str]):
        """``status()`` said every :data:`HEARTBEAT_SECONDS` while the block runs, when the
        output is not a terminal (a log file, CI, ``nohup``), where tqdm draws no bar: a
        training step that answers, or an evaluation, was silent for minutes there (audit
        h32: 315 s without a line on a loaded machine). On a terminal the bars show it."""
        quiet = sys.stderr.isatty() or not self.accelerator.is_main_process  # bars: stderr
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_SECONDS):
                self.say(status())

        beating = None if quiet else threading.Thread(target=beat, daemon=True)
        if beating is not None:
            beating.start()
        try:
            yield
        finally:
            stop.set()
            if beating is not None:
                beating.join()

    def say(self, message: str) -> None:
        """One progress line on the main process, with the time since the start."""
        if self.accelerator.is_main_process:
            from tqdm.auto import tqdm

            tqdm.write(f"[{self.timer():7.1f} s] {message}", file=sys.stdout)
            sys.stdout.flush()

    @contextmanager
    def phase(self, what: str):
        """A line when a phase starts and one with its duration and the process's memory (now
        and peak) when it ends; where no progress bar shows, a line every
        :data:`HEARTBEAT_SECONDS` between (:meth:`heartbeat`)."""
        start = time.perf_counter()
        self.say(f"{what} ...")
        with self.heartbeat(lambda: f"{what}: {time.perf_counter() - start:.0f} s so far"):
            yield
        release_freed_memory()
        self.say(f"{what}: done in {time.perf_counter() - start:.1f} s{_memory_suffix()}")

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def begin(self, start: int) -> None:
        """Before the first step: the test score before training and the dev metrics at step 0
        (a run that starts at ``start`` > 0 has them already)."""
        if self.results_path.exists():
            self.results = json.loads(self.results_path.read_text())
        wants_before = self.config.eval.before
        if start == 0 and self.accelerator.is_main_process and wants_before:
            what = "zero-shot" if self.args.init_from is None else "start (--init_from)"
            before, hypotheses = self.evaluate("test", f"{what} evaluation")
            self.results["before"] = before
            self.results["complete"] = False  # until finish(): a stopped run says so
            self.write_outputs("test_outputs_before.txt", hypotheses)
            self.results_path.write_text(json.dumps(self.results, indent=2))
            self.log.write(kind="eval", split="test", step=0, **before)
        if start == 0 and self.train.eval_every and self.accelerator.is_main_process:
            # where the held-out curves start (not a candidate for best/: the trained steps are)
            self.validate(0)

    def evaluate(self, split: str, what: str = "evaluation") -> tuple[dict, list[str]]:
        """Generate for the ``split``'s examples and score them (a progress line before and
        after); the metrics carry the number of ``examples``."""
        examples = self.data[split]
        with self.phase(f"{what}: generating and scoring {len(examples)} {split} examples"):
            metrics, hypotheses = self.evaluator(
                self.unwrapped, self.tokenizer, self.collator, examples, self.device
            )
        self.say(f"{what}: " + _metrics_line(metrics))
        return {**metrics, "examples": len(examples)}, hypotheses

    def validate(self, step: int) -> dict:
        """The dev metrics at ``step`` (:meth:`evaluate_dev`), logged; returned."""
        metrics, hypotheses = self.evaluate_dev(step)
        if hypotheses:  # each evaluation's answers, for rescoring the curve with another scorer
            self.write_outputs(f"dev_outputs/step_{step}.txt", hypotheses)
        self.log.write(
            kind="eval",
            split="validation",
            step=step,
            time=self.timer(),
            cpu=self.timer.cpu(),
            **metrics,
        )
        return metrics

    def evaluate_dev(self, step: int) -> tuple[dict, list[str]]:
        """The validation split's metrics: teacher-forced CE alone (``dev_ce``: no generation,
        no answers), or everything :meth:`evaluate` computes (``dev_bertscore_f``), with the
        generated answers."""
        what = f"held-out evaluation at step {step}"
        if self.train.early_stopping_metric == "dev_ce":
            examples = self.data["validation"]
            model, was_training = self.unwrapped, self.unwrapped.training
            model.eval()
            with self.phase(f"{what}: teacher-forced CE of {len(examples)} validation examples"):
                ce = self.evaluator.cross_entropy(model, self.collator, examples, self.device)
            model.train(was_training)
            self.say(f"{what}: ce {ce:.4f}")
            return {"ce": ce, "examples": len(examples)}, []
        return self.evaluate("validation", what)

    @property
    def best_dir(self) -> Path:
        return self.output_dir / "best"

    def keep_if_best(self, step: int, metrics: dict) -> None:
        """Early stopping: save the model into ``best/`` when the dev metric improves, and mark
        the run as stopped once ``train.early_stopping_patience`` evaluations did not."""
        tracker = self.early_stopping
        key = "ce" if tracker.metric == "dev_ce" else "f_bert"
        if tracker.update(metrics[key], step):
            save_generator(self.unwrapped, self.tokenizer, self.best_dir)
            (self.best_dir / "best.json").write_text(
                json.dumps({"step": step, tracker.metric: metrics[key]})
            )
        if tracker.exhausted:
            self.stopped_at = step

    def record_step(self, step: int, **entry) -> None:
        """The step's line in ``log.jsonl`` (with the time and CPU so far), and one on the
        screen every tenth of the run; a loss that is not finite stops the run, named."""
        if not math.isfinite(entry["loss"]):
            raise FloatingPointError(f"step {step}: the loss is {entry['loss']}")
        self.log.write(kind="train", step=step, time=self.timer(), cpu=self.timer.cpu(), **entry)
        release_freed_memory()
        every = max(1, self.train.steps // 10)
        if step % every == 0 or step == self.train.steps:
            losses = ", ".join(f"{k} {v:.4f}" for k, v in entry.items() if k != "lr")
            self.say(f"step {step}/{self.train.steps}: {losses}{_memory_suffix()}")

    def validation_turn(self, step: int) -> bool:
        """The dev evaluation when ``train.eval_every`` says (its best weights kept under
        ``best/`` with early stopping); returns whether early stopping ends the run here."""
        eval_every = self.train.eval_every
        if eval_every and step % eval_every == 0:
            if self.accelerator.is_main_process:
                metrics = self.validate(step)
                if self.train.early_stopping_patience:
                    self.keep_if_best(step, metrics)
            self.share_early_stop()
        return self.stopped_at is not None

    def share_early_stop(self) -> None:
        """Every process stops where the main process (which evaluates) decided to."""
        if self.accelerator.num_processes == 1 or not self.train.early_stopping_patience:
            return
        from accelerate.utils import broadcast

        stopped = torch.tensor([-1 if self.stopped_at is None else self.stopped_at])
        stopped = int(broadcast(stopped.to(self.device), from_process=0))
        self.stopped_at = None if stopped < 0 else stopped

    def write_outputs(self, name: str, hypotheses: list[str]) -> None:
        """One generated answer per line, in the split's order (for rescoring later)."""
        (self.output_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (self.output_dir / name).write_text("\n".join(hypotheses) + "\n", encoding="utf-8")

    def restore_best(self) -> int:
        """Load ``best/``'s weights into the model; returns the step they are from. A run resumed
        from a checkpoint older than ``best/`` re-saves it when it replays that step (the steps
        replay identically); if it did not, the weights are still ``best/``'s, and so is the step
        returned."""
        saved = json.loads((self.best_dir / "best.json").read_text())
        if saved["step"] != self.early_stopping.best_step:
            print(
                f"warning: best/ holds step {saved['step']}, the resumed run's best was step "
                f"{self.early_stopping.best_step}; the test score is best/'s",
                file=sys.stderr,
            )
        load_saved_weights(self.unwrapped, self.best_dir)
        return int(saved["step"])

    def finish(self, last_step: int, title: str, *, term: str | None = None, **extra) -> dict:
        """After the last step (or early stopping): the model, test scores, results.json,
        outputs and the plot (or nothing but a message when ``--stop_after`` cut the run short).
        With early stopping the test split is scored with ``best/``, which is the final model
        (no ``model/``). ``term``: what the BERTScore term was computed with, for the plot."""
        accelerator, steps = self.accelerator, self.train.steps
        accelerator.wait_for_everyone()
        if last_step < steps and self.stopped_at is None:
            accelerator.print(f"stopped after step {last_step} of {steps} (--stop_after)")
            return self.results
        patience = self.train.early_stopping_patience
        if accelerator.is_main_process:
            if patience:
                tracker = self.early_stopping
                extra.update(
                    early_stopping_metric=tracker.metric,
                    early_stopping_patience=patience,
                    best_step=None if tracker.best_step is None else self.restore_best(),
                    best_value=tracker.best,
                    stopped_at=self.stopped_at,
                )
            # with a best/ (early stopping), that is the final model; a study may skip 1 GB each
            if self.train.save_model and extra.get("best_step") is None:
                save_generator(self.unwrapped, self.tokenizer, self.output_dir / "model")
            if self.args.init_from is not None:
                extra["init_from"] = str(Path(self.args.init_from).resolve())
            if self.train.freeze_embeddings:
                extra["frozen_parameters"] = self.frozen_parameters
            after, hypotheses = self.evaluate("test", "final evaluation")
            # logged (and plotted) at the step of the weights scored: best/'s with early stopping
            scored = extra.get("best_step") or self.stopped_at or steps
            self.log.write(kind="eval", split="test", step=scored, **after)
            self.results.update(
                complete=True,
                after=after,
                steps=steps,
                seed=self.train.seed,
                train_seconds=self.timer(),
                truncated=self.collator.truncated,
                command=shlex.join(sys.argv),  # a shell can run it again; split with shlex
                # a resumed run: the command that started it (its settings: run_config.json)
                **(
                    {"started_with": self.started["command"]}
                    if self.started and self.started["command"] != shlex.join(sys.argv)
                    else {}
                ),
                **extra,
            )
            self.results_path.write_text(json.dumps(self.results, indent=2))
            self.write_outputs("test_outputs.txt", hypotheses)
            plot = plot_curves(self.log, self.output_dir / "curves.png", title, term)
            if "before" in self.results:
                print(
                    summary_table(
                        self.results["before"],
                        after,
                        after["examples"],
                        self.stopped_at or steps,
                        started_from=None
                        if self.args.init_from is None
                        else f"the --init_from checkpoint {self.args.init_from}",
                        metrics_note=self.evaluator.task.metrics_note,
                    )
                )
            if self.stopped_at is not None:
                print(f"early stopping at step {self.stopped_at}: best step {extra['best_step']}")
            print(f"curves: {plot}")
            print(f"results: {self.results_path}")
        accelerator.wait_for_everyone()
        return self.results


def end_processes() -> None:
    """End the process group of a distributed run (a recipe's last call): left to the
    interpreter's exit, gloo's threads were sometimes torn down while running, an abort after a
    finished run."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
