"""HF `LlamaForCausalLM` weights <-> megatron-core GPTModel weights (our Llama spec), any TP/PP layout.

Legend: V tokenizer vocab, Vp padded vocab (`padded_vocab_size`), D hidden, H query heads, G KV heads,
g = H/G, d head dim, F FFN hidden, t tensor-parallel size.

Layouts. HF keeps q [H·d, D], k, v [G·d, D] (head-major). megatron-core's fused `linear_qkv.weight` interleaves
rows per query group, [G, g+2, d, D] = (group's g query heads, its k, its v), and TP cuts rows contiguously, so a
rank holds whole groups when t | G. `linear_fc1.weight` holds, on every TP rank, [gate rows of the rank; up rows
of the rank]: the global tensor is TP-dependent, so sharding works on gate and up separately. Embedding and
output rows are padded from V to Vp with zeros (and cut back on export).

Two levels: `hf_to_stage` / `stage_to_hf` move tensors between an HF state dict and the local tensors of one
rank's pipeline stage (TP collectives over `tp_group`; usable for parameters and for gradients), and
`convert_hf_to_mcore` / `convert_mcore_to_hf` write a dist_checkpointing checkpoint (resharded on load by
megatron-core to any layout) plus `upipe_model.json` (the LlamaArch and vocab size).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Iterable

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_upipe.models.presets import LlamaArch

META_FILE = "upipe_model.json"

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megatron local name (inside a layer) -> (HF name inside a layer, TP partition dim or None)
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attention.linear_qkv.weight": (None, 0),  # from q/k/v
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "mlp.linear_fc1.weight": (None, 0),  # from gate/up
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}
_TOP_MAP = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", 0),
    "decoder.final_layernorm.weight": ("model.norm.weight", None),
    "output_layer.weight": ("lm_head.weight", 0),
}


# ----------------------------------------------------------------------------- HF config <-> LlamaArch
def arch_from_hf_config(cfg) -> tuple[LlamaArch, int]:
    """transformers LlamaConfig -> (LlamaArch, tokenizer vocab size)."""
    if getattr(cfg, "tie_word_embeddings", False):
        raise ValueError("tied input/output embeddings are not supported: our Llama models untie them")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError("Llama checkpoints with attention or MLP biases are not supported")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {rope.get('rope_type')!r} is not supported (plain RoPE only)")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    arch = LlamaArch(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, ffn_hidden_size=cfg.intermediate_size, kv_channels=head_dim,
        vocab_size=cfg.vocab_size, rotary_base=float(theta), norm_epsilon=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    return arch, cfg.vocab_size


def hf_config_from_arch(arch: LlamaArch, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups, head_dim=arch.kv_channels, rms_norm_eps=arch.norm_epsilon,
        max_position_embeddings=arch.max_position_embeddings, tie_word_embeddings=False, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": arch.rotary_base},
    )


# ----------------------------------------------------------------------------- full (t = 1) tensors
def _qkv_from_hf(q, k, v, arch: LlamaArch) -> torch.Tensor:
    G, d, D = arch.num_query_groups, arch.kv_channels, arch.hidden_size
    g = arch.num_attention_heads // G
    qg = q.view(G, g * d, D)  # [H·d, D] -> [G, g·d, D]
    return torch.cat([qg, k.view(G, d, D), v.view(G, d, D)], dim=1).reshape(G * (g + 2) * d, D)


def _qkv_to_hf(w, arch: LlamaArch):
    G, d, D = arch.num_query_groups, arch.kv_channels, arch.hidden_size
    g = arch.num_attention_heads // G
    w = w.view(G, (g + 2) * d, D)  # [G·(g+2)·d, D] -> [G, (g+2)·d, D]
    q, k, v = w.split([g * d, d, d], dim=1)
    return q.reshape(G * g * d, D), k.reshape(G * d, D), v.reshape(G * d, D)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])]) if rows > w.shape[0] else w


def _shard(name: str, full: torch.Tensor, dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    if dim is None or tp == 1:
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)  # [2F, D] -> 2 x [F, D]
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])  # [2F/t, D]
    return full.chunk(tp, dim=dim)[tp_rank]


def _gather(name: str, local: torch.Tensor, dim: int | None, tp_group) -> torch.Tensor:
    tp = 1 if tp_group is None else tp_group.size()
    if dim is None or tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]  # t x ([F/t, D], [F/t, D])
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])  # [2F, D] = [gate; up]
    return torch.cat(parts, dim=dim)


def _split_name(name: str, layer_offset: int) -> tuple[str | None, int | None, str]:
    """megatron local name -> (HF prefix of the layer or None, TP dim, key for the maps)."""
    m = _LAYER.match(name)
    if m:
        if m.group(2) not in _LAYER_MAP:
            raise KeyError(f"no HF counterpart for megatron parameter {name!r}")
        return f"model.layers.{int(m.group(1)) + layer_offset}.", _LAYER_MAP[m.group(2)][1], m.group(2)
    if name not in _TOP_MAP:
        raise KeyError(f"no HF counterpart for megatron parameter {name!r}")
    return None, _TOP_MAP[name][1], name


def hf_to_stage(
    hf_sd: dict[str, torch.Tensor], names: Iterable[str], arch: LlamaArch, padded_vocab: int, *, tp_rank: int,
    tp: int, layer_offset: int,
) -> dict[str, torch.Tensor]:
    """HF state dict -> this rank's local megatron tensors for the given local parameter names."""
    out = {}
    for name in names:
        prefix, dim, key = _split_name(name, layer_offset)
        if prefix is None:
            full = hf_sd[_TOP_MAP[key][0]]
            if dim is not None:
                full = _pad_rows(full, padded_vocab)
        elif key == "self_attention.linear_qkv.weight":
            full = _qkv_from_hf(*(hf_sd[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"), arch)
        elif key == "mlp.linear_fc1.weight":
            full = torch.cat([hf_sd[f"{prefix}mlp.gate_proj.weight"], hf_sd[f"{prefix}mlp.up_proj.weight"]])
        else:
            full = hf_sd[prefix + _LAYER_MAP[key][0]]
        out[name] = _shard(name, full, dim, tp_rank, tp)
    return out


def stage_to_hf(
    local: Iterable[tuple[str, torch.Tensor]], arch: LlamaArch, vocab_size: int, *, tp_group, layer_offset: int,
) -> dict[str, torch.Tensor]:
    """This rank's local megatron tensors (parameters or gradients, same names) -> HF-named full tensors.

    Collective over `tp_group`: every TP rank of the stage must call it with the same names in the same order."""
    out = {}
    for name, t in local:
        prefix, dim, key = _split_name(name, layer_offset)
        full = _gather(name, t.detach(), dim, tp_group)
        if prefix is None:
            out[_TOP_MAP[key][0]] = full[:vocab_size] if dim is not None else full
        elif key == "self_attention.linear_qkv.weight":
            for p, w in zip("qkv", _qkv_to_hf(full, arch)):
                out[f"{prefix}self_attn.{p}_proj.weight"] = w
        elif key == "mlp.linear_fc1.weight":
            gate, up = full.chunk(2, dim=0)
            out[f"{prefix}mlp.gate_proj.weight"], out[f"{prefix}mlp.up_proj.weight"] = gate, up
        else:
            out[prefix + _LAYER_MAP[key][0]] = full
    return out


@torch.no_grad()
def load_hf_into_model(model, hf_sd, arch: LlamaArch, padded_vocab: int, *, tp_group, layer_offset: int) -> None:
    """Copy HF weights into this rank's GPTModel stage (every parameter must have a counterpart)."""
    tp_rank, tp = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
    params = dict(model.named_parameters())
    local = hf_to_stage(hf_sd, params, arch, padded_vocab, tp_rank=tp_rank, tp=tp, layer_offset=layer_offset)
    for name, p in params.items():
        if local[name].shape != p.shape:
            raise ValueError(f"{name}: converted shape {tuple(local[name].shape)} != parameter {tuple(p.shape)}")
        p.copy_(local[name])


# ----------------------------------------------------------------------------- checkpoints on disk
def _single_process_stage(arch: LlamaArch, vocab_size: int):
    """A one-rank gloo job (if none is running) with a tp1/pp1 layout and the model built on it."""
    from megatron_upipe.models.llama import build_llama
    from megatron_upipe.parallel import ParallelLayout, initialize_parallel

    if not dist.is_initialized():
        store = dist.HashStore()  # one process: no rendezvous, no port
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    layout = ParallelLayout()
    pg = initialize_parallel(layout)
    return build_llama(arch, layout, pg, vocab_size=vocab_size), pg


def save_meta(ckpt_dir: str, arch: LlamaArch, vocab_size: int) -> None:
    with open(os.path.join(ckpt_dir, META_FILE), "w") as f:
        json.dump({"arch": dataclasses.asdict(arch), "vocab_size": vocab_size}, f, indent=2)


def load_meta(ckpt_dir: str) -> tuple[LlamaArch, int]:
    with open(os.path.join(ckpt_dir, META_FILE)) as f:
        meta = json.load(f)
    return LlamaArch(**meta["arch"]), meta["vocab_size"]


def convert_hf_to_mcore(hf_dir: str, ckpt_dir: str, progress: bool = True) -> None:
    """HF LlamaForCausalLM directory -> dist_checkpointing checkpoint loadable under any TP/PP/CP layout."""
    from megatron.core import dist_checkpointing
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    arch, vocab = arch_from_hf_config(hf.config)
    hf_sd = hf.state_dict()
    stage, pg = _single_process_stage(arch, vocab)
    with torch.no_grad():
        for name, p in tqdm(list(stage.model.named_parameters()), desc="HF -> megatron", disable=not progress):
            p.copy_(hf_to_stage(hf_sd, [name], arch, stage.padded_vocab_size, tp_rank=0, tp=1, layer_offset=0)[name])
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(stage.model.sharded_state_dict(), ckpt_dir)
    save_meta(ckpt_dir, arch, vocab)


def load_mcore_checkpoint(model, ckpt_dir: str) -> None:
    """Load a dist_checkpointing checkpoint into a model of any layout (megatron-core reshards)."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state, strict=True)


def convert_mcore_to_hf(ckpt_dir: str, hf_dir: str, progress: bool = True) -> None:
    """dist_checkpointing checkpoint (+ upipe_model.json) -> HF LlamaForCausalLM directory (safetensors)."""
    from transformers import LlamaForCausalLM

    arch, vocab = load_meta(ckpt_dir)
    stage, pg = _single_process_stage(arch, vocab)
    load_mcore_checkpoint(stage.model, ckpt_dir)
    hf_sd = {}
    for name, p in tqdm(list(stage.model.named_parameters()), desc="megatron -> HF", disable=not progress):
        hf_sd.update(stage_to_hf([(name, p)], arch, vocab, tp_group=None, layer_offset=0))
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_config_from_arch(arch, vocab))
    hf.load_state_dict(hf_sd, strict=True, assign=True)
    hf.save_pretrained(hf_dir)
