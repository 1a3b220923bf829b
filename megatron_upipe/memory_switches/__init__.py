"""Memory switches around megatron-core (the memory.* settings): host offload of checkpointed layer inputs, fully
sharded model states, and the host memory they need. Measured and modelled in memory_accounting/; planned in planner/.

offload.py             HostOffloader: the one device<->host road, with a ledger of host bytes (live, peak, reserved)
pinned_pool.py         its one host buffer per rank: exact size, pinned in place, sliced into the offloaded tensors
host_budget.py         host bytes per rank and node (pool, checkpoint staging, margins); the start-up host check
node_memory.py         what this node can give: /proc/meminfo, cgroup limits, NUMA nodes and the GPUs' NUMA nodes
checkpoint_offload.py  full recompute with the saved layer inputs kept on the host (saved-tensor hooks)
sharding.py            model states (params, fp32 main params, grads, Adam) sharded over dp x cp (Megatron-FSDP)
optimizer_parking.py   the optimizer's own tensors (Adam's moments, fp32 main weights) on the host during each
                       forward/backward, back on the device for the optimizer step

Config -> code: memory.offload_checkpoints -> `build_llama(..., offloader=HostOffloader(pool_bytes=N))`, N from
host_budget.offload_pool_bytes (the stage keeps it as `LlamaStage.offloader`); memory.host_mem_gib -> the start-up
check host_budget.host_memory_refusal; memory.shard_model_states -> `wrap_fully_sharded(module, tconfig)` instead of
megatron-core's DistributedDataParallel, and the optimizer built with `use_distributed_optimizer=True`;
memory.offload_optimizer_states -> `for_optimizer(wrapped, model, optimizer)` (TrainState.parked), entered around
each forward/backward with `parked(...)`.

For the memory planner (rank 0's model on fake tensors): pass `offloader=SimulatedHostOffloader(pool_bytes=N)` (or
the real one: both work on fake tensors and agree) and read `stage.offloader.peak_bytes` (host bytes alive) /
`.reserved_peak_bytes` (host bytes as allocated: the pool); a PeakMemoryTracker then sees device memory only: host
copies are made outside dispatch modes.
"""
