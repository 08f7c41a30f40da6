"""One reading of a model's config.json (stoa.models.hfconfig) for every stack, and the start-up
parity check (stoa.fleet.parity) on random-weight models: golden values for both transformers
layouts, what is refused and why, the MLX engine reading RoPE's base from the nested layout,
a misreading engine refused in one line, bfloat16 logits on the host sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stoa.models import hfconfig
from stoa.models.hfconfig import ModelConfigError

# SmolLM2-135M-Instruct's config.json as transformers 5 writes it (save_pretrained), abridged.
TF5 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 576,
       "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
       "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 9.999999747378752e-06,
       "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
       "vocab_size": 49152}
# The same model as transformers 4 writes it.
TF4 = {**{k: v for k, v in TF5.items() if k != "rope_parameters"}, "rope_theta": 100000.0, "rope_scaling": None}
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
          "original_max_position_embeddings": 8192}


def test_both_transformers_layouts_read_to_the_same_golden_spec():
    a, b = hfconfig.read(TF5), hfconfig.read(TF4)
    assert a == b
    assert (a.rope_theta, a.rope_type, a.head_dim, a.num_key_value_heads, a.tie_word_embeddings) == (
        100000.0, "default", 64, 3, True)
    assert a.rms_norm_eps == pytest.approx(1e-5) and a.max_position_embeddings == 8192


def test_rope_scaling_reads_alike_in_both_layouts():
    tf4 = {**TF4, "rope_theta": 500000.0, "rope_scaling": LLAMA3}
    tf5 = {**TF5, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}
    old = {**tf4, "rope_scaling": {**{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"}}
    # transformers 5 as some versions save it: the base inside rope_scaling too, not in rope_parameters
    mirrored = {**tf4, "rope_scaling": {**LLAMA3, "rope_theta": 500000.0}, "rope_parameters": LLAMA3}
    specs = {hfconfig.read(c) for c in (tf4, tf5, old, mirrored)}
    assert len(specs) == 1
    spec = specs.pop()
    assert spec.rope_type == "llama3" and dict(spec.rope_scaling)["factor"] == 32.0 and spec.rope_theta == 500000.0


def test_missing_fields_take_transformers_defaults_not_mlx_lms():
    bare = {k: v for k, v in TF4.items() if k not in ("rope_theta", "rope_scaling", "tie_word_embeddings",
                                                      "head_dim", "rms_norm_eps")}
    spec = hfconfig.read(bare)
    # mlx-lm's llama would tie the head and use eps it has no default for; transformers does not tie.
    assert (spec.tie_word_embeddings, spec.rope_theta, spec.rms_norm_eps, spec.head_dim) == (False, 10000.0, 1e-6, 64)
    qwen2 = {**bare, "model_type": "qwen2", "hidden_size": 576, "num_attention_heads": 9}
    assert hfconfig.read(qwen2).rope_theta == 10000.0  # mlx-lm's qwen2 default is 1e6


def test_normalized_writes_every_field_in_both_layouts_and_reads_back_the_same():
    norm = hfconfig.normalized(TF5)
    assert norm["rope_theta"] == 100000.0 and norm["rope_scaling"] is None
    assert norm["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert hfconfig.read(norm) == hfconfig.read(TF5)
    scaled = hfconfig.normalized({**TF4, "rope_theta": 500000.0, "rope_scaling": LLAMA3})
    assert scaled["rope_scaling"] == LLAMA3 and scaled["rope_parameters"] == {**LLAMA3, "rope_theta": 500000.0}


def test_normalized_config_reads_alike_in_transformers():
    transformers = pytest.importorskip("transformers")
    for raw in (TF5, TF4, {**TF4, "rope_theta": 500000.0, "rope_scaling": LLAMA3}):
        spec = hfconfig.read(raw)
        for cfg in (raw, hfconfig.normalized(raw)):
            tc = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
            rope = tc.rope_parameters
            assert rope["rope_theta"] == spec.rope_theta
            assert {k: v for k, v in rope.items() if k != "rope_theta" and not (k == "rope_type" and v == "default")} \
                == dict(spec.rope_scaling)
            assert (tc.head_dim, tc.tie_word_embeddings, tc.rms_norm_eps) == (
                spec.head_dim, spec.tie_word_embeddings, spec.rms_norm_eps)


@pytest.mark.parametrize("change, says", [
    ({"rope_theta": 10000.0}, "rope_theta 10000 and rope_parameters.rope_theta 100000 disagree"),
    ({"rope_scaling": {**LLAMA3, "rope_theta": 1e4}, "rope_parameters": {**LLAMA3, "rope_theta": 1e5}},
     "rope_parameters.rope_theta 100000 and rope_scaling.rope_theta 10000 disagree"),
    ({"layer_types": ["sliding_attention", "full_attention"] * 15, "sliding_window": 4096}, "sliding-window"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window"),
    ({"model_type": "phi3"}, "model_type 'phi3' is not supported"),
    ({"rope_parameters": {"rope_theta": 1e5, "rope_type": "longrope", "factor": 4.0}}, "RoPE type 'longrope'"),
    ({"quantization_config": {"bits": 4}}, "already quantized"),
    ({"num_key_value_heads": 4}, "not a multiple"),
    ({"hidden_size": -1}, "hidden_size must be positive"),
])
def test_what_some_stack_would_not_run_as_written_is_refused_in_one_line(change, says):
    with pytest.raises(ModelConfigError, match=says) as e:
        hfconfig.read({**TF5, **change})
    assert "\n" not in str(e.value)


def test_qwen2_head_dim_that_mlx_lm_would_ignore_is_refused():
    cfg = {**TF5, "model_type": "qwen2", "head_dim": 128}
    with pytest.raises(ModelConfigError, match="head_dim 128 != hidden_size / num_attention_heads"):
        hfconfig.read(cfg)


def test_disagreements_name_each_field():
    spec = hfconfig.read(TF5)
    assert hfconfig.disagreements(spec, {"rope_theta": 100000.0, "rope_scaling": {"rope_type": "default"}}) == []
    assert hfconfig.disagreements(spec, {"rope_theta": 10000.0, "tie_word_embeddings": False}) == [
        "rope_theta: built 10000.0, config 100000.0", "tie_word_embeddings: built False, config True"]


# -- the MLX engine and the parity check on random-weight models ---------------------------------

mx = pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")

TEXTS = ["the river runs to the sea and the town lies on its bank"] * 40
# A random tiny Llama with RoPE's base written as transformers 5 does (nested), not mlx-lm's 1e4.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "vocab_size": 512,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
              "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
              "attention_bias": False, "mlp_bias": False}


@pytest.fixture(scope="module")
def nested_llama(tmp_path_factory):
    from stoa.models.presets import build_preset

    out = build_preset(tmp_path_factory.mktemp("llama-nested"), TINY_LLAMA, TEXTS, tokenizer_vocab=300,
                       init_std=0.2)
    cfg = json.loads((out / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 100000.0  # as transformers 5 writes
    return out


def _misreading_engine(path, state):
    """An engine built the way plain mlx_lm reads the folder (no normalized config)."""
    from mlx_lm.utils import load_model

    from stoa.backends.engine import EngineConfig
    from stoa.backends.mlx import weights as W
    from stoa.backends.mlx.engine import MLXEngine

    model, cfg = load_model(path, lazy=True, strict=False)
    W.quantize(model, cfg)
    W.load_state_into(model, dict(state))
    return MLXEngine(path, model, cfg, "dequantized", 0, EngineConfig())


def test_engine_reads_the_nested_rope_base(nested_llama):
    from stoa.backends.mlx import MLXEngine

    eng = MLXEngine.from_pretrained(nested_llama, mode="dequantized")
    assert eng.built_config["rope_theta"] == 100000.0
    rope = eng.mlx_model.model.layers[0].self_attn.rope
    assert rope.base == 100000.0


def test_parity_check_refuses_an_engine_that_misreads_the_rope_base(nested_llama):
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.backends.mlx import MLXEngine
    from stoa.fleet import parity
    from stoa.transport.quant import quantize_state

    learner = make_learner("torch", nested_llama, LearnerConfig(threads=1))
    state = quantize_state(learner.iter_weights("float32"))
    good = MLXEngine.from_state(nested_llama, dict(state), 0, mode="dequantized")
    got = parity.check(nested_llama, learner, good)
    assert got.int8_vs_float < parity.INT8_BOUND and got.scorer_vs_float is None
    bad = _misreading_engine(nested_llama, state)
    assert bad.built_config["rope_theta"] == 10000.0
    with pytest.raises(parity.ParityError) as e:
        parity.check(nested_llama, learner, bad)
    assert str(e.value) == ("the engine built the model differently from the run's config: "
                            "rope_theta: built 10000.0, config 100000.0")
    assert parity.join_check(bad, nested_llama) == str(e.value)
    assert parity.join_check(good, nested_llama) is None


def test_audit_floor_above_the_bound_is_an_error():
    from stoa.fleet import parity

    parity.check_floor(0.06)
    with pytest.raises(parity.ParityError, match="floor 0.630 nat is above the 0.15 bound"):
        parity.check_floor(0.63)


def test_check_runnable_refuses_a_sliding_window_model_naming_the_reason(tmp_path):
    from stoa.fleet.config import ConfigError, RunConfig, check_runnable

    (tmp_path / "config.json").write_text(json.dumps({**TF5, "layer_types": ["sliding_attention"] * 30,
                                                      "sliding_window": 512}))
    cfg = RunConfig.from_dict({"name": "x", "model": {"path": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"cannot be run: .*sliding-window attention \(layer_types"):
        check_runnable(cfg)


def test_bfloat16_model_on_the_int8_kernels_samples_on_the_host(tmp_path):
    """A real checkpoint is bfloat16, so the int8 kernels' logits are too; numpy has no such buffer format."""
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig
    from stoa.backends.mlx import MLXEngine
    from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts
    from stoa.models.presets import build_preset
    import stoa.envs

    corpus = SyntheticConfig(seed=0, num_entities=20, num_test_facts=5)
    path = build_preset(tmp_path / "bf16", TINY_LLAMA, list(tokenizer_texts(generate(corpus))), tokenizer_vocab=400,
                        dtype="bfloat16")
    eng = MLXEngine.from_pretrained(path, mode="quantized", config=EngineConfig(max_batch=4, sampler="host"))
    eps = eng.rollout(lambda: stoa.envs.make("stoa/SyntheticSearch-v0", config=corpus),
                      [RolloutRequest(0, "g0", 2)], SamplingConfig(max_turn_tokens=6, max_episode_tokens=200, seed=1))
    assert len(eps) == 2 and all(e.num_model_tokens > 0 for e in eps)
    lp = np.concatenate([e.behavior_logprobs()[e.loss_mask()] for e in eps])
    assert np.isfinite(lp).all() and (lp <= 0).all()


def test_stoa_trainer_refuses_a_sliding_window_model_before_publishing(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from stoa.transport.signing import generate_private_key, save_keypair

    model = tmp_path / "gemma-like"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TF5, "use_sliding_window": True, "sliding_window": 4096}))
    key, _ = save_keypair(generate_private_key(), tmp_path / "keys", "run")
    config = Path(__file__).resolve().parents[1] / "examples" / "arithmetic_tiny.toml"
    r = subprocess.run([sys.executable, "-m", "stoa", "trainer", str(config), "--store", str(tmp_path / "store"),
                        "--key", str(key), "--run-dir", str(tmp_path / "run"), "--set", f"model.path={model}"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "sliding-window attention (sliding_window 4096) is not supported" in r.stderr, r.stderr
    store = tmp_path / "store"
    assert not store.exists() or not any(p.is_file() for p in store.rglob("*"))
