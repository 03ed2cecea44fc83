"""The one harness every benchmark uses. Each piece does one job:

- :class:`Worker` and :func:`run_isolated`: run a named function of a benchmark module in a fresh
  Python process, JSON in and out, so that each measurement has its own peak memory;
- :class:`MemoryMeter`: the process's RSS before and at its peak over a section (the peak reset
  through ``/proc/self/clear_refs`` where the kernel allows it), and CUDA's peak allocated bytes
  on a CUDA device;
- :class:`AlternatingTimer`: variants run A, B, A, B, ... for N rounds, so that load from other
  processes falls on all alike; medians and the range of the per-round ratios;
- :func:`markdown_table` and :func:`environment` / :func:`header_lines`: the report's tables and
  its one environment header (command line, date, CPU, load average, versions, git commit);
- :class:`Goal`: a goal as data (name, bound, direction), turned into a "met" / "NOT met" row.

Importing this module sets ``HF_HUB_OFFLINE=1`` and ``TOKENIZERS_PARALLELISM=false`` unless they
are set: the benchmarks run on cached models, and worker processes inherit the environment.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
MB = 1e6


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries the report (and a worker's answers)."""
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- worker process
RESULT_PREFIX = "@@RESULT "
_CHILD = "from benchmarks.harness import _child; _child()"


class WorkerError(RuntimeError):
    """A worker process raised (its traceback is in the message) or ended without answering."""


def target_name(target: str | Callable) -> str:
    """``"module:qualname"`` of a function or class; a script's ``__main__`` is named by its path
    under the repository (``benchmarks/x.py`` -> ``benchmarks.x``), so a child can import it."""
    if isinstance(target, str):
        return target
    module = target.__module__
    if module == "__main__":
        path = Path(sys.modules["__main__"].__file__).resolve()
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return f"{module}:{target.__qualname__}"


def _resolve(name: str) -> Any:
    module, _, attribute = name.partition(":")
    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def _answer(payload: dict) -> None:
    print(RESULT_PREFIX + json.dumps(payload), flush=True)


def _child() -> None:
    """The worker process: ``once`` answers ``target(*args, **kwargs)``; ``serve`` builds
    ``state = target(*args, **kwargs)``, answers ``None`` when ready, then answers each request
    line ``{"call", "args", "kwargs"}`` with ``getattr(state, call)(*args, **kwargs)`` until a
    ``null`` line or the end of stdin. Exceptions are answered as ``{"error": traceback}``."""
    mode, name, arguments = sys.argv[1:4]
    args, kwargs = json.loads(arguments)
    try:
        state = _resolve(name)(*args, **kwargs)
        _answer({"result": state if mode == "once" else None})
    except Exception:
        _answer({"error": traceback.format_exc()})
        return
    if mode == "once":
        return
    for line in sys.stdin:
        request = json.loads(line)
        if request is None:
            break
        try:
            method = getattr(state, request["call"])
            _answer({"result": method(*request["args"], **request["kwargs"])})
        except Exception:
            _answer({"error": traceback.format_exc()})


def _spawn(mode: str, name: str, args: Sequence, kwargs: Mapping) -> subprocess.Popen:
    path = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, mode, name, json.dumps([list(args), dict(kwargs)])],
        stdin=subprocess.PIPE if mode == "serve" else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
    )


def _read(process: subprocess.Popen, name: str) -> Any:
    for line in process.stdout:
        if line.startswith(RESULT_PREFIX):
            payload = json.loads(line[len(RESULT_PREFIX) :])
            if "error" in payload:
                raise WorkerError(f"worker {name} raised:\n{payload['error']}")
            return payload["result"]
    raise WorkerError(f"worker {name} exited with {process.wait()} before answering")


def run_isolated(target: str | Callable, *args: Any, **kwargs: Any) -> Any:
    """``target(*args, **kwargs)`` in a fresh Python process; its JSON result. Arguments and
    result must be JSON values; a child's exception raises :class:`WorkerError`."""
    name = target_name(target)
    process = _spawn("once", name, args, kwargs)
    try:
        return _read(process, name)
    finally:
        process.stdout.close()
        process.wait()


