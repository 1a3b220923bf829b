#!/bin/bash
# The environment every launcher (examples/torchrun_single_node.sh, examples/slurm/launch.sh) gives the ranks;
# sourced, each value only where the caller's environment does not set it already. The job does not depend on it:
# pretrain_llama.py sets NCCL_NVLS_ENABLE, TORCH_NCCL_ASYNC_ERROR_HANDLING, PYTORCH_CUDA_ALLOC_CONF (from
# memory.expandable_segments) and, where its config needs it, CUDA_DEVICE_MAX_CONNECTIONS itself, the same way
# (megatron_upipe/training/node_env.py), before anything touches CUDA; what is set here counts as the user's.
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # as memory.expandable_segments
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron-core's comm/compute ordering (the job alone sets it only for tp > 1 or TE's context parallelism)
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a failed collective ends the job
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLS multicast buffers cost GBs per communicator; all-to-all never uses them (the planner's NCCL margin follows this: 1 plans nvswitch-nvls)
