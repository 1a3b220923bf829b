"""HF Llama / Qwen2 / Qwen3 tensors <-> megatron-core GPTModel tensors (our Llama-family spec), any TP/PP layout.

Legend: V tokenizer vocab, Vp padded vocab (`padded_vocab_size`), D hidden, H query heads, G KV heads,
g = H/G, d head dim, F FFN hidden, t tensor-parallel size.

Layouts. HF keeps q [H·d, D], k, v [G·d, D] (head-major) and, with qkv_bias (Qwen2), biases q [H·d], k, v [G·d].
megatron-core's fused `linear_qkv.weight` interleaves rows per query group, [G, g+2, d, D] = (group's g query
heads, its k, its v); `linear_qkv.bias` [G·(g+2)·d] the same way. TP cuts both contiguously (dim 0), so a rank
holds whole groups when t | G. `linear_fc1.weight` holds, on every TP rank, [gate rows of the rank; up rows of the
rank]: the global tensor is TP-dependent, so sharding works on gate and up separately. QK-norm weights (Qwen3's
`self_attn.q_norm` / `k_norm` [d]) are megatron's `self_attention.q_layernorm` / `k_layernorm`, replicated over TP.
Embedding and output rows are padded from V to Vp with zeros (and cut back on export). With tied embeddings there is
no `lm_head.weight`: with pp = 1 there is no `output_layer.weight` either, with pp > 1 the last stage's copy
`output_layer.weight` maps to `model.embed_tokens.weight` (HF checkpoints may still carry an `lm_head.weight`
equal to the embedding: `check_hf_tensors` accepts it and `check_tied_head` verifies it).

`hf_tensor_shapes(arch, V)` lists every tensor an HF checkpoint of the arch holds; `check_hf_tensors` refuses a
checkpoint with any other tensor, a missing one or a wrong shape (only `rotary_emb.inv_freq` buffers, derived from
the config, are skipped). `hf_to_stage` / `stage_to_hf` move tensors between an HF state dict and the local
tensors of one rank's pipeline stage (TP collectives over `tp_group`; usable for parameters and for gradients).
Checkpoints on disk: hf_import.py (HF -> ours), hf_export.py (ours -> HF).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from megatron_upipe.checkpoint.hf_families import arch_from_hf_config, hf_config_from_arch  # noqa: F401 (API)
from megatron_upipe.models.presets import LlamaArch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_FUSED_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
# megatron local name (inside a layer) -> (HF name inside a layer or None when fused, TP partition dim or None)
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attention.linear_qkv.weight": (None, 0),  # from q/k/v weights
    "self_attention.linear_qkv.bias": (None, 0),  # from q/k/v biases
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", None),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", None),
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
DERIVED_BUFFER = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # old checkpoints; from config


# ----------------------------------------------------------------------------- which tensors an HF checkpoint has
def hf_tensor_shapes(arch: LlamaArch, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the arch's HF checkpoint and its shape (tied: without the optional lm_head.weight)."""
    D, H, G, d, F = (arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.kv_channels,
                     arch.ffn_hidden_size)
    out = {"model.embed_tokens.weight": (vocab_size, D), "model.norm.weight": (D,)}
    if not arch.tie_embeddings:
        out["lm_head.weight"] = (vocab_size, D)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                    p + "self_attn.q_proj.weight": (H * d, D), p + "self_attn.k_proj.weight": (G * d, D),
                    p + "self_attn.v_proj.weight": (G * d, D), p + "self_attn.o_proj.weight": (D, H * d),
                    p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                    p + "mlp.down_proj.weight": (D, F)})
        if arch.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (H * d,), p + "self_attn.k_proj.bias": (G * d,),
                        p + "self_attn.v_proj.bias": (G * d,)})
        if arch.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return out


def _listing(names: list[str], n: int = 4) -> str:
    shown = ", ".join(names[:n])
    return f"{shown} (+{len(names) - n} more)" if len(names) > n else shown


def check_hf_tensors(shapes: Mapping[str, tuple[int, ...]], arch: LlamaArch, vocab_size: int) -> int:
    """Refuse (ValueError, one line) a checkpoint whose tensors are not exactly the arch's: a tensor without a
    counterpart, a missing one, or a wrong shape, each named (first few + count). Returns how many derived
    `rotary_emb.inv_freq` buffers were skipped."""
    expected = hf_tensor_shapes(arch, vocab_size)
    derived = [k for k in shapes if DERIVED_BUFFER.match(k)]
    optional = {"lm_head.weight": (vocab_size, arch.hidden_size)} if arch.tie_embeddings else {}
    extra = sorted(k for k in shapes if k not in expected and k not in optional and k not in derived)
    missing = sorted(k for k in expected if k not in shapes)
    wrong = sorted(f"{k} {tuple(shapes[k])} (expected {want})" for k, want in {**expected, **optional}.items()
                   if k in shapes and tuple(shapes[k]) != want)
    problems = []
    if extra:
        problems.append(f"{len(extra)} tensor(s) with no counterpart in our model: {_listing(extra)}")
    if missing:
        problems.append(f"{len(missing)} expected tensor(s) missing: {_listing(missing)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) of the wrong shape: {_listing(wrong, 2)}")
    if problems:
        raise ValueError("the checkpoint's tensors do not match its config: " + "; ".join(problems))
    return len(derived)


