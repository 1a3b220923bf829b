#!/usr/bin/env bash
# The one prepared script for a lent GPU (device tool), in three parts, each with its own time limit so one failing
# part leaves the others' results (parts 1 and 2 took 73 s and 2 x ~95 s on the lent H200; part 3 has not run yet):
# 1. tools/gpu_check.py (killed at ${GPU_CHECK_S:-300} s): which CUDA attention kernels run here and their numerics
#    against the float64 reference (kernel interface; UPipe/Ulysses with the natural API and with grouped views +
#    W_O + fused input norm in both grad_accum modes), bf16 GEMM rates, the kernel cost of staging (one Llama3-8B
#    layer fwd+bwd at 128K, C = 1: Ulysses vs UPipe U = 1 and U = 16), one layer's peak memory at three lengths
#    (measured vs tracked vs the memory model) and the length-independent terms (CUDA context, one-rank NCCL,
#    fragmentation) as a calibration file for the planner. See tools/gpu_check.py.
# 2. a training run on this one GPU (killed at ${GPU_TRAIN_S:-200} s): tools/gpu_check_train.yaml (four Llama3-8B
#    layers at 128K tokens with the long recipes' memory stack, UPipe at cp=1, memory.plan_check), then the same with
#    Ulysses: the planner's prediction beside torch.cuda.max_memory_allocated, and the step times;
# 3. the pytest tests that run only where CUDA is (tests/test_gpu_training.py, the CUDA kernels of test_kernels.py).
# Results so far: docs/gpu_results.md.
#   bash tools/gpu_check.sh [gpu_check.py options]     # results in $OUT (or .): gpu_check.json,
#                                                     # gpu_calibration.json, train_*.log, train_*_metrics.jsonl,
#                                                     # pytest_gpu.log
# Nothing is downloaded: the device machine has no network. It needs a Python with torch (CUDA); megatron-core for
# part 2 comes from the Python's packages or from wheels carried in .whl/ (installed into /tmp/site); flash-attn and
# TransformerEngine are checked when importable.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT="${OUT:-.}"
mkdir -p "$OUT"
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
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check.sh: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'))"
"$PY" -c 'import megatron.core as m; print("megatron-core", m.__version__)' || echo "gpu_check.sh: no megatron-core"

rc=0
if [ "${GPU_CHECK_S:-300}" -gt 0 ]; then  # GPU_CHECK_S=0: the training part only
  timeout "${GPU_CHECK_S:-300}" "$PY" tools/gpu_check.py --out "$OUT" --budget-s "$(( ${GPU_CHECK_S:-300} - 60 ))" "$@"
  rc=$?
  echo "gpu_check.py: exit $rc"
fi

train() {  # name, overrides...
  local name=$1; shift
  local dir="runs/gpu_check_train_$name"
  rm -rf "$dir"
  timeout "${GPU_TRAIN_S:-200}" "$PY" -m torch.distributed.run --nproc-per-node 1 --master-port 29533 pretrain_llama.py \
    --config tools/gpu_check_train.yaml log.metrics_file="$dir/metrics.jsonl" \
    "$@" >"$OUT/train_$name.log" 2>&1
  local trc=$?
  echo "train $name: exit $trc"; tail -n 25 "$OUT/train_$name.log"
  cp "$dir/metrics.jsonl" "$OUT/train_${name}_metrics.jsonl" 2>/dev/null || true
  [ $trc -eq 0 ] || rc=1
}
train upipe
[ "${GPU_TRAIN_ULYSSES:-1}" = 0 ] || train ulysses parallel.cp_strategy=ulysses parallel.upipe_heads_per_stage=null

# 3. the tests that run only where CUDA is (killed at ${GPU_PYTEST_S:-150} s; GPU_PYTEST_S=0 skips them)
if [ "${GPU_PYTEST_S:-150}" -gt 0 ]; then
  timeout "${GPU_PYTEST_S:-150}" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_training.py tests/test_kernels.py \
    >"$OUT/pytest_gpu.log" 2>&1
  prc=$?
  echo "pytest (CUDA tests): exit $prc"; tail -n 5 "$OUT/pytest_gpu.log"
  [ $prc -eq 0 ] || rc=1
fi
exit $rc
