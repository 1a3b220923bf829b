#!/usr/bin/env bash
# The one prepared script for a lent GPU (device tool): GPU numerics of every CUDA attention kernel and the
# measured vs modelled peak memory of one UPipe / Ulysses layer (see tools/gpu_check.py). About 3-5 minutes.
# Run from the repository root on the GPU machine:  bash tools/gpu_check.sh   (results in $OUT or ./gpu_check.json)
# Unverified so far: no GPU has been lent to this project yet.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT="${OUT:-.}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
# The machine starts bare: install the package's Python dependencies (torch is expected to be there).
python3 -c "import megatron.core" 2>/dev/null || python3 -m pip install -q "megatron-core==0.19.2" einops psutil pyyaml
timeout 540 python3 tools/gpu_check.py --out "$OUT" "$@"
