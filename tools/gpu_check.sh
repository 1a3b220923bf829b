#!/usr/bin/env bash
# The one prepared script for a lent GPU (device tool): which CUDA attention kernels run here and their numerics
# against the float64 reference (kernel interface; UPipe/Ulysses with the natural API and with grouped views +
# W_O + fused input norm in both grad_accum modes), one Llama3-8B layer's peak memory at three lengths (measured
# vs tracked vs the memory model), and the length-independent terms (CUDA context, one-rank NCCL, fragmentation)
# as a calibration file for the planner, and the kernel cost of staging (one layer fwd+bwd at 128K, C = 1: Ulysses vs
# UPipe U = 1 and U = 16). See tools/gpu_check.py for the checks and the calibration format.
# At most 8 minutes: the Python part is killed at 480 s and stops starting memory runs at 420 s (--budget-s).
#   bash tools/gpu_check.sh [gpu_check.py options]     # results in $OUT (or .): gpu_check.json, gpu_calibration.json
# Nothing is installed: the device machine has no network. It needs a Python with torch (CUDA); flash-attn and
# TransformerEngine are checked when importable. gpu_check.py imports only torch and this checkout.
# Unverified so far: no GPU has been lent to this project yet.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT="${OUT:-.}"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
  if [ -n "$cand" ] && "$cand" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check.sh: no Python with torch and a visible CUDA device (tried \$PYTHON, .venv/bin/python, python3); set PYTHON" >&2
  exit 2
fi
echo "gpu_check.sh: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'))"
timeout 480 "$PY" tools/gpu_check.py --out "$OUT" "$@"
