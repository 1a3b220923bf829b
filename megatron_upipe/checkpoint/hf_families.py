"""The HF model families that convert, and their config.json <-> `LlamaArch` (no torch, no transformers needed).

| model_type | HF class         | adds to the Llama block                        | refused                                |
|------------|------------------|------------------------------------------------|----------------------------------------|
| llama      | LlamaForCausalLM | (Llama 2, 3, 3.1-3.3; 3.2 1B/3B: tied)         | attention_bias, mlp_bias               |
| qwen2      | Qwen2ForCausalLM | q, k, v biases -> arch.qkv_bias (Qwen2, 2.5)   | use_sliding_window=true                |
| qwen3      | Qwen3ForCausalLM | RMSNorm of q and k heads -> arch.qk_norm       | attention_bias (o_proj too), sliding   |

Every family: SiLU SwiGLU MLP, RMSNorm, full-width RoPE with `default`, `linear`, `llama3` or `yarn` scaling
(-> `arch.rope_scaling`), tied or untied embeddings (-> `arch.tie_embeddings`). Any other model_type, RoPE type
(`dynamic` NTK is inference-only; `longrope`, ...), activation, partial rotary, per-layer RoPE or an unknown RoPE
key is refused with a ValueError naming it: nothing in a config is silently ignored.

RoPE settings are read from transformers 5's `rope_parameters` (rope_type, rope_theta, factor, ...) or from the
older `rope_scaling` (+ top-level `rope_theta`); they are written as `rope_parameters`. A config given as a
transformers config object is read through its `to_dict()`; fields a config.json omits take the defaults of
transformers' LlamaConfig / Qwen2Config / Qwen3Config (`_DEFAULTS`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_upipe.models.presets import LlamaArch, RopeScaling

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DEFAULT_ROPE_THETA = 10000.0
_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
_DEFAULTS: dict[str, dict[str, Any]] = {  # transformers 5's class defaults of the fields read here
    "llama": {**_COMMON, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "qwen2": {**_COMMON, "max_position_embeddings": 32768, "use_sliding_window": False},
    "qwen3": {**_COMMON, "max_position_embeddings": 32768, "use_sliding_window": False, "attention_bias": False},
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# RoPE keys read per type (besides rope_type/type, rope_theta, partial_rotary_factor)
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "truncate",
             "mscale", "mscale_all_dim"),
}


def supported_words() -> str:
    return ", ".join(f"{t} ({c})" for t, c in FAMILIES.items())


def config_dict(cfg) -> dict[str, Any]:
    """A config.json dict from a dict or a transformers config object."""
    return dict(cfg) if isinstance(cfg, dict) else cfg.to_dict()


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """config.json of an HF model directory (OSError when absent, ValueError naming it when it is not a JSON
    object)."""
    path = Path(hf_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not JSON ({' '.join(str(e).split())[:120]}): it is truncated or damaged; "
                         f"download or save the model again") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not a model config object")
    return config


def family_of_config(d: dict[str, Any]) -> str:
    """The family of a config.json dict, or ValueError naming the model_type / class and the supported ones."""
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        names = [repr(t) for t in FAMILIES]
        raise ValueError(f"model_type {model_type!r} is not {', '.join(names[:-1])} or {names[-1]}: only "
                         f"{', '.join(FAMILIES.values())} checkpoints convert")
    archs = d.get("architectures") or [FAMILIES[model_type]]
    if list(archs) != [FAMILIES[model_type]]:
        raise ValueError(f"architectures {archs} is not [{FAMILIES[model_type]!r}]: only the causal-LM class of "
                         f"model_type {model_type!r} converts (a classification or other head has other tensors)")
    return model_type


def family_of_arch(arch: LlamaArch) -> str:
    """qk_norm -> qwen3, qkv_bias -> qwen2, else llama."""
    return "qwen3" if arch.qk_norm else "qwen2" if arch.qkv_bias else "llama"


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:  # transformers' yarn_get_mscale
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_from_config(d: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling or None) of a config.json dict; ValueError for what does not convert."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters ({sorted(params)}) are not supported: one RoPE for all "
                         f"layers only")
    params = {k: v for k, v in params.items() if v is not None}
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or DEFAULT_ROPE_THETA)
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported: RoPE over the whole head dim only")
    if kind not in ROPE_TYPES:
        why = " (dynamic NTK scaling is inference-only: nothing to train)" if kind == "dynamic" else ""
        raise ValueError(f"RoPE type {kind!r} is not supported{why}; supported: {', '.join(ROPE_TYPES)}")
    unknown = sorted(set(params) - set(_ROPE_KEYS[kind]))
    if unknown:
        raise ValueError(f"RoPE type {kind!r} with parameters {unknown} is not supported (known for {kind!r}: "
                         f"{list(_ROPE_KEYS[kind]) or 'none'})")
    if kind == "default":
        return theta, None
    original = params.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") \
        or max_positions  # as transformers' standardize_rope_params
    factor = params.get("factor")
    if factor is None and kind == "yarn":
        factor = max_positions / original  # as transformers' _compute_yarn_parameters
    if factor is None:
        raise ValueError(f"RoPE type {kind!r} without a factor")
    if kind == "linear":
        return theta, RopeScaling("linear", float(factor))
    if kind == "llama3":
        return theta, RopeScaling("llama3", float(factor), original_max_position_embeddings=int(original),
                                  low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                                  high_freq_factor=float(params.get("high_freq_factor", 4.0)))
    attention = params.get("attention_factor")
    if attention is None and params.get("mscale") and params.get("mscale_all_dim"):  # DeepSeek's form, made explicit
        attention = _yarn_mscale(factor, params["mscale"]) / _yarn_mscale(factor, params["mscale_all_dim"])
    return theta, RopeScaling("yarn", float(factor), original_max_position_embeddings=int(original),
                              beta_fast=float(params.get("beta_fast") or 32.0),
                              beta_slow=float(params.get("beta_slow") or 1.0),
                              attention_factor=None if attention is None else float(attention),
                              truncate=bool(params.get("truncate", True)))


def rope_parameters(arch: LlamaArch) -> dict[str, Any]:
    """transformers 5's `rope_parameters` for the arch's RoPE."""
    sc = arch.rope_scaling
    out: dict[str, Any] = {"rope_type": "default" if sc is None else sc.kind, "rope_theta": arch.rotary_base}
    if sc is None:
        return out
    out["factor"] = sc.factor
    if sc.kind == "llama3":
        out.update(original_max_position_embeddings=sc.original_max_position_embeddings,
                   low_freq_factor=sc.low_freq_factor, high_freq_factor=sc.high_freq_factor)
    elif sc.kind == "yarn":
        out.update(original_max_position_embeddings=sc.original_max_position_embeddings, beta_fast=sc.beta_fast,
                   beta_slow=sc.beta_slow, truncate=sc.truncate)
        if sc.attention_factor is not None:
            out["attention_factor"] = sc.attention_factor
    return out


def _family_problems(family: str, d: dict[str, Any]) -> list[str]:
    get = lambda k: d.get(k, _DEFAULTS[family].get(k))  # noqa: E731
    problems = []
    if get("hidden_act") != "silu":
        problems.append(f"hidden_act={get('hidden_act')!r} is not supported (SiLU/SwiGLU only)")
    if family == "llama":
        problems += [f"{k}=true is not supported: our Llama block has no biases on o_proj or the MLP (q/k/v-only "
                     f"biases are model_type qwen2)" for k in ("attention_bias", "mlp_bias") if get(k)]
    if family == "qwen3" and get("attention_bias"):
        problems.append("attention_bias=true is not supported for qwen3: it also puts a bias on o_proj, which our "
                        "block does not have (biases on q, k, v only)")
    if family in ("qwen2", "qwen3"):
        if get("use_sliding_window"):
            problems.append("use_sliding_window=true is not supported: our attention is full causal attention")
        other = sorted({t for t in d.get("layer_types") or () if t != "full_attention"})
        if other:
            problems.append(f"layer_types {other} are not supported: full_attention layers only")
    return problems


def arch_from_hf_config(cfg) -> tuple[LlamaArch, int]:
    """HF config (a config.json dict or a transformers config object) -> (LlamaArch, vocab size).

    ValueError (one line, every problem) for a family or setting that does not convert."""
    d = config_dict(cfg)
    family = family_of_config(d)
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    problems = _family_problems(family, d)
    get = lambda k: d.get(k, _DEFAULTS[family].get(k))  # noqa: E731
    heads = d["num_attention_heads"]
    max_positions = get("max_position_embeddings")
    try:
        theta, scaling = rope_from_config(d, max_positions)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError(f"{family} config: " + "; ".join(problems))
    arch = LlamaArch(
        num_layers=d["num_hidden_layers"], hidden_size=d["hidden_size"], num_attention_heads=heads,
        num_query_groups=d.get("num_key_value_heads") or heads, ffn_hidden_size=d["intermediate_size"],
        kv_channels=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"], rotary_base=theta,
        norm_epsilon=float(get("rms_norm_eps")), max_position_embeddings=max_positions,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3", tie_embeddings=bool(get("tie_word_embeddings")),
        rope_scaling=scaling,
    )
    return arch, d["vocab_size"]


def hf_config_dict(arch: LlamaArch, vocab_size: int, model_type: str | None = None) -> dict[str, Any]:
    """config.json of the arch's family (or `model_type`), as transformers 5 writes it (rope_parameters)."""
    family = model_type or family_of_arch(arch)
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not one of {', '.join(FAMILIES)}")
    need = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}[family]
    if (arch.qkv_bias, arch.qk_norm) != need:
        raise ValueError(f"model_type {family!r} has qkv_bias={need[0]}, qk_norm={need[1]}, but the model has "
                         f"qkv_bias={arch.qkv_bias}, qk_norm={arch.qk_norm}: use model_type "
                         f"{family_of_arch(arch)!r}")
    d: dict[str, Any] = {
        "architectures": [FAMILIES[family]], "model_type": family, "vocab_size": vocab_size,
        "hidden_size": arch.hidden_size, "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups, "head_dim": arch.kv_channels, "hidden_act": "silu",
        "rms_norm_eps": arch.norm_epsilon, "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_embeddings, "rope_parameters": rope_parameters(arch),
    }
    if family in ("llama", "qwen3"):
        d["attention_bias"] = False
    if family == "llama":
        d["mlp_bias"] = False
    else:
        d["use_sliding_window"] = False
    return d


def hf_config_from_arch(arch: LlamaArch, vocab_size: int, model_type: str | None = None):
    """transformers LlamaConfig / Qwen2Config / Qwen3Config of the arch (family: qk_norm -> qwen3, qkv_bias ->
    qwen2, else llama; or `model_type`). Needs transformers."""
    import transformers

    d = hf_config_dict(arch, vocab_size, model_type)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[d.pop("model_type")]
    return cls(**d)
