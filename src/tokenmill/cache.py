"""The one cache folder: $TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill.

Under it: kernels/ (the compiled C kernels), weights/ (converted weights, models/weight_cache.py),
peers/ (the benchmarks' llama.cpp builds). Standard library only: anything may import it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "TOKENMILL_CACHE_DIR"


def cache_root() -> Path:
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill"
