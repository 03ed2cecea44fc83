"""What every benchmark report records about the run: the CPU and the exact command line."""

from __future__ import annotations

import os
import platform
import shlex
import sys

__all__ = ["cpu_model", "command_line"]


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
    return prefix + shlex.join([python, *sys.argv])
