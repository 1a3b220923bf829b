"""Checkpoint conversion between HF transformers and our megatron-core (dist_checkpointing) checkpoints."""
