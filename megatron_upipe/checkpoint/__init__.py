"""Checkpoint conversion between HF transformers (Llama, Qwen2/2.5, Qwen3) and our megatron-core checkpoints.

  hf_families  config.json <-> LlamaArch for model_type llama / qwen2 / qwen3 (no torch)
  hf_convert   HF tensors <-> one rank's megatron-core tensors, any TP/PP layout; the completeness check
  hf_io        HF directories: lazy safetensors / .bin reading, sharded safetensors writing, tokenizer files
  sources      what a checkpoint path holds (training / converted / HF) and whether its model fits a run (no torch)
  mcore_io     a one-process tp1/pp1 model; dist_checkpointing loads of the model part
  hf_import    HF directory -> converted checkpoint (tools/convert_hf_llama.py hf-to-mcore), and per-rank loads
  hf_export    converted or training checkpoint -> HF directory (mcore-to-hf)
  fsdp_export  the full parameters of a per-rank Megatron-FSDP checkpoint, by relaunching its layout on CPU
"""
