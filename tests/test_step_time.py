"""The step-time model (megatron_upipe/planner/step_time.py): the work the planner counts on its fake run equals
FLOPs written here and all-to-all bytes measured on a real gloo run of the op; the model prices it as documented;
the calibration recovers known efficiencies; and its time never falls as UPipe's U shrinks (what `auto` relies on).
The calibration against the paper is tools/step_time_report.py (its table is in the README)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_upipe.config import load_config
from tests.dist_helper import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
VOCAB, N, C = 256, 512, 2
L, D, H, G, d, FFN = 2, 64, 8, 2, 8, 160  # tiny-gqa
BASE = ["model.preset=tiny-gqa", f"parallel.cp={C}", f"train.seq_length={N}", "train.bf16=false",
        f"model.vocab_size={VOCAB}", "data.path=mock", "dist.backend=gloo", "train.micro_batch_size=1"]
STRATEGIES = {"ulysses": ["parallel.cp_strategy=ulysses"],
              **{f"upipe:{u}": ["parallel.cp_strategy=upipe", f"parallel.upipe_heads_per_stage={u}"] for u in (2, 4, 8)}}


def _simulate(extra):
    """Each strategy's counted work, planned with `extra` overrides (the planner makes its own fake world)."""
    from megatron_upipe.planner.simulate import simulate_step

    return {name: simulate_step(load_config(None, BASE + over + extra), C, VOCAB).work
            for name, over in STRATEGIES.items()}


TP_CASE = ["model.preset=tiny-gqa", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=1",
           f"train.seq_length={N}", "train.bf16=false", f"model.vocab_size={VOCAB}", "data.path=mock",
           "dist.backend=gloo", "train.micro_batch_size=1"]


def _simulate_cpu_and_gpu(rank, world_size):
    from megatron_upipe.planner.simulate import simulate_step

    torch.distributed.destroy_process_group()  # the planner makes its own fake one
    return _simulate([]), _simulate(["dist.backend=nccl"]), simulate_step(load_config(None, TP_CASE), 2, VOCAB).work


@pytest.fixture(scope="module")
def works():
    """The strategies' counted work planned for this CPU and for a GPU run (dist.backend=nccl): one spawn."""
    return run_on_ranks(_simulate_cpu_and_gpu, 1)[0]


@pytest.fixture(scope="module")
def work(works):
    return works[0]


