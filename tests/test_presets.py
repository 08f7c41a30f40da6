"""Real-shape presets: exact tensor layouts of public checkpoints, padded vocabularies, streamed
files that transformers and mlx_lm both load (shrunk shapes keep the loads fast)."""

import hashlib
import json

import numpy as np
import pytest

from stoa.models.presets import PRESETS, build_preset, num_params, tensor_specs

from test_tiny import texts

# Published parameter counts of the checkpoints the presets copy.
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
             "qwen2.5-7b": 7_615_616_512, "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360,
             "llama-3.2-1b": 1_235_814_400, "smollm2-135m": 134_515_008, "mistral-7b-v0.1": 7_241_732_096,
             "gemma-2-2b": 2_614_341_888, "gemma-3-1b": 999_885_952}


def shrink(name: str, vocab: int = 4096) -> dict:
    """The preset's architecture (norms, biases, head_dim, tying, rope) at a few MB."""
    c = dict(PRESETS[name], vocab_size=vocab, num_hidden_layers=2, intermediate_size=256)
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    c["num_attention_heads"], c["num_key_value_heads"] = 4, 4 // max(1, heads // kv) if heads // kv <= 4 else 1
    c["hidden_size"] = 256 if "head_dim" not in c else 128
    if "head_dim" in c:
        c["head_dim"] = 64
    return c


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_specs_match_transformers_exactly(name):
    """Every tensor name and shape equals what transformers builds from the same config."""
    import torch
    import transformers

    assert num_params(PRESETS[name]) == PUBLISHED[name]
    cfg = transformers.AutoConfig.for_model(**PRESETS[name])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert {n: s for n, s, _ in tensor_specs(PRESETS[name])} == theirs


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "qwen2.5-7b"])
def test_shrunk_preset_loads_in_mlx_and_transformers_with_same_logits(name, tmp_path):
    import mlx.core as mx
    import mlx_lm
    import torch
    import transformers

    cfg = shrink(name)
    out = build_preset(tmp_path / name, cfg, texts(), tokenizer_vocab=512)
    c = json.loads((out / "config.json").read_text())
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok["added_tokens"]]
    assert max(ids) < 512 < c["vocab_size"] == 4096  # padded embedding, as Qwen pads its own
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    m, t = mlx_lm.load(str(out))
    x = t.encode("Kavorin inhibits <search> Mertil </search>")
    with torch.no_grad():
        a = hf(torch.tensor([x])).logits[0].numpy()
    b = np.array(m(mx.array([x]))[0])
    assert a.shape == b.shape == (len(x), 4096)
    assert np.abs(a - b).max() < 1e-3 * max(1.0, np.abs(a).max())


def test_streamed_file_is_deterministic_and_seeded(tmp_path):
    cfg = shrink("qwen2.5-0.5b")
    a = build_preset(tmp_path / "a", cfg, texts(), tokenizer_vocab=512)
    b = build_preset(tmp_path / "b", cfg, texts(), tokenizer_vocab=512)
    c = build_preset(tmp_path / "c", cfg, texts(), tokenizer_vocab=512, seed=1)
    h = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert h(a) == h(b) != h(c)
    from safetensors.numpy import load_file

    w = load_file(str(a / "model.safetensors"))
    assert w["model.layers.0.input_layernorm.weight"].min() == 1.0
    assert np.all(w["model.layers.0.self_attn.q_proj.bias"] == 0)
    assert 0.015 < w["model.embed_tokens.weight"].std() < 0.025


def test_bfloat16_and_config_json_input(tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(shrink("llama-3.2-1b")))
    out = build_preset(tmp_path / "m", src / "config.json", texts(), tokenizer_vocab=512, dtype="bfloat16")
    w = load_file(str(out / "model.safetensors"))
    assert w["model.embed_tokens.weight"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        build_preset(tmp_path / "x", "no-such-model", texts())
    with pytest.raises(ValueError, match="exceeds"):
        build_preset(tmp_path / "x", shrink("qwen2.5-0.5b", vocab=600), texts(), tokenizer_vocab=2048)
    with pytest.raises(ValueError, match="model_type"):
        build_preset(tmp_path / "x", {**shrink("qwen2.5-0.5b"), "model_type": "gpt2"}, texts())


def test_init_tiny_preset_cli(tmp_path):
    from typer.testing import CliRunner

    from stoa.cli import app

    (tmp_path / "text.txt").write_text("\n".join(texts()))
    (tmp_path / "config.json").write_text(json.dumps(shrink("qwen3-0.6b")))
    r = CliRunner().invoke(app, ["init-tiny", str(tmp_path / "m"), "--text", str(tmp_path / "text.txt"),
                                 "--vocab-size", "400", "--preset", str(tmp_path / "config.json")])
    assert r.exit_code == 0, r.output
    assert "vocab 4096" in r.output and json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen3"
    r = CliRunner().invoke(app, ["init-tiny", str(tmp_path / "bad"), "--preset", "gpt-5"])
    assert r.exit_code != 0 and "neither a preset" in r.output
