"""Hand freed heap memory back to the operating system between chunks of a long scoring run.

glibc's allocator keeps the blocks that a chunk's embeddings freed; the next chunk, with other
tensor shapes, cannot always reuse them, so the resident size creeps up with the corpus instead of
staying bounded by the chunk. ``malloc_trim(0)`` returns the free pages. Elsewhere (macOS, musl,
Windows) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache

__all__ = ["release_freed_memory"]


@cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Returns whether memory was released (glibc only)."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))