def _sent_bytes(rank, world_size):
    """Bytes this rank sends in one forward and one backward of the op (real tensors, gloo), per strategy."""
    from megatron_upipe.attention import api
    from megatron_upipe.attention.reference import rope_angles
    from megatron_upipe.benchmarks.attention import count_sent_bytes

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N // C, 1, D, generator=gen, requires_grad=True)
    ws = [torch.randn(n * d, D, generator=gen, requires_grad=True) for n in (H, G, G)]
    freqs = rope_angles(N, d)[rank * N // C:(rank + 1) * N // C]
    out = {}
    for name in STRATEGIES:
        kw = dict(num_heads=H, num_kv_heads=G, cp_group=torch.distributed.group.WORLD, rotary_pos_emb=freqs)
        sent = {}
        with count_sent_bytes(sent, "fwd"):
            y = (api.ulysses_attention(x, *ws, **kw) if name == "ulysses" else
                 api.upipe_attention(x, *ws, heads_per_stage=int(name.split(":")[1]), **kw))
        with count_sent_bytes(sent, "bwd"):
            torch.autograd.grad(y, [x, *ws], torch.ones_like(y))
        out[name] = sent["fwd"] + sent["bwd"]
    return out


def test_counted_flops_and_bytes_equal_the_model_written_here_and_a_real_run(work):
    s = N // C  # tokens per rank before the seq->head all-to-all
    qkv = 2 * s * D * (H + 2 * G) * d  # forward FLOPs of the fused QKV projection, one layer
    layer = qkv + 2 * s * H * d * D + 2 * s * D * 2 * FFN + 2 * s * FFN * D  # + W_O, gated fc1, fc2
    forward = L * layer + 2 * s * D * VOCAB  # + LM head
    gemm = 3 * forward  # backward: the input and the weight gradient of every product
    pairs = N * (N + 1) // 2  # causal (query, key) pairs of the full sequence, after the seq->head all-to-all
    attention = L * (4 + 10) * (H // C) * d * pairs  # per rank: H/C heads; forward 2 products, backward 5
    sent = run_on_ranks(_sent_bytes, C)[0]
    for name, w in work.items():
        # UPipe's backward projects each stage's Q/K/V again instead of keeping them: one more QKV forward a layer
        assert w["flops:gemm"] == gemm + (L * qkv if name != "ulysses" else 0), name
        assert w["flops:attention"] == attention, name
        assert w["bytes:alltoall:nvlink"] == L * sent[name], name
        assert w["calls:attention"] == L * 2 * (1 if name == "ulysses" else H // int(name.split(":")[1])), name
        # the results going back to sequence layout: forward the output, backward dq, [s, H·d] float32 a layer each
        for result in ("forward", "backward"):
            assert w[f"bytes:a2a_result_{result}:nvlink"] == L * s * H * d * 4 * (C - 1) // C, (name, result)
    assert not any(k.endswith(":ib") for w in work.values() for k in w)  # 2 ranks: one node


def test_gpu_kernel_stand_ins_count_the_same_attention_work(works):
    """Planning a GPU run (dist.backend=nccl: the SDPA flash stand-in, which computes nothing) counts the same FLOPs
    as the CPU kernel that really runs."""
    work, gpu, _ = works
    for name in STRATEGIES:
        assert gpu[name]["flops:attention"] == work[name]["flops:attention"], name
        assert gpu[name]["calls:attention"] == work[name]["calls:attention"], name


def test_tensor_parallel_collectives_are_counted_apart_and_priced_on_the_critical_path(works):
    """tp 2 with sequence parallelism, one layer: forward all-gathers before QKV and fc1, reduce-scatters after W_O
    and fc2; backward, per column-parallel linear the input gathered again for the weight gradient and dx
    reduce-scattered, per row-parallel linear dy gathered: 10 collectives of X bytes a layer (X: an all-gather of
    [s/2, b, D] sends (2 - 1) x that; a reduce-scatter of [s, b, D] sends 1/2 of it); the LM head 3 (forward
    gather, backward gather and reduce-scatter), the embedding 2 (its reduce-scatter to the sequence-parallel
    region and that one's backward gather). The loss's all-reduces are tp_allreduce."""
    from megatron_upipe.planner.step_time import HARDWARE, comm_seconds, predict

    tp = works[2]
    X = N // 2 * D * 4  # fp32
    assert tp["bytes:tp_allgather:nvlink"] + tp["bytes:tp_reduce_scatter:nvlink"] == (10 * L + 5) * X
    assert tp["bytes:tp_allreduce:nvlink"] > 0
    assert not any(k.startswith(("bytes:allgather", "bytes:reduce_scatter")) for k in tp)  # dp 1: no others
    hw = HARDWARE["h100-80gb"]
    t = predict(tp, hw, N, 2)
    on_path = comm_seconds(tp, ("tp_allgather", "tp_reduce_scatter", "tp_allreduce"), hw)
    assert t.parts["tensor-parallel collectives"] == pytest.approx(on_path) and on_path > 0
    assert t.seconds == pytest.approx(sum(t.parts.values()))


def test_predict_prices_the_work_as_documented():
    from megatron_upipe.planner.step_time import Hardware, predict

    hw = Hardware("test", 1e15, 1e11, 1e10, 1e-3, 1e10, gemm_efficiency=0.5, attention_efficiency=0.25)
    w = {"flops:gemm": 10**15, "flops:attention": 10**15, "bytes:alltoall:nvlink": 10**11, "calls:alltoall:nvlink": 10,
         "bytes:alltoall:ib": 10**10, "calls:alltoall:ib": 2, "bytes:allgather:nvlink": 10**12}
    t = predict(w, hw, tokens_per_step=8000, world_size=8)
    assert t.parts["gemm"] == pytest.approx(2.0) and t.parts["attention"] == pytest.approx(4.0)
    assert t.parts["all-to-all"] == pytest.approx(1 + 0.01 + 1 + 0.002)
    assert t.parts["sharding collectives"] == pytest.approx(10 - 6)  # only what exceeds the compute
    assert t.seconds == pytest.approx(2 + 4 + 2.012 + 4) and t.tokens_per_s_per_gpu == pytest.approx(1000 / t.seconds)
    # pipelined stages: one of 4 stages' all-to-all time stays exposed, the rest hides under 4 s of attention
    assert predict(w, hw, 8000, 8, overlap_stages=4).parts["all-to-all"] == pytest.approx(2.012 / 4)
    # ... and the attention time covering them no longer covers the sharding collectives
    assert predict(w, hw, 8000, 8, overlap_stages=4).parts["sharding collectives"] == pytest.approx(4 + 2.012 * 3 / 4)
    # drained outputs, 4 stages and 2 KV rounds a layer: 3/4 of the forward results' time (0.4 s) and 2/4 of the
    # backward's (0.2 s) hide under the GEMMs (2 s), at most the GEMM time
    results = {**w, "bytes:a2a_result_forward:nvlink": 4 * 10**10, "bytes:a2a_result_backward:nvlink": 2 * 10**10}
    drained = predict(results, hw, 8000, 8, drained_stages=(4, 2))
    assert drained.parts["all-to-all"] == pytest.approx(2.012 - 0.4)
    assert drained.parts["sharding collectives"] == pytest.approx(4 + 0.4)
    fast = {**results, "flops:gemm": 10**14}  # 0.2 s of GEMMs
    assert predict(fast, hw, 8000, 8, drained_stages=(4, 2)).parts["all-to-all"] == pytest.approx(2.012 - 0.2)
    assert predict(results, hw, 8000, 8).parts["all-to-all"] == pytest.approx(2.012)
    # P2P (the ring's passes): on the critical path, or with memory.ring_overlap only what exceeds the attention
    sends = {**w, "bytes:send:ib": 5 * 10**10, "calls:send:ib": 4}
    assert predict(sends, hw, 8000, 8).parts["p2p"] == pytest.approx(5 + 0.004)
    assert predict(sends, hw, 8000, 8, ring_overlap=True).parts["p2p"] == pytest.approx(5.004 - 4)
    assert predict(w, hw, 8000, 8, ring_overlap=True).parts["p2p"] == 0
    # offloaded layer inputs coming back: on the critical path, or prefetched only what exceeds the compute
    back = {**w, "bytes:host_to_device": 7 * 10**10}
    assert predict(back, hw, 8000, 8).parts["offload copies back"] == pytest.approx(7)
    assert predict(back, hw, 8000, 8, offload_prefetch=True).parts["offload copies back"] == pytest.approx(7 - 6)
    assert predict(w, hw, 8000, 8, offload_prefetch=True).parts["offload copies back"] == 0


def test_calibration_recovers_known_efficiencies():
    from megatron_upipe.planner.step_time import Hardware, calibrate, predict

    true = Hardware("test", 1e15, 1e11, 1e10, 1e-4, 1e11, gemm_efficiency=0.42, attention_efficiency=0.66)
    samples = []
    for n in (1, 2, 4, 8):  # attention grows as n^2, the rest as n
        w = {"flops:gemm": 10**14 * n, "flops:attention": 10**13 * n * n, "bytes:alltoall:nvlink": 10**9 * n,
             "calls:alltoall:nvlink": 100, "bytes:host_to_device": 10**10 * n}  # offloaded, not prefetched
        samples.append((w, predict(w, true, 1, 1).seconds))
    fitted = calibrate(samples, Hardware("test", 1e15, 1e11, 1e10, 1e-4, 1e11))
    assert fitted.gemm_efficiency == pytest.approx(0.42) and fitted.attention_efficiency == pytest.approx(0.66)


def test_predicted_time_never_falls_as_u_shrinks(work):
    """`auto` takes the largest U that fits as the fastest that fits: the model must agree, on every legal U (at
    this size latency dominates; at Llama3-8B 128K-5M: tools/step_time_report.py, U = 8 vs Ulysses)."""
    from megatron_upipe.planner.step_time import HARDWARE, predict

    times = {u: predict(work[f"upipe:{u}"], HARDWARE["h100-80gb"], N, C).seconds for u in (2, 4, 8)}
    assert times[2] >= times[4] >= times[8], times
    for u in (2, 4):
        assert work[f"upipe:{u}"]["calls:alltoall:nvlink"] > work[f"upipe:{u * 2}"]["calls:alltoall:nvlink"]
        assert work[f"upipe:{u}"]["bytes:alltoall:nvlink"] >= work[f"upipe:{u * 2}"]["bytes:alltoall:nvlink"]


def test_estimate_memory_prints_the_time_line():
    cmd = [sys.executable, "tools/estimate_memory.py", "--config", "examples/configs/tiny_cpu.yaml", "--world-size", "2",
           f"model.vocab_size={VOCAB}", "train.micro_batch_size=1", "train.global_batch_size=1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("time: ")]
    assert len(line) == 1 and "tokens/s per GPU on h100-80gb" in line[0], out.stdout
