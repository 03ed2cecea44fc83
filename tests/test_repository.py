"""The repository itself: small enough to clone quickly and to travel whole to a GPU machine
(whose copy of the tree is limited to 64 MiB, the tree plus what a run carries)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_TRACKED_BYTES = 30 * 1000 * 1000


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [REPO_ROOT / name for name in listing.split("\0") if name]


def test_the_tracked_tree_stays_under_30_mb():
    sizes = {path: path.stat().st_size for path in _tracked_files() if path.is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    shown = ", ".join(f"{p.relative_to(REPO_ROOT)} {s / 1e6:.1f} MB" for p, s in largest)
    assert total <= MAX_TRACKED_BYTES, f"tracked tree {total / 1e6:.1f} MB; largest: {shown}"
