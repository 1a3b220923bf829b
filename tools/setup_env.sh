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
# That build with its CUDA libraries takes about 5 GiB in .venv: say so up front instead of pip's "No space left".
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  free_gib=$(df -Pk .venv | awk 'NR==2 {printf "%d", $4 / 1048576}')
  if [ "$free_gib" -lt 6 ]; then
    echo "error: only ${free_gib} GiB free for .venv ($(pwd)); torch 2.13 (CUDA build from PyPI) needs about 6 GiB:" \
         "free disk space, or point the repository at a larger disk" >&2
    exit 2
  fi
fi
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
