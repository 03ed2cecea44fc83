"""``python benchmarks/x.py`` puts ``benchmarks/`` first on ``sys.path``, so ``import _path``
works there (and only there); this puts the repository root before it, so that the scripts import
``benchmarks.*`` and ``bsloss`` as they do under ``python -m benchmarks.x``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
