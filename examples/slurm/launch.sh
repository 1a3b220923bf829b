#!/bin/bash
# The body of every batch script in examples/slurm/: sourced by them after their #SBATCH lines, with CONFIG set to
# their default config, in the batch step (first node), with the job's arguments (config overrides).
#
# Submit from the repository root (or set REPO_DIR). Arguments are config overrides: the config resolved with them
# is written to $RUN_DIR/config.yaml, and that file is what every rank reads. Optional environment (sbatch
# passes the submitting shell's environment to the job):
#   CONFIG          config file (default: the batch script's)
#   RUN_DIR         run directory (default: runs/$SLURM_JOB_NAME-$SLURM_JOB_ID); log.metrics_file and checkpoint.dir
#                   (RUN_DIR/checkpoints) go there: a requeued job (same id) resumes its run; to continue a run in a
#                   new job, submit with RUN_DIR=<that run's directory>
#   NPROC_PER_NODE  ranks per node (default: $SLURM_GPUS_ON_NODE, else 8)
#   MASTER_PORT     rendezvous port on the first node (default: 20000 + job id mod 10000)
#   VENV            virtual environment to activate if present (default: .venv; VENV=none for none)
#   PYTHON          interpreter that resolves the config on the batch node (default: python)
#   SRUN_EXTRA_ARGS extra srun flags, e.g. "--container-image=IMAGE --container-mounts=$PWD:$PWD" (pyxis)
#   EXTRA_ARGS      extra pretrain_llama.py flags, e.g. --dry-run to test the launch without training
#   REQUEUE         1: when the job saved and stopped (exit 5: its deadline, or a signal), requeue it with
#                   `scontrol requeue` (submit with `sbatch --requeue`); the requeued job keeps its id and run dir
# Exit status: the job's own (pretrain_llama.py's, from RUN_DIR/exit_status): 5 means saved, resubmit to resume.
# One torchrun per node (srun --ntasks-per-node=1), c10d rendezvous on the first node: each node's ranks are
# consecutive, so megatron-core's rank order (tp fastest, then cp) keeps a TP group, and under parallel.cp_ring the
# all-to-all group of tp·cp/cp_ring ranks, inside one node when that many divide the ranks per node (the training
# log's "context parallel on N node(s)" line says where they landed).
# Time limit: the job reads its end time and, after each step, saves and stops (exit 5) when another step and a
# save would not fit before it (training/deadline.py: steps of hours make a late signal useless); resubmitting with
# RUN_DIR=<this run> resumes. SIGUSR1 600 s before the limit (--signal) stays as a backstop: the ranks finish the
# step in progress, save and exit 5 if the rest of the step fits in it (torchrun's --shutdown-timeout below).
set -euo pipefail

REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$REPO_DIR"
if [ ! -f pretrain_llama.py ]; then
  echo "error: $REPO_DIR is not the megatron_upipe repository: submit from its root or set REPO_DIR" >&2
  exit 2
fi
VENV=${VENV:-.venv}
if [ "$VENV" != none ] && [ -f "$VENV/bin/activate" ]; then source "$VENV/bin/activate"; fi
PYTHON=${PYTHON:-python}
CONFIG=${CONFIG:?the batch script sets the default config}
RUN_DIR=${RUN_DIR:-runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
read -r -a srun_extra <<<"${SRUN_EXTRA_ARGS:-}"
read -r -a train_extra <<<"${EXTRA_ARGS:-}"

source examples/launch_env.sh

# The resolved config, overrides included, is the run's record and its only input.
mkdir -p "$RUN_DIR"
OVERRIDES=(
  "log.metrics_file=$RUN_DIR/metrics.jsonl"
  "checkpoint.dir=$RUN_DIR/checkpoints"  # checkpoints belong to their run (relaunch with RUN_DIR=... to resume it)
  "$@"
)
"$PYTHON" pretrain_llama.py --config "$CONFIG" "${OVERRIDES[@]}" --print-config >"$RUN_DIR/config.yaml"
# Refuse a bad config here, once, before any node starts (and log the plan).
"$PYTHON" pretrain_llama.py --config "$RUN_DIR/config.yaml" --dry-run --world-size $((SLURM_NNODES * NPROC_PER_NODE))

SRUN_ARGS=(
  --nodes="$SLURM_NNODES"
  --ntasks-per-node=1
  --cpus-per-task="$SLURM_CPUS_ON_NODE"
  --kill-on-bad-exit=1
  "${srun_extra[@]}"
)
TORCHRUN_ARGS=(
  --nnodes "$SLURM_NNODES"
  --nproc-per-node "$NPROC_PER_NODE"
  --rdzv-id "$SLURM_JOB_ID"
  --rdzv-backend c10d
  --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
  --max-restarts 0
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1  # pass --signal's SIGUSR1 on to the ranks, not die of it
  --shutdown-timeout 600  # then give them that long to save before SIGKILL (torchrun's default: 30 s)
  "${NUMA_ARGS[@]}"  # each rank on its GPU's NUMA node (examples/launch_env.sh)
)
TRAIN_ARGS=(
  --config "$RUN_DIR/config.yaml"
  --status-file "$RUN_DIR/exit_status"  # the job's own exit status: torchrun exits 1 whenever a rank exits non-zero
  "${train_extra[@]}"
)

echo "run dir: $RUN_DIR; $SLURM_NNODES node(s) x $NPROC_PER_NODE ranks; rendezvous $MASTER_ADDR:$MASTER_PORT"
rm -f "$RUN_DIR/exit_status"
srun_rc=0
srun "${SRUN_ARGS[@]}" torchrun "${TORCHRUN_ARGS[@]}" pretrain_llama.py "${TRAIN_ARGS[@]}" || srun_rc=$?
# The batch script's exit status is the job's (5: saved, resubmit to resume), or srun's when no rank got to say it.
status=$(cat "$RUN_DIR/exit_status" 2>/dev/null || echo "$srun_rc")
if [ "$status" = 5 ] && [ "${REQUEUE:-0}" = 1 ]; then
  echo "saved and stopped (exit 5): requeueing job $SLURM_JOB_ID (REQUEUE=1); it resumes from $RUN_DIR"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
