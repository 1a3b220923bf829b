"""The closed-form attention memory model against the storage-tracking dispatch mode, and its U/H scaling.

Tracked runs use real CPU tensors and torch's fake process group (one process plays rank 0 of C), so the peaks
are byte-exact for the real code path; numerics are covered by test_attention_numerics.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_upipe.attention import legal_heads_per_stage
from megatron_upipe.memory_accounting.attention_model import AttentionShape, attention_memory, chunked_bytes
from megatron_upipe.memory_accounting.measure import measure_attention_peak
from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
from tests.dist_helper import run_on_ranks

# (N, b, D, H, G, d, C, dtype bytes, rotary dim): GQA g=4 and g=8 with KV replication, MHA in float64, bf16 with
# float32 accumulators, partial and no RoPE, C = 1, 2, 4.
SHAPES = [
    AttentionShape(512, 1, 256, 32, 8, 32, 1, 4),
    AttentionShape(512, 1, 256, 32, 8, 32, 2, 4),
    AttentionShape(512, 1, 256, 32, 8, 32, 4, 2),
    AttentionShape(512, 1, 1024, 32, 8, 32, 2, 2),
    AttentionShape(256, 2, 128, 16, 2, 16, 4, 4, rotary_dim=8),
    AttentionShape(128, 1, 64, 8, 8, 16, 2, 8, rotary_dim=0),
]


def _measure_all(rank, world_size):
    # runs alone in a fresh process (the fake process group must be the only one)
    torch.distributed.destroy_process_group()
    out = []
    for shape in SHAPES:
        for U in legal_heads_per_stage(shape.num_heads, shape.num_kv_heads, shape.cp) + ["ulysses"]:
            uly = U == "ulysses"
            out.append((shape, U, measure_attention_peak(shape, None if uly else U, uly)))
    return out


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(_measure_all, 1)[0]


def test_model_predicts_tracked_peak_within_1_percent(measured):
    assert len(measured) >= 30
    worst = 0.0
    for shape, U, tracked in measured:
        uly = U == "ulysses"
        est = attention_memory(shape, None if uly else U, uly)
        err = abs(est.peak_bytes - tracked) / tracked
        worst = max(worst, err)
        assert err < 0.01, f"{shape} U={U}: model {est.peak_bytes} vs tracked {tracked} ({est.phase})"
    assert worst < 0.01


def test_upipe_smallest_u_saves_memory_over_ulysses(measured):
    by = {}
    for shape, U, tracked in measured:
        by.setdefault(shape, {})[U] = tracked
    for shape, peaks in by.items():
        smallest = min(u for u in peaks if u != "ulysses")
        assert peaks[smallest] < peaks["ulysses"], shape
        if shape.cp > 1:  # the tracked saving is at least a third for every multi-rank shape here
            assert peaks[smallest] < 0.67 * peaks["ulysses"], (shape, peaks)


def test_chunked_intermediates_scale_with_u_over_h():
    shape = AttentionShape(1 << 20, 1, 4096, 32, 8, 128, 8, 2)  # Llama3-8B attention at 1M tokens, C = 8
    full = chunked_bytes(attention_memory(shape, ulysses=True))
    for U in legal_heads_per_stage(32, 8, 8):
        est = attention_memory(shape, U)
        assert est.phase == "bwd: attention backward"
        assert chunked_bytes(est) * 32 == full * U, U


def test_tracker_counts_new_storage_only():
    x = torch.randn(1000)  # made before tracking: invisible
    with PeakMemoryTracker() as mem:
        v = x.view(10, 100)  # view: nothing
        x.add_(1)  # in place: nothing
        y = x * 2  # 4000 bytes
        torch.mul(x, 2, out=y)  # out=: nothing
        z = torch.empty(250, dtype=torch.float64)  # 2000 bytes
        assert mem.live_bytes == 6000
        del y
        assert mem.live_bytes == 2000
        del z, v
    assert mem.peak_bytes == 6000 and mem.live_bytes == 0
