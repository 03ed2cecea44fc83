"""Process memory as the benchmarks measure it: current RSS and the RSS high-water mark, reset
between measured sections through ``/proc/self/clear_refs`` (Linux >= 4.0), falling back to
``getrusage``'s lifetime peak where that is not allowed."""

from __future__ import annotations

import resource

__all__ = ["current_rss_bytes", "reset_peak_rss", "peak_rss_bytes"]


def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    kb = _proc_status_kb("VmRSS")
    if kb is None:  # no /proc: the peak is the best we have
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes(reset_worked: bool) -> int:
    """The high-water mark since the last reset (or the process's lifetime peak)."""
    kb = _proc_status_kb("VmHWM") if reset_worked else None
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024
