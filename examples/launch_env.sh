#!/bin/bash
# The environment every launcher (examples/torchrun_single_node.sh, examples/slurm/launch.sh) gives the ranks;
# sourced, each value only where the caller's environment does not set it already. The job does not depend on it:
# pretrain_llama.py sets NCCL_NVLS_ENABLE, TORCH_NCCL_ASYNC_ERROR_HANDLING, PYTORCH_CUDA_ALLOC_CONF (from
# memory.expandable_segments) and, where its config needs it, CUDA_DEVICE_MAX_CONNECTIONS itself, the same way
# (megatron_upipe/training/node_env.py), before anything touches CUDA; what is set here counts as the user's.
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # as memory.expandable_segments
# CUDA_DEVICE_MAX_CONNECTIONS is left to the job: 1 for tensor parallelism or TE's context parallelism, CUDA's
# default elsewhere (Megatron-FSDP wants several queues; training/node_env.py). Set here, it would count as yours.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a failed collective ends the job
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLS multicast buffers cost GBs per communicator; all-to-all never uses them (the planner's NCCL margin follows this: 1 plans nvswitch-nvls)

# NUMA: each rank runs on the NUMA node of its GPU (torchrun --numa-binding=node binds its CPUs there; Linux's local
# allocation then takes its host memory, the pinned offload pool included, from that node too, which the job's
# per-NUMA-node host check assumes). NUMA_BINDING=none turns it off, =socket|exclusive|core-complex picks another of
# torchrun's modes. Left out, with a line saying why, without GPUs, without numactl, or with a torchrun that has no
# --numa-binding (older torch). The launchers add "${NUMA_ARGS[@]}" to torchrun's arguments.
NUMA_ARGS=()
if [ "${NUMA_BINDING:-node}" != none ]; then
  if [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)" -eq 0 ]; then
    echo "launch: no NUMA binding: no GPU listed by nvidia-smi" >&2
  elif ! command -v numactl >/dev/null; then
    echo "launch: no NUMA binding: numactl is not installed (torchrun --numa-binding needs it)" >&2
  elif ! torchrun --help 2>/dev/null | grep -q -- '--numa-binding'; then
    echo "launch: no NUMA binding: this torchrun has no --numa-binding (a newer torch has it)" >&2
  else
    NUMA_ARGS=(--numa-binding "${NUMA_BINDING:-node}")
  fi
fi
