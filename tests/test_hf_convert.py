"""HF Llama / Qwen2 / Qwen3 <-> our megatron-core checkpoints (megatron_upipe/checkpoint, tools/convert_hf_llama.py).

Models are built with transformers from small configs written here (hidden 64, 2 layers, 8 query / 2 KV heads,
head dim 16 so H·d = 128 != D, vocab 250 padded to 256 on our side) with random weights, non-unit norm weights and
random biases:
  llama-{default,linear,llama3,yarn}   LlamaForCausalLM with each RoPE scaling (llama3 at θ 500000),
  llama-tied                           tied embeddings (save_pretrained writes no lm_head.weight),
  qwen2-bf16-sharded                   Qwen2ForCausalLM with q/k/v biases, bfloat16, saved in 3 safetensors shards,
  qwen3-tied                           Qwen3ForCausalLM with QK-norm and tied embeddings.
One process converts each HF -> ours -> HF with the library functions; every tensor comes back bit for bit in its
dtype, config.json gives the same LlamaArch, and transformers loads the export (AutoModelForCausalLM) and computes
exactly the original's logits. Through the CLI, a Llama with llama3 RoPE scaling is converted and loaded under
tp=2 x cp=2 UPipe (dist_checkpointing reshards): our logits equal HF's (float32, max abs error <= 2e-5: fp32
rounding of different summation orders over 2 layers at logits up to ~3; measured 1.6e-6). Bad input (an unknown
architecture or RoPE type, an extra or missing tensor, an untied lm_head, a directory that is no checkpoint, a
family the model is not, an incomplete per-rank checkpoint) ends in one line, exit 2, before any weight is read
(the untied lm_head: before anything is written).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_helper import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, BATCH, SEQ = 250, 2, 16
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 64,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}
CASES = {
    **{f"llama-{k}": ("llama", {"rope_parameters": v, "rms_norm_eps": 1e-5}) for k, v in ROPE.items()},
    "llama-tied": ("llama", {"rope_parameters": ROPE["default"], "tie_word_embeddings": True}),
    "qwen2-bf16-sharded": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3-tied": ("qwen3", {"rope_parameters": ROPE["default"], "tie_word_embeddings": True}),
}


def make_hf(family: str, extra: dict, seed: int = 0):
    """A random transformers model of the family (norm weights ~1 ± 0.2, other weights and biases ~N(0, 0.1))."""
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**SHAPE, **extra)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    return model


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _tool_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tool_convert_hf_llama", Path(REPO) / "tools" / "convert_hf_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_hf_llama.py"), *args],
                          capture_output=True, text=True, cwd=REPO)


# ----------------------------------------------------------------------------- every family, HF -> ours -> HF
def _round_trips(rank, world_size, root):
    from megatron_upipe.checkpoint.hf_export import convert_mcore_to_hf
    from megatron_upipe.checkpoint.hf_import import convert_hf_to_mcore

    lines = {}
    for name in CASES:
        d = Path(root) / name
        convert_hf_to_mcore(d / "hf", d / "ckpt", progress=False)
        lines[name] = convert_mcore_to_hf(d / "ckpt", d / "back", progress=False)
    return lines


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, (family, extra) in CASES.items():
        model = make_hf(family, extra)
        if name.endswith("bf16-sharded"):
            model = model.to(torch.bfloat16)
        model.save_pretrained(root / name / "hf", max_shard_size="40KB" if "sharded" in name else "5GB")
        (root / name / "hf" / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
        with torch.no_grad():  # loaded as the export will be (a cast model keeps a bf16 RoPE inv_freq buffer)
            logits[name] = AutoModelForCausalLM.from_pretrained(root / name / "hf").eval()(tokens).logits
    lines = run_on_ranks(_round_trips, 1, str(root))[0]
    return root, tokens, logits, lines


@pytest.mark.parametrize("name", list(CASES))
def test_hf_to_ours_to_hf_is_bit_exact(round_trips, name):
    from transformers import AutoModelForCausalLM

    from megatron_upipe.checkpoint.hf_families import arch_from_hf_config, read_hf_config

    root, tokens, logits, lines = round_trips
    d = root / name
    original, back = _safetensors(d / "hf"), _safetensors(d / "back")
    if name.endswith("sharded"):
        assert len(list((d / "hf").glob("*.safetensors"))) >= 3  # the index was read
    assert back.keys() == original.keys()
    for k, t in original.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    cfg, cfg_back = read_hf_config(d / "hf"), read_hf_config(d / "back")
    assert arch_from_hf_config(cfg_back) == arch_from_hf_config(cfg)
    for key in ("model_type", "architectures", "tie_word_embeddings", "vocab_size", "head_dim", "rms_norm_eps"):
        assert cfg_back[key] == cfg[key], key
    assert {k: v for k, v in cfg_back["rope_parameters"].items() if k in cfg["rope_parameters"]} == \
        cfg["rope_parameters"]
    assert (d / "ckpt" / "tokenizer_config.json").is_file() and (d / "back" / "tokenizer_config.json").is_file()
    assert lines[name].startswith(f"wrote HF {cfg['model_type']} model, {len(original)} tensors, ")
    model = AutoModelForCausalLM.from_pretrained(d / "back").eval()
    assert model.dtype == next(iter(original.values())).dtype
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, logits[name])  # same weights, same RoPE and norms


# ----------------------------------------------------------------------------- CLI, resharded logits
def _logits_tp2(rank, world_size, ckpt_dir, tokens):
    import torch.distributed as dist

    from megatron_upipe.checkpoint.mcore_io import load_mcore_checkpoint
    from megatron_upipe.checkpoint.sources import load_meta
    from megatron_upipe.cp_batch import split_batch
    from megatron_upipe.models.llama import build_llama
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel

    arch, vocab = load_meta(ckpt_dir)
    layout = ParallelLayout(tp=2, sequence_parallel=True, cp_strategy="upipe")  # resharded to tp2 on load
    pg = initialize_parallel(layout)
    stage = build_llama(arch, layout, pg, vocab_size=vocab)
    load_mcore_checkpoint(stage.model, ckpt_dir)
    stage.model.eval()
    batch = split_batch(
        {"tokens": tokens, "position_ids": torch.arange(tokens.shape[1]).expand_as(tokens)},
        stage.plan.sequence_split, pg.cp,
    )
    with torch.no_grad():
        logits = stage.model(batch["tokens"], batch["position_ids"], None)  # [b, s/C, Vp/t]
    parts = [torch.empty_like(logits) for _ in range(pg.tp.size())]
    dist.all_gather(parts, logits.contiguous(), group=pg.tp)
    logits = torch.cat(parts, dim=-1)  # [b, s/C, Vp]
    parts = [torch.empty_like(logits) for _ in range(pg.cp.size())]
    dist.all_gather(parts, logits, group=pg.cp)
    destroy_parallel()
    return torch.cat(parts, dim=1)[..., :vocab]  # contiguous split: rank order is sequence order -> [b, s, V]


def test_cli_logits_under_tp2_sp_upipe(tmp_path):
    hf = make_hf("llama", {"rope_parameters": ROPE["llama3"]})
    hf_dir, ckpt_dir = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    hf.save_pretrained(hf_dir)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits  # [b, s, V]

    proc = _cli("hf-to-mcore", "--hf", hf_dir, "--out", ckpt_dir)
    assert proc.returncode == 0 and "it/s]" in proc.stderr, proc.stderr[-4000:]  # the tqdm progress bar ran
    assert proc.stdout.strip().startswith("wrote llama model (21 HF tensors -> 15 megatron tensors, float32")
    ours = run_on_ranks(_logits_tp2, 2, ckpt_dir, tokens)
    for r in ours[1:]:
        assert torch.equal(r, ours[0])
    assert ours[0].shape == expected.shape
    err = (ours[0] - expected).abs().max().item()
    assert err <= 2e-5, f"max |logits - HF| = {err:.2e} (logit scale {expected.abs().max().item():.2f})"


# ----------------------------------------------------------------------------- refusals
def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("convert_hf_llama.py: error: "), err
    return lines[0]


def test_bad_input_is_refused_in_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    main = _tool_main()
    good = tmp_path / "good"
    make_hf("qwen3", {"tie_word_embeddings": True}).save_pretrained(good)
    weights = load_file(good / "model.safetensors")
    cfg = json.loads((good / "config.json").read_text())

    def variant(name, config=None, tensors=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config or cfg))
        save_file(tensors if tensors is not None else weights, d / "model.safetensors")
        return str(d)

    extra = {**weights, "model.layers.0.self_attn.foo": torch.zeros(3)}
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_norm.weight"}
    untied = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"] + 1}
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "upipe_model.json").write_text(json.dumps({"arch": {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2, "ffn_hidden_size": 96,
        "kv_channels": 16, "vocab_size": VOCAB, "rotary_base": 1e4, "qk_norm": True}, "vocab_size": VOCAB}))
    fsdp = tmp_path / "fsdp_run" / "iter_0000002"
    fsdp.mkdir(parents=True)
    (fsdp / "train_state.json").write_text(json.dumps({
        "format": "fsdp_per_rank", "layout": {"tp": 1, "pp": 1, "cp": 2, "dp": 2, "cp_strategy": "upipe"},
        "model": json.loads((converted / "upipe_model.json").read_text())["arch"]}))
    (tmp_path / "fsdp_run" / "latest").write_text("iter_0000002\n")
    out = str(tmp_path / "out")
    cases = [
        (["hf-to-mcore", "--hf", variant("mistral", {**cfg, "model_type": "mistral"}), "--out", out],
         "model_type 'mistral' is not 'llama', 'qwen2' or 'qwen3'"),
        (["hf-to-mcore", "--hf", variant("dynamic", {**cfg, "rope_parameters": {
            "rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}), "--out", out],
         "RoPE type 'dynamic' is not supported (dynamic NTK scaling is inference-only"),
        (["hf-to-mcore", "--hf", variant("extra", tensors=extra), "--out", out],
         "1 tensor(s) with no counterpart in our model: model.layers.0.self_attn.foo"),
        (["hf-to-mcore", "--hf", variant("missing", tensors=missing), "--out", out],
         "1 expected tensor(s) missing: model.layers.1.self_attn.k_norm.weight"),
        (["hf-to-mcore", "--hf", variant("untied", tensors=untied), "--out", out],
         "lm_head.weight differs from model.embed_tokens.weight"),
        (["mcore-to-hf", "--ckpt", str(tmp_path / "mistral"), "--out", out], "no upipe_model.json there"),
        (["mcore-to-hf", "--ckpt", str(converted), "--model-type", "llama", "--out", out],
         "model_type 'llama' has qkv_bias=False, qk_norm=False, but the model has qkv_bias=False, qk_norm=True"),
        (["mcore-to-hf", "--ckpt", str(tmp_path / "fsdp_run"), "--out", out],
         "2 of its 4 per-rank files are missing (first: fsdp/rank00000.pt)"),
        (["mcore-to-hf", "--ckpt", str(converted), "--out", str(good)], "exists and is not an empty directory"),
    ]
    (fsdp / "fsdp").mkdir()
    for r in (1, 3):
        (fsdp / "fsdp" / f"rank{r:05d}.pt").write_bytes(b"")
    capsys.readouterr()  # save_pretrained's progress bar
    for argv, expected in cases:
        assert main(argv) == 2, argv
        line = _one_line(capsys.readouterr().err)
        assert expected in line, (argv, line)
    assert not os.path.exists(out)


# ----------------------------------------------------------------------------- configs
def test_configs_map_every_family_setting_or_refuse_it():
    from megatron_upipe.checkpoint.hf_families import arch_from_hf_config, hf_config_dict, hf_config_from_arch
    from megatron_upipe.models.presets import PRESETS, RopeScaling

    for name, arch in PRESETS.items():  # every preset round-trips through its family's config
        arch = arch.replace(vocab_size=arch.vocab_size or 300)
        assert arch_from_hf_config(hf_config_from_arch(arch, arch.vocab_size)) == (arch, arch.vocab_size), name
    old = {"model_type": "llama", **SHAPE, "rope_theta": 5e5,  # a transformers 4 config.json
           "rope_scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    arch, vocab = arch_from_hf_config(old)
    assert (arch.rotary_base, arch.rope_scaling, vocab) == (5e5, RopeScaling("llama3", 8.0, 64), VOCAB)
    assert hf_config_dict(arch, vocab)["rope_parameters"]["rope_type"] == "llama3"
    deepseek_yarn = {**old, "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5}}
    sc = arch_from_hf_config(deepseek_yarn)[0].rope_scaling  # attention factor made explicit, as HF computes it
    assert sc.original_max_position_embeddings == 256 and sc.attention_factor == pytest.approx(
        (0.1 * torch.log(torch.tensor(4.0)).item() + 1) / (0.05 * torch.log(torch.tensor(4.0)).item() + 1))
    refused = {
        "RoPE type 'longrope' is not supported": {**old, "rope_scaling": {"type": "longrope", "factor": 2.0}},
        "RoPE type 'linear' with parameters ['foo'] is not supported": {
            **old, "rope_scaling": {"type": "linear", "factor": 2.0, "foo": 1}},
        "partial_rotary_factor=0.5": {**old, "partial_rotary_factor": 0.5},
        "attention_bias=true is not supported: our Llama": {**old, "attention_bias": True},
        "mlp_bias=true": {**old, "mlp_bias": True},
        "hidden_act='gelu'": {**old, "hidden_act": "gelu"},
        "use_sliding_window=true": {**old, "model_type": "qwen2", "use_sliding_window": True},
        "attention_bias=true is not supported for qwen3": {**old, "model_type": "qwen3", "attention_bias": True},
        "architectures ['LlamaForSequenceClassification']": {**old, "architectures":
                                                              ["LlamaForSequenceClassification"]},
        "config.json lacks vocab_size": {k: v for k, v in old.items() if k != "vocab_size"},
    }
    for words, cfg in refused.items():
        with pytest.raises(ValueError) as e:
            arch_from_hf_config(cfg)
        assert words in str(e.value) and "\n" not in str(e.value), (words, str(e.value))