def import_bsloss_from(tree: str) -> Any:
    """``bsloss`` imported from the checkout ``tree`` (put first on ``sys.path``), for a worker
    that measures that tree; ``RuntimeError`` when it would come from elsewhere (``tree`` holds
    no bsloss, or this process imported another one before)."""
    sys.path.insert(0, tree)
    import bsloss

    if not Path(bsloss.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise RuntimeError(f"bsloss came from {bsloss.__file__}, not from {tree}")
    return bsloss


class Worker:
    """A process that keeps ``state = target(*args, **kwargs)`` and runs its methods on request.

    Starting does not wait, so several workers load side by side; :meth:`ready` waits for the
    state to be built, :meth:`call` runs one method (JSON arguments and result)."""

    def __init__(self, target: str | Callable, *args: Any, **kwargs: Any):
        self.name = target_name(target)
        self.process = _spawn("serve", self.name, args, kwargs)
        self._ready = False

    def ready(self) -> Worker:
        if not self._ready:
            _read(self.process, self.name)
            self._ready = True
        return self

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.ready()
        request = {"call": method, "args": list(args), "kwargs": kwargs}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return _read(self.process, self.name)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("null\n")
                self.process.stdin.flush()
            except OSError:  # the child is gone already
                pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- memory meter
def _proc_status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    kb = _proc_status_kb("VmRSS")
    if kb is None:  # no /proc: the lifetime peak is the best there is
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes(since_reset: bool = True) -> int:
    """``VmHWM`` (the peak since the last reset) or, failing that or if ``since_reset`` is
    False, ``ru_maxrss`` (the process's lifetime peak)."""
    kb = _proc_status_kb("VmHWM") if since_reset else None
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


class MemoryMeter:
    """``with MemoryMeter() as meter: ...``: the RSS just before the section and its peak over
    the section (``reset_peak=False``: the process's lifetime peak, ``ru_maxrss``), in bytes;
    on a CUDA ``device`` also ``torch.cuda.max_memory_allocated`` over the section."""

    def __init__(self, device: Any = None, reset_peak: bool = True):
        self.cuda = device is not None and "cuda" in str(device)
        self.reset_peak = reset_peak
        self.rss_before = self.peak_rss = 0
        self.reset_worked = False
        self.cuda_before = self.cuda_peak = None

    @property
    def method(self) -> str:
        return "VmHWM after clear_refs" if self.reset_worked else "ru_maxrss"

    @property
    def extra_peak(self) -> int:
        """Peak RSS over the section minus the RSS just before it."""
        return self.peak_rss - self.rss_before

    def __enter__(self) -> MemoryMeter:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda_before = torch.cuda.memory_allocated()
        self.rss_before = current_rss_bytes()
        self.reset_worked = self.reset_peak and reset_peak_rss()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.cuda_peak = torch.cuda.max_memory_allocated()
        self.peak_rss = peak_rss_bytes(self.reset_worked)

    def as_dict(self, unit: float = MB) -> dict:
        """The readings in ``unit`` (MB = 1e6 bytes by default) for a JSON answer."""
        out = {
            "rss_before_mb": self.rss_before / unit,
            "peak_rss_mb": self.peak_rss / unit,
            "extra_peak_mb": self.extra_peak / unit,
            "rss_method": self.method,
        }
        if self.cuda_peak is not None:
            out["cuda_peak_mb"] = self.cuda_peak / unit
            out["cuda_extra_peak_mb"] = (self.cuda_peak - self.cuda_before) / unit
        return out


# ----------------------------------------------------------------------------- alternating timer
@dataclass
class Series:
    """One variant's calls: the seconds the timer measured and what each call returned."""

    seconds: list[float] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)

    def median(self, key: Callable[[Any], float] | None = None) -> float:
        """Median of the timer's seconds, or of ``key(value)`` (e.g. a time the call measured
        itself, inside a worker)."""
        return statistics.median(self.seconds if key is None else map(key, self.values))


