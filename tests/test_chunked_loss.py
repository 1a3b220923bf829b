"""memory.loss_chunks: chunked LM head + vocab-parallel cross-entropy equals megatron's, without whole logits.

One 2-rank gloo job (float32, vocabulary sharded over TP where tp=2):
- the tiny Llama trained one Adam step with loss_chunks=3 (chunks of unequal size) equals the plain model of the
  same layout (loss rtol 1e-5, every gradient and updated parameter relative norm error <= 1e-5) for tp1 (dp2),
  tp2 with and without sequence parallelism, pp2, and CP2 UPipe with the tiled MLP as well;
- per token, `chunked_lm_loss` equals megatron's `output_layer` + `vocab_parallel_cross_entropy`, with the same
  gradients for the hidden states and the output weight (tp1 and tp2+SP), and `ChunkedLossGPTModel` (with the
  tiled MLP) returns the same per-token loss [b, s] as GPTModel, the same logits without labels, and the same
  state dict and sharded (dist-checkpointing) state dict;
- the tracked forward+backward of the chunked loss never allocates a tensor of the full logits' size.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_helper import run_on_ranks

ARCH = "tiny-gqa"
VOCAB, BATCH, SEQ, CHUNKS = 256, 2, 32, 3
PAIRS = [  # (layout, mlp_chunks): plain vs loss_chunks=CHUNKS (and the mlp_chunks given), same layout
    (dict(dp=2), 1),
    (dict(tp=2, sequence_parallel=True), 1),
    (dict(tp=2), 1),
    (dict(pp=2), 1),  # the loss runs on the last stage only
    (dict(cp=2, cp_strategy="upipe"), CHUNKS),
]
MEM = dict(s=512, b=1, hidden=32, vocab=2048, chunks=8)  # peak measurement, tp1, float32


def _op_checks(layout_kw: dict, rank: int, s: int, b: int, hidden: int, vocab: int, chunks: int,
               track: bool) -> dict:
    """megatron's output layer + vocab_parallel_cross_entropy vs chunked_lm_loss on the same weights and inputs."""
    from megatron.core import tensor_parallel

    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
    from megatron_upipe.models.chunked_loss import chunked_lm_loss
    from megatron_upipe.models.llama import llama_transformer_config
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel
    from tests.llama_harness import rel_err

    layout = ParallelLayout(**layout_kw)
    pg = initialize_parallel(layout)
    try:
        config = llama_transformer_config(get_preset(ARCH).replace(hidden_size=hidden), layout)
        head = tensor_parallel.ColumnParallelLinear(
            hidden, vocab, config=config, init_method=config.init_method, bias=False, gather_output=False,
            tp_group=pg.tp,
        )  # GPTModel's output layer
        t, sp = pg.tp.size(), head.sequence_parallel
        gen = torch.Generator().manual_seed(7)  # the same global tensors on every rank
        h_full = torch.randn(s, b, hidden, generator=gen)
        labels = torch.randint(0, vocab, (s, b), generator=gen)  # [s, b]: targets on every vocabulary shard
        dloss = torch.rand(s, b, generator=gen)
        s_l = s // t if sp else s
        h_local = h_full[pg.tp.rank() * s_l:(pg.tp.rank() + 1) * s_l] if sp else h_full  # [s/t, b, D] with SP
        out = {}
        for name in ("plain", "chunked"):
            h = h_local.clone().requires_grad_()
            head.weight.grad = None
            with PeakMemoryTracker(record_timeline=track) as mem:
                if name == "plain":
                    logits, _ = head(h)  # [s, b, V/t]
                    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels, tp_group=pg.tp)
                    del logits
                else:
                    loss = chunked_lm_loss(h, head.weight, labels, chunks=chunks, tp_group=pg.tp,
                                           sequence_parallel=sp)
                loss.backward(dloss)
            largest = max((d for _, d, _ in mem.timeline), default=0) if track else None
            out[name] = dict(loss=loss.detach(), dh=h.grad, dw=head.weight.grad.clone(), peak=mem.peak_bytes,
                             largest=largest)
        plain, chunked = out["plain"], out["chunked"]
        return dict(  # numbers only (tensors would travel through shared memory)
            shapes_equal=plain["loss"].shape == chunked["loss"].shape == (s, b),
            loss_close=bool(torch.allclose(chunked["loss"], plain["loss"], rtol=1e-5, atol=1e-6)),
            dh_err=rel_err(chunked["dh"], plain["dh"]), dw_err=rel_err(chunked["dw"], plain["dw"]),
            peak={k: out[k]["peak"] for k in out}, largest={k: out[k]["largest"] for k in out},
            full_logits_bytes=s * b * (vocab // t) * 4,
        )
    finally:
        destroy_parallel()


def _model_checks(hf_sd, tokens) -> dict:
    """tp2+SP: ChunkedLossGPTModel vs GPTModel, per-token loss with labels and logits without; both switches
    leave the (sharded) state dict unchanged."""
    from megatron_upipe.checkpoint.hf_convert import load_hf_into_model
    from megatron_upipe.models.chunked_loss import ChunkedLossGPTModel
    from megatron_upipe.models.llama import build_llama
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel

    arch, layout = get_preset(ARCH), ParallelLayout(tp=2, sequence_parallel=True)
    pg = initialize_parallel(layout)
    try:
        out = {}
        for chunks in (1, CHUNKS):
            stage = build_llama(arch, layout, pg, vocab_size=VOCAB, loss_chunks=chunks, mlp_chunks=chunks)
            load_hf_into_model(stage.model, hf_sd, arch, stage.padded_vocab_size, tp_group=pg.tp, layer_offset=0)
            positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
            loss = stage.model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])  # [b, s]
            with torch.no_grad():
                logits = stage.model(tokens[:, :-1], positions, None)  # [b, s, V/t]
            sharded = {k: (tuple(v.global_shape), tuple(v.global_offset)) if hasattr(v, "global_shape") else None
                       for k, v in stage.model.sharded_state_dict().items()}
            state = {k: tuple(getattr(v, "shape", ())) for k, v in stage.model.state_dict().items()}
            out[chunks] = dict(cls=type(stage.model), loss=loss.detach(), logits=logits, state=state,
                               sharded=sharded)
        plain, chunked = out[1], out[CHUNKS]
        return dict(  # numbers only
            classes=chunked["cls"] is ChunkedLossGPTModel and plain["cls"] is not ChunkedLossGPTModel,
            loss_shape=tuple(chunked["loss"].shape) if chunked["loss"].shape == plain["loss"].shape else None,
            loss_close=bool(torch.allclose(chunked["loss"], plain["loss"], rtol=1e-5, atol=1e-6)),
            logits_equal=bool(torch.equal(chunked["logits"], plain["logits"])),
            state_equal=chunked["state"] == plain["state"] and len(plain["state"]) > 10,
            sharded_equal=chunked["sharded"] == plain["sharded"] and len(plain["sharded"]) > 10,
        )
    finally:
        destroy_parallel()


