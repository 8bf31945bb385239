"""The one cache folder: $TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill.

Under it: kernels/ (the compiled C kernels), weights/ (converted weights, models/weight_cache.py),
peers/ (the benchmarks' llama.cpp builds). Also here: the shared-memory folder. Standard library
only: anything may import it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

CACHE_DIR_ENV = "TOKENMILL_CACHE_DIR"
# Where processes of one machine share memory through files (tmpfs: memory, not disk): the
# tensor-parallel ranks' exchange, the K/V handed from a prefill to a decode engine.
SHARED_MEMORY_DIR = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def cache_root() -> Path:
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill"
