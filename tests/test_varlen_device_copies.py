"""Packed documents and ring RoPE rows make no host->device copy per op call (issue 23).

A copy from pageable host memory to the GPU makes the host wait for the stream, so one per layer call (and again
in the recomputed forward) stalls the pipeline every layer. The copies are counted without a GPU: on fake CUDA
tensors (FakeTensorMode, as tests/test_cuda_contracts.py) a dispatch mode records every aten call that takes a
non-scalar CPU tensor and returns a CUDA one: `aten._to_copy` to the device (what torch.tensor(..., device=cuda) and
.to(cuda) do) and `aten.index` of a CUDA tensor by a host index (which copies the index).

1. The op (UPipe, one rank, sdpa_flash's varlen call) run as three layers, forward and backward, on one sequence of
   packed documents: given the `varlen.Documents` made once, the calls copy nothing (making them: one copy); given
   the cu_seqlens tensor, each call copies it (what the model did per layer before). The op's head index tensors
   are made once per (schedule, device) for real tensors (upipe._stage_indices) but afresh for fake ones, so the
   test keeps them as real CUDA tensors are kept, and counts after a first call.
2. The model's `_op_documents`: three layers and a recomputed forward with one DocumentPackedSeqParams (the
   training step's) get the same Documents, made with one copy; a plain PackedSeqParams, or a single document,
   keeps the tensor; a Documents made for another N or device is refused in one line.
3. Hybrid a2a x ring given the RoPE angles of all N positions: `_prepare` takes this rank's zigzag rows without a
   copy, and `_zigzag_rows` gives exactly the rows at `layout.local_positions` for every a2a and ring rank of
   several layouts.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

H, G, d, Dm, N = 4, 2, 8, 16, 24
CUDA = torch.device("cuda")


class HostToDevice(TorchDispatchMode):
    """Records the aten calls that move a (non-scalar) CPU tensor's values onto a CUDA tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        host_in = any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0
                      for t in tree_leaves((args, kwargs)))
        if host_in and any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tree_leaves(out)):
            self.copies.append(str(func))
        return out


def _cu() -> torch.Tensor:
    return torch.tensor([0, 5, 6, 17, 24], dtype=torch.int32)  # 4 documents of N = 24 tokens, on the host


def _layer(x, weights, cu_seqlens):
    """One layer's op, forward and its backward function (the autograd engine cannot run on fake CUDA)."""
    from megatron_upipe.attention.api import upipe_attention

    out = upipe_attention(x, *weights, num_heads=H, num_kv_heads=G, cp_group=None, heads_per_stage=2,
                          cu_seqlens=cu_seqlens, kernel="sdpa_flash")
    with torch.no_grad():
        out.grad_fn.apply(torch.empty(out.shape, device=out.device, dtype=out.dtype))


def test_op_given_documents_copies_nothing_per_layer(monkeypatch):
    from megatron_upipe.attention import upipe
    from megatron_upipe.attention.varlen import documents
    from tests.upipe_seams import OP_MODULES

    kept, build = {}, upipe._build_indices

    def stage_indices(sched, like):  # the op's head index tensors, kept per schedule as for real CUDA tensors
        if sched not in kept:
            kept[sched] = build(sched, like.device)
        return kept[sched]

    for module in OP_MODULES:  # the op's code spans attention/upipe*.py (tests/upipe_seams.py)
        if "_stage_indices" in vars(module):
            monkeypatch.setattr(module, "_stage_indices", stage_indices)
    cu = _cu()
    with FakeTensorMode(allow_non_fake_inputs=True):
        mk = dict(device=CUDA, dtype=torch.bfloat16)
        x = torch.empty(N, 1, Dm, **mk).requires_grad_()
        weights = [torch.empty(h * d, Dm, **mk).requires_grad_() for h in (H, G, G)]
        with HostToDevice() as made:
            docs = documents(cu, N, 1, CUDA)
        _layer(x, weights, docs)  # the first call of the process makes the head index tensors
        with HostToDevice() as reused:
            for _ in range(3):
                _layer(x, weights, docs)
        with HostToDevice() as per_call:
            for _ in range(3):
                _layer(x, weights, cu)
    assert docs.cu_seqlens.device.type == "cuda"
    assert len(made.copies) == 1, made.copies
    assert reused.copies == [], f"three layers given the Documents copied {reused.copies}"
    assert len(per_call.copies) == 3, per_call.copies  # the tensor: copied by every call


