"""What stops a run, and how it is reported.

NaN/inf (`train.nan_policy`): after the forward-backward of a step, the global loss (reduced over all ranks) and the
global gradient norm (megatron-core's, over the model-parallel group; gradients are already reduced over DP) are
checked *before* the optimizer touches the weights. Every rank sees the same two numbers, so every rank takes the
same decision:
  stop  raise `NonFiniteError` naming the step: the weights and the last checkpoint stay as they were;
  skip  drop the step's gradients, do not call the optimizer (weights and Adam moments unchanged); the step still
        counts (data is consumed and the LR schedule follows the step number), and the metrics record `skipped`.

Distributed failures: a peer that died or stopped answering surfaces as an exception from a collective
(`DistBackendError`, or gloo's RuntimeError on timeout / closed connection). `as_distributed_failure` turns it into
`DistributedFailure`, whose message names the rank, the step and `dist.timeout_s`.
"""

from __future__ import annotations

import math

import torch


class NonFiniteError(RuntimeError):
    """A step produced a non-finite loss or gradient norm and train.nan_policy=stop."""

    def __init__(self, step: int, loss: float, grad_norm: float | None):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(f"step {step}: non-finite {'loss' if not math.isfinite(loss) else 'gradient'} "
                         f"(loss={loss}, grad_norm={grad_norm}); stopped before the optimizer step, weights "
                         f"unchanged (train.nan_policy=stop; set train.nan_policy=skip to skip such steps)")


class DistributedFailure(RuntimeError):
    """A collective failed: another rank died, or stopped answering for longer than dist.timeout_s."""


def is_finite(*values: float | None) -> bool:
    return all(v is None or math.isfinite(v) for v in values)


def check_step(step: int, loss: float, grad_norm: float | None, policy: str) -> bool:
    """True when the step may update the weights; False to skip it; raises NonFiniteError for policy=stop."""
    if is_finite(loss, grad_norm):
        return True
    if policy == "stop":
        raise NonFiniteError(step, loss, grad_norm)
    if policy == "skip":
        return False
    raise ValueError(f"train.nan_policy={policy!r} is unknown")


_DIST_MARKERS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "gloo",
                 "nccl", "socket", "peer")


def as_distributed_failure(exc: BaseException, rank: int, step: int, timeout_s: int) -> DistributedFailure | None:
    """A `DistributedFailure` describing `exc` if it came from a collective, else None."""
    dist_error = getattr(torch.distributed, "DistBackendError", ())
    text = str(exc).lower()
    if not (isinstance(exc, dist_error) or (isinstance(exc, RuntimeError) and any(m in text for m in _DIST_MARKERS))):
        return None
    return DistributedFailure(
        f"rank {rank}, step {step}: a collective failed - another rank died or did not answer within "
        f"dist.timeout_s={timeout_s}s; the job stops. Cause: {type(exc).__name__}: {str(exc).strip()[:500]}")