def ratio_range(numerator: Sequence[float], denominator: Sequence[float]) -> tuple[float, float]:
    """Smallest and largest ratio of two variants' figures within one round."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return min(ratios), max(ratios)


@dataclass
class AlternatingTimer:
    """Runs the variants in turn, A, B, A, B, ..., for ``rounds`` rounds, timing each call with
    ``clock`` after ``prepare()`` (a garbage collection by default)."""

    rounds: int
    label: str = ""
    clock: Callable[[], float] = time.perf_counter
    prepare: Callable[[], object] = gc.collect
    report: Callable[[str], None] | None = log

    def time(self, run: Callable[[], Any]) -> tuple[float, Any]:
        """One timed call: ``(seconds, value)``."""
        self.prepare()
        start = self.clock()
        value = run()
        return self.clock() - start, value

    def run(self, variants: Mapping[str, Callable[[], Any]]) -> dict[str, Series]:
        series = {name: Series() for name in variants}
        for r in range(self.rounds):
            for name, run in variants.items():
                seconds, value = self.time(run)
                series[name].seconds.append(seconds)
                series[name].values.append(value)
                if self.report:
                    self.report(f"{self.label} round {r + 1}/{self.rounds} {name}: {seconds:.3f} s")
        return series


# ----------------------------------------------------------------------------- goals
@dataclass(frozen=True)
class Goal:
    """A goal as data: the measured ratio must be ``direction`` ("<=" or ">=") ``bound``."""

    name: str
    bound: float
    direction: str = "<="

    def __post_init__(self) -> None:
        if self.direction not in ("<=", ">="):
            raise ValueError(f"direction must be '<=' or '>=', not {self.direction!r}")

    @property
    def target(self) -> str:
        return f"{'≤' if self.direction == '<=' else '≥'} {self.bound:g}"

    def met(self, measured: float) -> bool:
        return measured <= self.bound if self.direction == "<=" else measured >= self.bound

    def verdict(self, measured: float) -> str:
        return "met" if self.met(measured) else "NOT met"

    def row(self, measured: float, **cells: Any) -> dict:
        """``{"goal", **cells, "ratio", "target", "pass", "result"}`` for a goals table."""
        return {
            "goal": self.name,
            **cells,
            "ratio": measured,
            "target": self.target,
            "pass": self.met(measured),
            "result": self.verdict(measured),
        }


# ----------------------------------------------------------------------------- report
def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A markdown table; ``align`` has one letter a column, ``l`` or ``r`` (default ``l``)."""
    align = align.ljust(len(header), "l")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def command_line() -> str:
    prefix = "HF_HUB_OFFLINE=1 " if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
    python = "python" if os.path.basename(sys.executable).startswith("python") else sys.executable
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__spec__", None) is not None and main.__spec__.name:
        return prefix + shlex.join([python, "-m", main.__spec__.name, *sys.argv[1:]])
    return prefix + shlex.join([python, *sys.argv])


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def git_state() -> str:
    """The commit measured, and the bsloss files that differ from it (uncommitted edits)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, check=True, capture_output=True, text=True
        ).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", "bsloss").split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    changed = [line[3:] for line in dirty if line.strip()]
    return commit + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def environment(**extra_versions: str) -> dict:
    """What a report records about its run (take it before measuring: the tree may change)."""
    import torch
    import transformers

    import bsloss

    return {
        "command": command_line(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
        "git": git_state(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "bsloss": bsloss.__version__,
            **extra_versions,
        },
    }


def header_lines(env: Mapping, threads_note: str = "") -> list[str]:
    """The report's environment bullets (command, date, CPU and load, versions and commit)."""
    load = ", ".join(f"{x:.1f}" for x in env.get("load_average", [])) or "unknown"
    versions = ", ".join(f"{name} {value}" for name, value in env["versions"].items())
    return [
        f"- command: `{env['command']}`",
        f"- date (UTC): {env['date']}",
        f"- CPU: {env['cpu']} ({env['logical_cpus']} logical CPUs); torch threads: "
        f"{env['torch_threads']}{f' ({threads_note})' if threads_note else ''}; "
        f"load average (1, 5, 15 min) at the start: {load}",
        f"- versions: {versions}; git {env['git']}",
    ]


def argument_parser(doc: str, out: bool = True, json_out: bool = True) -> argparse.ArgumentParser:
    """A parser described by the docstring's first paragraph, with ``--out`` (the markdown
    report) and ``--json`` (machine-readable results) unless turned off."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if out:
        parser.add_argument("--out", metavar="FILE.md", help="also write the markdown report here")
    if json_out:
        parser.add_argument("--json", metavar="FILE", help="write machine-readable results here")
    return parser


def write_outputs(markdown: str, out: str | None, json_path: str | None, payload: Any) -> None:
    """Print the report; also write it to ``out`` and ``payload`` as JSON to ``json_path``."""
    print(markdown)
    if out:
        Path(out).write_text(markdown.rstrip("\n") + "\n", encoding="utf-8")
    if json_path:
        Path(json_path).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