def test_model_makes_the_documents_once_per_micro_batch():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_upipe.attention.varlen import Documents
    from megatron_upipe.data.packing import packed_seq_params
    from megatron_upipe.models.upipe_attention import _op_documents

    cu, one = _cu(), torch.tensor([0, N], dtype=torch.int32)
    params, single = packed_seq_params(cu), packed_seq_params(one)  # the training step's, one per micro-batch
    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(N // 2, 1, Dm, device=CUDA, dtype=torch.bfloat16)  # this rank's s/C tokens, C = 2
        with HostToDevice() as h2d:
            got = [_op_documents(params, cu, x, 2) for _ in range(4)]  # three layers and a recomputed one
        assert _op_documents(plain, cu, x, 2) is cu
        assert _op_documents(single, one, x, 2) is one
    assert isinstance(got[0], Documents) and all(g is got[0] for g in got)
    assert got[0].bounds == tuple(cu.tolist()) and got[0].cu_seqlens.device.type == "cuda"
    assert len(h2d.copies) == 1, h2d.copies


def test_documents_of_another_sequence_or_device_are_refused():
    from megatron_upipe.attention.varlen import documents

    docs = documents(_cu(), N, 1, torch.device("cpu"))
    assert documents(docs, N, 1, torch.device("cpu")) is docs
    with pytest.raises(ValueError, match=r"ends at 24 but the packed sequence has N = C·s = 48 tokens"):
        documents(docs, 2 * N, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="holds its boundaries on cpu but x is on cuda"):
        documents(docs, N, 1, CUDA)
    with pytest.raises(ValueError, match="micro-batch must be 1"):
        documents(docs, N, 2, torch.device("cpu"))


# ------------------------------------------------------------------------------------- ring RoPE rows
@pytest.mark.parametrize("Nt,C,R", [(8, 1, 2), (24, 2, 2), (48, 4, 2), (48, 2, 3), (64, 4, 4), (32, 1, 4)])
def test_zigzag_rows_are_the_rows_at_local_positions(Nt, C, R):
    from megatron_upipe.attention.api import _zigzag_rows
    from megatron_upipe.attention.layout import local_positions

    rows = torch.randn(Nt, 1, 1, 4)
    for a in range(C):
        for r in range(R):
            assert torch.equal(_zigzag_rows(rows, a, C, r, R), rows[local_positions(Nt, a, C, r, R)]), (a, r)


def test_ring_rope_rows_need_no_copy(monkeypatch):
    """`_prepare` of rank (a = 0, r = 1) of a2a groups of 1 and a ring of 2, whose group is a stand-in: only its size
    and this rank's place in it are read before any communication."""
    from megatron_upipe.attention import api

    ring = object()
    monkeypatch.setattr(api, "group_size", lambda group: 2 if group is ring else 1)
    monkeypatch.setattr(api.dist, "get_rank", lambda group: 1 if group is ring else 0)
    s, rot = 6, 4  # N = 12 global positions, 6 on each ring rank
    with FakeTensorMode(allow_non_fake_inputs=True):
        mk = dict(device=CUDA, dtype=torch.bfloat16)
        x = torch.empty(s, 1, Dm, **mk)
        w_q, w_k, w_v = torch.empty(G, H // G, d, Dm, **mk), torch.empty(G, d, Dm, **mk), torch.empty(G, d, Dm, **mk)
        rope = torch.empty(2 * s, 1, 1, rot, device=CUDA)  # the angles of all N positions, on the device
        with HostToDevice() as h2d:
            _, (cos, _) = api._prepare(x, w_q, w_k, w_v, None, None, rope, True, None, "sdpa_flash", ring_group=ring)
    assert tuple(cos.shape) == (s, rot // 2) and cos.device.type == "cuda"
    assert h2d.copies == [], f"_prepare copied host tensors to the device: {h2d.copies}"
