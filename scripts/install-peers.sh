#!/usr/bin/env bash
# Install tokenmill's benchmark peers for `tokenmill bench compare` (optional: no test needs them).
#
#   1. llama-cpp-python (llama.cpp's Python API), compiled by pip from its PyPI source distribution
#      with native CPU flags: about 9 minutes on 2 cores.
#   2. llama.cpp's C++ `llama-server`, built with cmake from the llama.cpp source vendored in the
#      SAME sdist, into ~/.cache/tokenmill/peers/llama.cpp-<version>/bin/: about 6 minutes.
#
# The version is pinned once, in src/tokenmill/bench/peers.py (LLAMA_CPP_PYTHON_VERSION).
# Needs a C/C++ compiler, make and cmake >= 3.21; as root on Debian/Ubuntu this script installs
# what is missing with apt-get, otherwise it takes cmake from PyPI.
#
# Usage: scripts/install-peers.sh [PYTHON]   (default: .venv/bin/python when it exists, else python3)
# Environment: JOBS (parallel compile jobs, default: all cores), TOKENMILL_CACHE_DIR (cache root).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${1:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
JOBS=${JOBS:-$(nproc)}

cmake_ok() {
    command -v cmake >/dev/null 2>&1 || return 1
    local v
    v=$(cmake --version | head -1 | awk '{print $3}')
    [ "$(printf '%s\n3.21\n' "$v" | sort -V | head -1)" = "3.21" ]
}

missing=()
command -v gcc >/dev/null 2>&1 || missing+=(gcc)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || missing+=(make)
cmake_ok || missing+=(cmake)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing build tools with apt-get: ${missing[*]}"
        apt-get update -qq
        apt-get install -y -qq build-essential cmake
    fi
fi
if ! cmake_ok; then
    echo "no cmake >= 3.21 on PATH: installing the PyPI cmake package"
    "$PY" -m pip install "cmake>=3.21"
    PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"
    export PATH
fi
for tool in gcc g++ make cmake; do
    command -v "$tool" >/dev/null 2>&1 || { echo "error: $tool is missing; install a C/C++ toolchain" >&2; exit 1; }
done

# tokenmill itself must be importable (the pin lives in its source).
if ! "$PY" -c "import tokenmill" 2>/dev/null; then
    "$PY" -m pip install -e .
fi
VERSION=$("$PY" -m tokenmill.bench.peers version)
CMAKE_FLAGS=$("$PY" -m tokenmill.bench.peers cmake-args)

echo "== llama-cpp-python $VERSION (compiling llama.cpp: about 9 minutes on 2 cores)"
start=$(date +%s)
CMAKE_ARGS="$CMAKE_FLAGS ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    "$PY" -m pip install --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
echo "   took $(( $(date +%s) - start )) s"

echo "== llama-server from the same sdist (about 6 minutes on 2 cores)"
"$PY" -m tokenmill.bench.peers build-llama-server --jobs "$JOBS"

"$PY" -m tokenmill.bench.peers status
