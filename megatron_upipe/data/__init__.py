"""Data: tokenizers, preprocessing into megatron-core indexed datasets, and GPT dataset/batch construction.

  tokenizers          the Tokenizer interface, sentencepiece and HF `tokenizers` implementations, fingerprints
  tokenizer_training  training the shipped sentencepiece model
  documents           what one document is in a JSONL or text input file
  preprocess          input files -> `<prefix>_<key>_document.{bin,idx}` (megatron-core IndexedDataset)
  datasets            train/valid/test GPTDatasets (or mock) and the resumable per-DP-rank micro-batch iterator
  packing             packed documents: cu_seqlens from reset position ids, in-document positions of a token range
"""
