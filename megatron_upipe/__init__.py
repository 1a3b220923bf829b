"""megatron_upipe: UPipe (Untied Ulysses) context parallelism for megatron-core.

Subpackages:
  attention  the UPipe and Ulysses attention ops (pure torch + torch.distributed; never imports training code)
  memory     peak-memory tracking and the closed-form memory model of the attention ops
"""

__version__ = "0.1.0"
