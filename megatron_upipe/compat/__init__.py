"""Adapters between megatron_upipe and its host stack: `cpu` (megatron-core without a GPU), `mcore` (version shims),
`fsdp` (Megatron-FSDP under fake tensors and the storage tracker)."""
