#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install megatron_upipe with its test extras into it.
# Usage: bash tools/setup_env.sh        (then: source .venv/bin/activate)
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/find_python.sh
if [ ! -x .venv/bin/python ] || ! _py_ok .venv/bin/python; then
  rm -rf .venv
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: on PyPI it is the CUDA build (runs on CPU too); the pin keeps installs reproducible.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
