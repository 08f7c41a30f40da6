"""HF <-> Megatron weight conversion (pure tensor code, no megatron runtime): config reading,
the fused QKV / gate-up layouts, tensor-parallel sharding and bit-exact round trips."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from stoa.backends.megatron.convert import (
    Arch,
    ConversionError,
    hf_shapes,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
    padded_vocab,
    renumber,
)
from stoa.models.tiny import TinyConfig, build_tiny

TEXTS = [f"protein P{i} binds receptor R{i % 7} in cell line C{i % 5}" for i in range(120)]


def qwen2_config(**kw) -> dict:
    base = {"model_type": "qwen2", "vocab_size": 301, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "tie_word_embeddings": False}
    return {**base, **kw}


def random_hf(arch: Arch, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in hf_shapes(arch).items()}


def shard_all(hf, arch, tp):
    return [hf_to_megatron(hf, arch, tp_rank=r, tp_size=tp) for r in range(tp)]


def test_arch_reads_qwen2_qwen3_llama_configs():
    a = Arch.from_hf_config(qwen2_config())
    assert (a.qkv_bias, a.qk_norm, a.head_dim, a.rope_theta, a.num_kv_heads) == (True, False, 16, 1e6, 2)
    q3 = Arch.from_hf_config(qwen2_config(model_type="qwen3", head_dim=32, rope_theta=5e5, rope_parameters=None))
    assert (q3.qkv_bias, q3.qk_norm, q3.head_dim, q3.rope_theta) == (False, True, 32, 5e5)
    ll = Arch.from_hf_config(qwen2_config(model_type="llama", num_key_value_heads=None))
    assert (ll.qkv_bias, ll.qk_norm, ll.num_kv_heads) == (False, False, 4)


@pytest.mark.parametrize("bad, message", [
    ({"model_type": "gpt2"}, "not supported"),
    ({"use_sliding_window": True, "max_window_layers": 1}, "sliding-window attention"),
    ({"model_type": "mistral", "sliding_window": None}, "does not build model_type 'mistral'"),
    ({"model_type": "gemma2", "head_dim": 16, "tie_word_embeddings": True}, "does not build model_type 'gemma2'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE scaling"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "SwiGLU"),
    ({"num_key_value_heads": 3}, "multiple"),
])
def test_arch_refuses_what_megatron_would_silently_change(bad, message):
    with pytest.raises(ConversionError, match=message):
        Arch.from_hf_config(qwen2_config(**bad))


def test_fused_qkv_is_interleaved_per_query_group_and_split_by_whole_groups():
    arch = Arch.from_hf_config(qwen2_config())  # 4 query heads, 2 groups, head_dim 16
    hf = random_hf(arch)
    q = hf["model.layers.0.self_attn.q_proj.weight"].reshape(4, 16, 64)
    k = hf["model.layers.0.self_attn.k_proj.weight"].reshape(2, 16, 64)
    v = hf["model.layers.0.self_attn.v_proj.weight"].reshape(2, 16, 64)
    full = hf_to_megatron(hf, arch)["decoder.layers.0.self_attention.linear_qkv.weight"].reshape(-1, 16, 64)
    assert torch.equal(full, torch.stack([q[0], q[1], k[0], v[0], q[2], q[3], k[1], v[1]]))
    s0, s1 = (s["decoder.layers.0.self_attention.linear_qkv.weight"].reshape(-1, 16, 64) for s in shard_all(hf, arch, 2))
    assert torch.equal(s0, torch.stack([q[0], q[1], k[0], v[0]])) and torch.equal(s1, torch.stack([q[2], q[3], k[1], v[1]]))
    b = hf_to_megatron(hf, arch, tp_rank=1, tp_size=2)["decoder.layers.0.self_attention.linear_qkv.bias"].reshape(-1, 16)
    qb = hf["model.layers.0.self_attn.q_proj.bias"].reshape(4, 16)
    assert torch.equal(b, torch.stack([qb[2], qb[3], hf["model.layers.0.self_attn.k_proj.bias"][16:],
                                       hf["model.layers.0.self_attn.v_proj.bias"][16:]]))


def test_gate_up_and_row_parallel_layouts_under_tp2():
    arch = Arch.from_hf_config(qwen2_config())
    hf = random_hf(arch)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    shards = shard_all(hf, arch, 2)
    for r, s in enumerate(shards):
        rows = slice(64 * r, 64 * (r + 1))
        assert torch.equal(s["decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([gate[rows], up[rows]]))
        assert torch.equal(s["decoder.layers.1.mlp.linear_fc2.weight"], hf["model.layers.1.mlp.down_proj.weight"][:, rows])
        assert torch.equal(s["decoder.layers.1.self_attention.linear_proj.weight"],
                           hf["model.layers.1.self_attn.o_proj.weight"][:, 32 * r : 32 * (r + 1)])
        assert torch.equal(s["decoder.layers.1.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"])


def test_vocabulary_is_padded_to_a_multiple_of_tp_with_zero_rows():
    arch = Arch.from_hf_config(qwen2_config())  # vocab 301
    assert padded_vocab(arch, 1) == 301 and padded_vocab(arch, 2) == 302
    hf = random_hf(arch)
    s0, s1 = shard_all(hf, arch, 2)
    assert s0["embedding.word_embeddings.weight"].shape == (151, 64)
    assert torch.equal(s1["output_layer.weight"][-1], torch.zeros(64))
    assert torch.equal(s1["output_layer.weight"][:-1], hf["lm_head.weight"][151:])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["qwen2-tied", "qwen2-untied", "qwen3", "llama"])
def test_hf_megatron_hf_round_trip_is_bit_exact(family, tp):
    cfg = {"qwen2-tied": qwen2_config(tie_word_embeddings=True), "qwen2-untied": qwen2_config(),
           "qwen3": qwen2_config(model_type="qwen3", head_dim=32),
           "llama": qwen2_config(model_type="llama")}[family]
    arch = Arch.from_hf_config(cfg)
    hf = {k: v.to(torch.bfloat16) if "norm" not in k else v for k, v in random_hf(arch).items()}
    shards = shard_all(hf, arch, tp)
    assert all(set(s) == set(megatron_names(arch)) for s in shards)
    back = megatron_to_hf(shards, arch)
    assert set(back) == set(hf)
    assert all(back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]) for k in hf)


def test_round_trip_of_a_real_tiny_folder_and_fused_norm_names(tmp_path):
    folder = build_tiny(tmp_path, TEXTS, TinyConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                    num_layers=2, num_heads=4, num_kv_heads=2))
    arch = Arch.from_hf_config(json.loads((folder / "config.json").read_text()))
    hf = load_file(str(folder / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in hf.items()} == hf_shapes(arch)
    te = hf_to_megatron(hf, arch, fused_norms=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te and "decoder.layers.0.input_layernorm.weight" not in te
    back = megatron_to_hf([te], arch, fused_norms=True)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_pipeline_stage_parts_convert_alone():
    arch = Arch.from_hf_config(qwen2_config(num_hidden_layers=4))
    hf = random_hf(arch)
    stage = hf_to_megatron(hf, arch, layers=range(2, 4), embedding=False, head=True)
    assert set(stage) == set(megatron_names(arch, layers=range(2, 4), embedding=False))
    local = renumber(stage, -2)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in local and "decoder.layers.3.mlp.linear_fc1.weight" not in local
    back = megatron_to_hf([renumber(local, 2)], arch, layers=range(2, 4), embedding=False)
    assert set(back) == {k for k in hf if k.startswith(("model.layers.2.", "model.layers.3.", "model.norm", "lm_head"))}
    assert all(torch.equal(back[k], hf[k]) for k in back)


def test_shape_mismatch_and_missing_tensor_are_named():
    arch = Arch.from_hf_config(qwen2_config())
    hf = random_hf(arch)
    bad = dict(hf, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ConversionError, match="up_proj.weight has shape"):
        hf_to_megatron(bad, arch)
    with pytest.raises(ConversionError, match="missing HF tensor model.norm.weight"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "model.norm.weight"}, arch)
    with pytest.raises(ConversionError, match="tensor parallel size 4"):
        hf_to_megatron(hf, arch, tp_size=4)
