"""Bad input to the attention ops raises a ValueError naming the values and the fix, on every rank, before any
communication (all-to-all is replaced by a function that fails loudly if it is ever reached)."""

from __future__ import annotations

import pytest
import torch

from megatron_upipe.attention import KERNELS, legal_heads_per_stage, make_schedule, ulysses_attention, upipe_attention
from megatron_upipe.attention.reference import rope_angles
from tests.dist_helper import run_on_ranks


def _args(H=8, G=2, d=8, s=4, b=1, D=16, C=2, dtype=torch.float32, rot=True):
    x = torch.randn(s, b, D, dtype=dtype)
    w = [torch.randn(n * d, D, dtype=dtype) for n in (H, G, G)]
    kw = dict(num_heads=H, num_kv_heads=G, rotary_pos_emb=rope_angles(s * C, d) if rot else None)
    return x, w, kw


# (description, builder of (x, weights, kwargs, extra upipe kwargs), expected substrings)
BAD = [
    ("U not a multiple of C", lambda: (*_args(), {"heads_per_stage": 3}), ["heads_per_stage=3", "multiple of the cp size 2", "legal"]),
    ("H not divisible by U", lambda: (*_args(H=12, G=2), {"heads_per_stage": 8}), ["num_heads=12", "heads_per_stage=8"]),
    ("H not divisible by C", lambda: (*_args(H=9, G=3), {}), ["num_heads=9", "context-parallel size 2"]),
    ("H not a multiple of H_kv", lambda: (*_args(H=8, G=3), {}), ["num_heads=8", "num_kv_heads=3"]),
    ("rotary length != N (N not C*s)", lambda: (_args()[0], _args()[1], {**_args()[2], "rotary_pos_emb": rope_angles(7, 8)}, {}),
     ["rotary_pos_emb", "N = 2 ranks x 4 local tokens = 8", "cp size"]),
    ("odd rotary dim", lambda: (_args()[0], _args()[1], {**_args()[2], "rotary_pos_emb": rope_angles(8, 8)[..., :5]}, {}), ["rot_dim=5", "even"]),
    ("w_k rows do not match H_kv", lambda: (_args()[0], [_args()[1][0], torch.randn(24, 16), torch.randn(16, 16)], _args()[2], {}),
     ["w_k and w_v", "[16, 16]"]),
    ("x not sequence-first 3D", lambda: (torch.randn(4, 16), _args()[1], _args()[2], {}), ["[s, b, D]"]),
    ("dtype mismatch", lambda: (_args()[0].double(), _args()[1], _args()[2], {}), ["w_q is torch.float32", "x is torch.float64"]),
    ("kernel on the wrong device", lambda: (*_args(), {"kernel": "sdpa_flash"}), ["sdpa_flash", "runs on cuda"]),
    ("unknown kernel", lambda: (*_args(), {"kernel": "magic"}), ["'magic' is unknown", "cpu_flash"]),
]


def _bad_inputs_on_rank(rank, world_size):
    def forbidden(*a, **k):
        raise RuntimeError("communication attempted before validation")

    torch.distributed.all_to_all_single = forbidden
    messages = []
    for desc, build, expected in BAD:
        x, w, kw, extra = build()
        for fn in (upipe_attention, ulysses_attention):
            extra_fn = extra if fn is upipe_attention else {k: v for k, v in extra.items() if k != "heads_per_stage"}
            if fn is ulysses_attention and "heads_per_stage" in extra:
                continue
            with pytest.raises(ValueError) as info:
                fn(x, *w, cp_group=torch.distributed.group.WORLD, **kw, **extra_fn)
            msg = str(info.value)
            missing = [e for e in expected if e not in msg]
            assert not missing, f"{desc}: {missing} not in {msg!r}"
            messages.append(msg)
    return len(messages)


def test_bad_inputs_raise_before_communication_on_every_rank():
    counts = run_on_ranks(_bad_inputs_on_rank, 2)
    assert counts[0] == counts[1] >= 18


def test_schedule_errors_and_legal_values():
    assert legal_heads_per_stage(32, 8, 4) == [4, 8, 16, 32]
    assert legal_heads_per_stage(8, 2, 4) == [4, 8]  # KV heads replicated twice
    with pytest.raises(ValueError, match=r"heads_per_stage=12.*legal heads_per_stage values for these shapes: \[4, 8, 16, 32\]"):
        make_schedule(32, 8, 4, 12)
    with pytest.raises(ValueError, match="must all be positive"):
        make_schedule(8, 2, 0)


def test_kernel_head_dim_limits_are_reported():
    reason = KERNELS["sdpa_flash"].unsupported_reason("cuda", torch.bfloat16, 320)
    assert reason is not None and "head dim 320" in reason and "<= 256" in reason
    reason = KERNELS["sdpa_flash"].unsupported_reason("cuda", torch.float32, 128)
    assert reason is not None and "dtype" in reason
    assert KERNELS["cpu_flash"].unsupported_reason("cpu", torch.bfloat16, 100) is None
