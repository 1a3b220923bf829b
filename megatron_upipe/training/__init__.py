"""The training job behind pretrain_llama.py, one concept per module (imports point down this list):

  failures       NaN/inf policy, distributed failures turned into one clear error
  metrics        model FLOPs (causal attention included), MFU, peak memory, the metrics sinks
  setup          torch.distributed (backend, timeout) and megatron-core's process groups
  optim          DDP wrapper, megatron-core optimizer (Adam) and the warmup + decay schedule
  data           tokenizer, datasets and the per-DP-rank, CP-split micro-batch iterators
  checkpointing  atomic save (`latest`, keep_last) and resume with checks: dist_checkpointing (any layout), or
                 per-rank shards for Megatron-FSDP runs (same layout)
  build          everything a run needs, in one TrainState
  loop           train / eval steps on megatron-core's pipeline schedules, the loop itself
"""
