"""Model families against HF transformers: tiny random HF models, loaded into our model under tp2+SP × cp2 UPipe
and pp2 × cp2 UPipe (gloo, float32), give HF's logits, loss and every parameter's gradient.

Families (each a tiny random model built with transformers: D 64, 2 layers, 8 query / 2 KV heads, head dim 16 so
H·d != D, vocab 256; norm weights around 1 and biases random, so a wrong mapping cannot cancel): LlamaForCausalLM
with RoPE scaling llama3 and yarn (yarn with tied embeddings: its attention factor reaches the softmax scale, the
tie crosses the pipeline stages), Qwen2ForCausalLM (QKV biases, tied) and Qwen3ForCausalLM (QK-norm); `linear` (one
division of inv_freq) is checked in tests/test_rope_scaling.py. The RoPE scalings' original context (16) is below
the sequence (32), so every scaling changes the angles that are used.

Reference: HF's float32 forward of the same weights on the same tokens; loss = mean token cross-entropy (our
schedule's global mean), gradients by autograd. Tolerances (float32, eps 1.2e-7; sums of up to a few hundred
terms, different kernels and reduction orders): logits max abs error <= 2e-5 at logit scale ~2.5 (measured
1.2e-6 to 1.7e-6), loss relative error <= 1e-5 (measured <= 1.7e-7), every gradient's relative norm error <= 1e-5
(measured 8e-7 to 1.9e-6), the bounds tests/test_llama_layouts.py holds our layouts to among themselves.
"""

from __future__ import annotations

import torch

from tests.dist_helper import run_on_ranks

# A vocabulary that needs no padding (a multiple of lcm(128, tp)), as every released model here has: padded rows
# (zero weights, logit 0) would take part in our softmax as in Megatron-LM, and HF has no such rows.
VOCAB, BATCH, SEQ = 256, 2, 32
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64)
FAMILIES = {
    "llama-llama3": ("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "llama-linear": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                               "factor": 4.0}}),
    "llama-yarn-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "use_sliding_window": False,
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("Qwen3ForCausalLM", {"tie_word_embeddings": False, "attention_bias": False,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
}
LAYOUTS = {
    "tp2+SP×cp2 upipe": dict(tp=2, sequence_parallel=True, cp=2, cp_strategy="upipe"),
    "pp2×cp2 upipe": dict(pp=2, cp=2, cp_strategy="upipe"),
}
TOL = {"logits": 2e-5, "loss": 1e-5, "grad": 1e-5}


def hf_model(family: str, seed: int = 0):
    """The family's tiny random HF model (float32, eval mode) and its config."""
    import transformers

    cls_name, extra = FAMILIES[family]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**_COMMON, **extra)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.08 * noise)
    return model, config


def hf_reference(model, tokens):
    """(logits [b, N, V], mean loss, {HF name: gradient}) of HF's float32 model on tokens [b, N + 1]."""
    model.zero_grad()
    logits = model(tokens[:, :-1]).logits  # [b, N, V]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.item(), grads


def _logits(layout, arch, hf_sd, tokens):
    """Our full logits [b, N, V] on every rank (forward only through the pipeline schedule)."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_upipe.checkpoint.hf_convert import load_hf_into_model
    from megatron_upipe.cp_batch import split_batch
    from megatron_upipe.models.llama import build_llama
    from megatron_upipe.parallel import destroy_parallel, initialize_parallel

    pg = initialize_parallel(layout)
    try:
        stage = build_llama(arch, layout, pg, vocab_size=VOCAB)
        offset = get_transformer_layer_offset(stage.config, pp_rank=pg.pp.rank())
        load_hf_into_model(stage.model, hf_sd, arch, stage.padded_vocab_size, tp_group=pg.tp, layer_offset=offset)
        stage.model.eval()
        B, N = tokens.shape[0], tokens.shape[1] - 1
        batch = split_batch({"tokens": tokens[:, :-1], "position_ids": torch.arange(N).expand(B, N)},
                            stage.plan.sequence_split, pg.cp)

        def step(it, model):
            b = next(it)
            return model(b["tokens"], b["position_ids"], None), lambda out, non_loss_data=True: out.detach()

        with torch.no_grad():
            out = get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter([batch]), model=[stage.model], num_microbatches=1,
                seq_length=N, micro_batch_size=B, forward_only=True, collect_non_loss_data=True)
        full = torch.zeros(B, N, stage.padded_vocab_size)
        if out:  # last pipeline stage: [b, s/C, Vp/t] -> gather TP (vocab) then CP (contiguous sequence)
            local = out[0]  # [b, s/C, Vp/t]
            parts = [torch.empty_like(local) for _ in range(pg.tp.size())]
            dist.all_gather(parts, local.contiguous(), group=pg.tp)
            local = torch.cat(parts, dim=-1)  # [b, s/C, Vp]
            parts = [torch.empty_like(local) for _ in range(pg.cp.size())]
            dist.all_gather(parts, local, group=pg.cp)
            full = torch.cat(parts, dim=1)  # [b, N, Vp]
        dist.all_reduce(full, group=pg.pp)  # other stages contribute zeros
        return full[..., :VOCAB]
    finally:
        destroy_parallel()


def _job(rank, world_size, families):
    from megatron_upipe.checkpoint.hf_convert import arch_from_hf_config
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import rel_err, run_layout

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    table = {}
    for family in families:
        model, config = hf_model(family)
        ref_logits, ref_loss, ref_grads = hf_reference(model, tokens)
        arch, vocab = arch_from_hf_config(config)
        assert vocab == VOCAB
        hf_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for name, kw in LAYOUTS.items():
            layout = ParallelLayout(**kw)
            logits = _logits(layout, arch, hf_sd, tokens)
            res = run_layout(layout, arch, hf_sd, tokens, steps=1)
            missing = sorted(set(ref_grads) - set(res.grads))
            assert not missing, f"{family} {name}: no gradient for {missing}"
            worst = max(ref_grads, key=lambda n: rel_err(res.grads[n], ref_grads[n]))
            table[(family, name)] = {
                "logits": (logits - ref_logits).abs().max().item(),
                "loss": abs(res.losses[0] - ref_loss) / abs(ref_loss),
                "grad": rel_err(res.grads[worst], ref_grads[worst]), "worst": worst,
                "logit scale": ref_logits.abs().max().item(),
            }
    return table


def test_families_match_hf_under_tp_sp_cp_and_pp():
    families = [f for f in FAMILIES if f != "llama-linear"]  # linear: inv_freq / factor, tests/test_rope_scaling.py
    table = run_on_ranks(_job, 4, families)[0]
    assert set(table) == {(f, n) for f in families for n in LAYOUTS}
    for key, row in table.items():
        for what, tol in TOL.items():
            assert row[what] <= tol, f"{key}: {what} error {row[what]:.2e} > {tol:.0e} ({row})"
