"""Memory switches around megatron-core: host offload of checkpointed layer inputs, fully sharded model states.

offload.py             HostOffloader: the one device<->host road, with a ledger of host bytes (live, peak)
checkpoint_offload.py  full recompute with the saved layer inputs kept on the host (saved-tensor hooks)
sharding.py            model states (params, fp32 main params, grads, Adam) sharded over dp x cp (Megatron-FSDP)
"""