def _job(rank, world_size):
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import random_setup, run_layout

    arch, hf_sd, tokens = random_setup(ARCH, VOCAB, BATCH, SEQ)
    runs = {}
    for kw, mlp_chunks in PAIRS:
        layout = ParallelLayout(**kw)
        runs[layout.describe()] = (
            run_layout(layout, arch, hf_sd, tokens, steps=1),
            run_layout(layout, arch, hf_sd, tokens, steps=1, loss_chunks=CHUNKS, mlp_chunks=mlp_chunks),
        )
    ops = {
        "tp1": _op_checks(dict(dp=2), rank, 30, 2, 16, 64, CHUNKS, track=False),
        "tp2+sp": _op_checks(dict(tp=2, sequence_parallel=True), rank, 30, 2, 16, 64, CHUNKS, track=False),
        "mem": _op_checks(dict(dp=2), rank, MEM["s"], MEM["b"], MEM["hidden"], MEM["vocab"], MEM["chunks"],
                          track=True),
    }
    return runs, ops, _model_checks(hf_sd, tokens)


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_job, 2)


def test_chunked_loss_model_equals_plain_model(results):
    from tests.llama_harness import rel_err

    runs = results[0][0]
    assert len(runs) == len(PAIRS)
    failures = []
    for name, (plain, chunked) in runs.items():
        if not torch.allclose(torch.tensor(chunked.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0):
            failures.append(f"{name}: loss {chunked.losses} != {plain.losses}")
        assert chunked.grads.keys() == plain.grads.keys() and "lm_head.weight" in plain.grads
        for key in plain.grads:
            if (e := rel_err(chunked.grads[key], plain.grads[key])) > 1e-5:
                failures.append(f"{name}: grad {key} rel err {e:.2e}")
            if (e := rel_err(chunked.params[key], plain.params[key])) > 1e-5:
                failures.append(f"{name}: param {key} rel err {e:.2e}")
    assert not failures, "\n".join(failures)


def test_per_token_loss_and_gradients_equal_megatron(results):
    for _, ops, _ in results:
        for name in ("tp1", "tp2+sp", "mem"):
            op = ops[name]
            assert op["shapes_equal"] and op["loss_close"], name
            assert op["dh_err"] < 1e-5 and op["dw_err"] < 1e-5, (name, op["dh_err"], op["dw_err"])


def test_chunked_loss_model_forward(results):
    """Same per-token loss [b, s] with labels; without labels the logits are megatron's (inference unchanged)."""
    for _, _, model in results:
        assert model["classes"]
        assert model["loss_shape"] == (BATCH, SEQ) and model["loss_close"]
        assert model["logits_equal"]
        assert model["state_equal"] and model["sharded_equal"]  # same checkpoint layout with both switches on


def test_no_allocation_of_full_logits_size(results):
    """tp1, float32: megatron's path allocates the [s, b, V] logits; the chunked path's largest allocation is a
    chunk's logits (1/8), and its peak stays below one full-logits tensor."""
    mem = results[0][1]["mem"]
    full, largest, peak = mem["full_logits_bytes"], mem["largest"], mem["peak"]
    assert largest["plain"] >= full  # the measurement sees the logits when they exist
    assert largest["chunked"] <= full / MEM["chunks"] + 4096, (largest, full)
    assert peak["chunked"] < full / 2 < peak["plain"], (peak, full)