def check_tied_head(hf_sd: Mapping[str, torch.Tensor], arch: LlamaArch) -> None:
    """With tied embeddings, an lm_head.weight in the checkpoint must equal the embedding (else it is not tied)."""
    if arch.tie_embeddings and "lm_head.weight" in hf_sd:
        if not torch.equal(hf_sd["lm_head.weight"], hf_sd["model.embed_tokens.weight"]):
            raise ValueError("tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight: "
                             "the checkpoint is not tied; set tie_word_embeddings=false in its config.json")


# ----------------------------------------------------------------------------- full (t = 1) tensors
def _qkv_from_hf(q, k, v, arch: LlamaArch) -> torch.Tensor:
    """q [H·d, *r], k, v [G·d, *r] -> [G·(g+2)·d, *r] interleaved per query group (weights r = (D,), biases ())."""
    G, d = arch.num_query_groups, arch.kv_channels
    g, rest = arch.num_attention_heads // G, tuple(q.shape[1:])
    qg = q.reshape(G, g * d, *rest)  # [H·d, *r] -> [G, g·d, *r]
    grouped = torch.cat([qg, k.reshape(G, d, *rest), v.reshape(G, d, *rest)], dim=1)  # [G, (g+2)·d, *r]
    return grouped.reshape(G * (g + 2) * d, *rest)


def _qkv_to_hf(w, arch: LlamaArch):
    G, d = arch.num_query_groups, arch.kv_channels
    g, rest = arch.num_attention_heads // G, tuple(w.shape[1:])
    q, k, v = w.reshape(G, (g + 2) * d, *rest).split([g * d, d, d], dim=1)  # [G·(g+2)·d, *r] -> [G, ., *r] x 3
    return q.reshape(G * g * d, *rest), k.reshape(G * d, *rest), v.reshape(G * d, *rest)


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


def _top_hf_name(key: str, arch: LlamaArch) -> str:
    if key == "output_layer.weight" and arch.tie_embeddings:  # the last stage's copy of the embedding (pp > 1)
        return "model.embed_tokens.weight"
    return _TOP_MAP[key][0]


def hf_to_stage(
    hf_sd: Mapping[str, torch.Tensor], names: Iterable[str], arch: LlamaArch, padded_vocab: int, *, tp_rank: int,
    tp: int, layer_offset: int,
) -> dict[str, torch.Tensor]:
    """HF state dict -> this rank's local megatron tensors for the given local parameter names."""
    out = {}
    for name in names:
        prefix, dim, key = _split_name(name, layer_offset)
        if prefix is None:
            full = hf_sd[_top_hf_name(key, arch)]
            if dim is not None:
                full = _pad_rows(full, padded_vocab)
        elif key in _FUSED_QKV:
            kind = key.rsplit(".", 1)[1]  # weight | bias
            full = _qkv_from_hf(*(hf_sd[f"{prefix}self_attn.{p}_proj.{kind}"] for p in "qkv"), arch)
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

    Collective over `tp_group`: every TP rank of the stage must call it with the same names in the same order.
    Tied embeddings: the last stage's `output_layer.weight` (pp > 1) comes out as `model.embed_tokens.weight`."""
    out = {}
    for name, t in local:
        prefix, dim, key = _split_name(name, layer_offset)
        full = _gather(name, t.detach(), dim, tp_group)
        if prefix is None:
            out[_top_hf_name(key, arch)] = full[:vocab_size] if dim is not None else full
        elif key in _FUSED_QKV:
            kind = key.rsplit(".", 1)[1]
            for p, w in zip("qkv", _qkv_to_hf(full, arch)):
                out[f"{prefix}self_attn.{p}_proj.{kind}"] = w
        elif key == "mlp.linear_fc1.weight":
            gate, up = full.chunk(2, dim=0)
            out[f"{prefix}mlp.gate_proj.weight"], out[f"{prefix}mlp.up_proj.weight"] = gate, up
        else:
            out[prefix + _LAYER_MAP[key][0]] = full
    return out


@torch.no_grad()
def load_hf_into_model(model, hf_sd, arch: LlamaArch, padded_vocab: int, *, tp_group, layer_offset: int) -> None:
    """Copy HF weights into this rank's GPTModel stage (every parameter must have a counterpart; cast to the
    parameters' dtype)."""
    tp_rank, tp = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
    params = dict(model.named_parameters())
    for name, p in params.items():
        local = hf_to_stage(hf_sd, [name], arch, padded_vocab, tp_rank=tp_rank, tp=tp, layer_offset=layer_offset)[name]
        if local.shape != p.shape:
            raise ValueError(f"{name}: converted shape {tuple(local.shape)} != parameter {tuple(p.shape)}")
        p.copy_(local)
