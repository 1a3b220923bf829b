#!/bin/bash
# One node, N GPUs, no Slurm: resolve the config into a run directory, check it, launch one torchrun.
#
#   bash examples/torchrun_single_node.sh [section.key=value ...]
#   CONFIG=examples/configs/tiny_cpu.yaml NPROC_PER_NODE=2 bash examples/torchrun_single_node.sh train.steps=3
#
# Arguments are config overrides: the config resolved with them is written to $RUN_DIR/config.yaml, and that
# file is what every rank reads. Optional environment:
#   CONFIG          config file (default: examples/configs/llama3_8b_upipe_8xh100.yaml)
#   RUN_DIR         run directory (default: runs/<config name>-<date-time>); log.metrics_file and checkpoint.dir
#                   (RUN_DIR/checkpoints) go there: a new launch is a new run; RUN_DIR=<an earlier run> resumes it
#   NPROC_PER_NODE  ranks (default: the GPUs nvidia-smi lists)
#   MASTER_PORT     rendezvous port (default: 29500)
#   VENV            virtual environment to activate if present (default: .venv, made by tools/setup_env.sh;
#                   VENV=none to use the python and torchrun on PATH, e.g. in an NGC container)
#   PYTHON          interpreter that resolves the config (default: python)
#   EXTRA_ARGS      extra pretrain_llama.py flags, e.g. --dry-run to test the launch without training
# The config is checked before torchrun starts, against NPROC_PER_NODE ranks on this machine (--check-machine:
# e.g. dist.backend=nccl without GPUs is refused here, in one line); nothing is written to RUN_DIR unless it passes.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ "$VENV" != none ] && [ -f "$VENV/bin/activate" ]; then source "$VENV/bin/activate"; fi
PYTHON=${PYTHON:-python}
if ! command -v torchrun >/dev/null || ! command -v "$PYTHON" >/dev/null; then
  echo "error: no torchrun/$PYTHON found (VENV=$VENV): create .venv with 'bash tools/setup_env.sh', or set VENV to" \
       "an environment with megatron_upipe installed (VENV=none: the one on PATH)" >&2
  exit 2
fi
CONFIG=${CONFIG:-examples/configs/llama3_8b_upipe_8xh100.yaml}
RUN_DIR=${RUN_DIR:-runs/$(basename "$CONFIG" .yaml)-$(date +%Y%m%d-%H%M%S)}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
if [ "${NPROC_PER_NODE:-0}" -lt 1 ]; then
  echo "error: no GPU found by nvidia-smi: set NPROC_PER_NODE (and dist.backend=gloo for CPU ranks)" >&2
  exit 2
fi
MASTER_PORT=${MASTER_PORT:-29500}
read -r -a train_extra <<<"${EXTRA_ARGS:-}"

source examples/launch_env.sh

# The resolved config, overrides included, is the run's record and its only input: written to a temporary file,
# checked, and only then moved into the run directory.
OVERRIDES=(
  "log.metrics_file=$RUN_DIR/metrics.jsonl"
  "checkpoint.dir=$RUN_DIR/checkpoints"  # checkpoints belong to their run (relaunch with RUN_DIR=... to resume it)
  "$@"
)
resolved=$(mktemp "${TMPDIR:-/tmp}/config.XXXXXX.yaml")
trap 'rm -f "$resolved"' EXIT
"$PYTHON" pretrain_llama.py --config "$CONFIG" "${OVERRIDES[@]}" --print-config >"$resolved"
"$PYTHON" pretrain_llama.py --config "$resolved" --dry-run --world-size "$NPROC_PER_NODE" --check-machine
mkdir -p "$RUN_DIR"
mv "$resolved" "$RUN_DIR/config.yaml"

TORCHRUN_ARGS=(
  --nnodes 1
  --nproc-per-node "$NPROC_PER_NODE"
  --rdzv-backend c10d
  --rdzv-endpoint "localhost:$MASTER_PORT"
  --max-restarts 0
  "${NUMA_ARGS[@]}"  # each rank on its GPU's NUMA node (examples/launch_env.sh)
)
TRAIN_ARGS=(
  --config "$RUN_DIR/config.yaml"
  --status-file "$RUN_DIR/exit_status"  # the job's own exit status: torchrun exits 1 whenever a rank exits non-zero
  "${train_extra[@]}"
)

echo "run dir: $RUN_DIR; $NPROC_PER_NODE ranks"
rm -f "$RUN_DIR/exit_status"
rc=0
torchrun "${TORCHRUN_ARGS[@]}" pretrain_llama.py "${TRAIN_ARGS[@]}" || rc=$?
exit "$(cat "$RUN_DIR/exit_status" 2>/dev/null || echo "$rc")"  # the job's status (5: saved; relaunch to resume)
