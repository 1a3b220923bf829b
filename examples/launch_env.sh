#!/bin/bash
# The environment every launcher (examples/torchrun_single_node.sh, examples/slurm/launch.sh) gives the ranks;
# sourced, each value only where the caller's environment does not set it already.
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # as memory.expandable_segments
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron-core's comm/compute ordering
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a failed collective ends the job
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLS multicast buffers cost GBs per communicator; all-to-all never uses them (the planner's NCCL margin assumes off)
