"""The families people fine-tune (Qwen2.5, Qwen3, Llama 3.x / SmolLM2, Mistral, Gemma 2, Gemma 3)
on every stack: their real configs read to golden specs alike in transformers and the run's
normalized file, what a stack cannot build is refused in one line, and on small random models of
each family's real structure with a 16-token window the MLX engine (both compute modes, decode
and scoring), the torch learner (packed and padded) and the torch int8 scorer agree at positions
well beyond the window."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stoa.models import hfconfig
from stoa.models.hfconfig import FULL, SLIDING, ModelConfigError

# Public config.json files (the keys that fix numerics), as their checkpoints ship them.
GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
             "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
             "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8,
             "num_hidden_layers": 26, "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
             "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000}
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
             "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
             "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
             "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
             "sliding_window_pattern": 6, "vocab_size": 262144}
# The same model as transformers 5 writes it: layer_types, RoPE nested per layer type.
GEMMA3_1B_TF5 = {**{k: v for k, v in GEMMA3_1B.items() if k not in ("rope_local_base_freq", "rope_scaling",
                                                                    "rope_theta", "sliding_window_pattern")},
                 "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(26)],
                 "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1000000.0},
                                     SLIDING: {"rope_type": "default", "rope_theta": 10000.0}}}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
              "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
              "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000}
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
              "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
              "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
              "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
              "use_sliding_window": False, "vocab_size": 151936}
LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 2048,
              "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "max_position_embeddings": 131072, "tie_word_embeddings": True, "vocab_size": 128256,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def test_gemma2_reads_to_its_golden_spec():
    s = hfconfig.read(GEMMA2_2B)
    assert s.layer_types == (SLIDING, FULL) * 13 and s.sliding_window == 4096
    assert s.windows[:3] == (4096, None, 4096)
    assert (s.attention_scale, s.attn_logit_softcapping, s.final_logit_softcapping) == (1 / 16, 50.0, 30.0)
    assert (s.hidden_act, s.tie_word_embeddings, s.rope_theta, s.rope_local_theta) == (
        "gelu_pytorch_tanh", True, 10000.0, None)


def test_gemma3_reads_alike_in_both_transformers_layouts():
    a, b = hfconfig.read(GEMMA3_1B), hfconfig.read(GEMMA3_1B_TF5)
    assert a == b
    assert a.layer_types[:6] == (SLIDING,) * 5 + (FULL,) and a.layer_types.count(FULL) == 4
    assert (a.sliding_window, a.rope_theta, a.rope_local_theta, a.head_dim, a.num_key_value_heads) == (
        512, 1e6, 1e4, 256, 1)
    assert a.attn_logit_softcapping is a.final_logit_softcapping is None and a.attention_scale == 1 / 16


def test_mistral_qwen_and_llama_windows():
    m = hfconfig.read(MISTRAL_7B)
    assert m.windows == (4096,) * 32 and m.attention_scale == 128 ** -0.5 and not m.tie_word_embeddings
    assert hfconfig.read({**MISTRAL_7B, "sliding_window": None}).sliding_window is None  # Mistral v0.2 on
    # Qwen2.5 ships sliding_window and max_window_layers with use_sliding_window off: full attention.
    q = hfconfig.read(QWEN25_05B)
    assert q.sliding_window is None and set(q.layer_types) == {FULL}
    q = hfconfig.read({**QWEN25_05B, "use_sliding_window": True, "sliding_window": 4096})
    assert q.windows == (None,) * 21 + (4096,) * 3  # layers from max_window_layers on slide
    ll = hfconfig.read(LLAMA32_1B)
    assert ll.sliding_window is None and ll.rope_type == "llama3" and ll.head_dim == 64


@pytest.mark.parametrize("raw", [GEMMA2_2B, GEMMA3_1B, GEMMA3_1B_TF5, MISTRAL_7B, QWEN25_05B, LLAMA32_1B,
                                 {**QWEN25_05B, "use_sliding_window": True, "max_window_layers": 20}],
                         ids=["gemma2", "gemma3", "gemma3-tf5", "mistral", "qwen2.5", "llama3.2", "qwen2-window"])
def test_transformers_reads_the_raw_and_the_normalized_config_as_the_spec_says(raw):
    transformers = pytest.importorskip("transformers")
    spec = hfconfig.read(raw)
    norm = hfconfig.normalized(raw)
    assert hfconfig.read(norm) == spec
    for cfg in (raw, norm):
        tc = transformers.CONFIG_MAPPING[raw["model_type"]](**{k: v for k, v in cfg.items() if k != "model_type"})
        window = getattr(tc, "sliding_window", None)  # Mistral: every layer; Llama has none
        types = getattr(tc, "layer_types", None) or [SLIDING if window else FULL] * spec.num_hidden_layers
        assert tuple(types) == spec.layer_types
        if spec.sliding_window is not None:
            assert window == spec.sliding_window
        rope = tc.rope_parameters
        full = rope.get(FULL, rope)
        assert full["rope_theta"] == spec.rope_theta
        assert {k: v for k, v in full.items() if k != "rope_theta" and not (k == "rope_type" and v == "default")} \
            == dict(spec.rope_scaling)
        if spec.rope_local_theta is not None:
            assert rope[SLIDING]["rope_theta"] == spec.rope_local_theta
        assert getattr(tc, "query_pre_attn_scalar", spec.head_dim) ** -0.5 == spec.attention_scale
        assert getattr(tc, "attn_logit_softcapping", None) == spec.attn_logit_softcapping
        assert getattr(tc, "final_logit_softcapping", None) == spec.final_logit_softcapping
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads  # Qwen2 has none
        assert (head_dim, tc.tie_word_embeddings) == (spec.head_dim, spec.tie_word_embeddings)


@pytest.mark.parametrize("raw, change, says", [
    (GEMMA3_1B, {"final_logit_softcapping": 30.0}, "gemma3_text with soft-capping .*mlx-lm's gemma3_text applies none"),
    (GEMMA3_1B_TF5, {"layer_types": [SLIDING] * 5 + [FULL] + [SLIDING] * 4 + [FULL] * 16}, "not sliding_window_pattern - 1 sliding layers"),
    (GEMMA3_1B, {"sliding_window_pattern": 27}, "sliding_window_pattern must be an integer from 1"),
    (GEMMA3_1B_TF5, {"rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1e6},
                                         SLIDING: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}}},
     "RoPE scaling on gemma3_text's sliding layers"),
    (GEMMA3_1B, {"rope_local_base_freq": 20000, "rope_parameters": {SLIDING: {"rope_theta": 10000.0}}},
     "rope_local_base_freq 20000 and rope_parameters.sliding_attention.rope_theta 10000 disagree"),
    (GEMMA2_2B, {"tie_word_embeddings": False}, "untied head is not supported"),
    (GEMMA2_2B, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "gemma2 with RoPE scaling"),
    (GEMMA2_2B, {"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    (GEMMA2_2B, {"use_bidirectional_attention": True}, "causal LMs only"),
    (GEMMA2_2B, {"sliding_window": None}, "sliding layers but sliding_window is null"),
    (MISTRAL_7B, {"layer_types": [FULL] * 32}, "mistral with layer_types is not read alike"),
    (MISTRAL_7B, {"attention_bias": True}, "mistral with attention_bias"),
    (QWEN25_05B, {"layer_types": [SLIDING] * 24}, "layer_types name sliding layers but use_sliding_window"),
    (LLAMA32_1B, {"layer_types": [SLIDING] * 16, "sliding_window": 64}, "not supported for llama"),
])
def test_what_no_stack_reads_alike_is_refused_naming_why(raw, change, says):
    with pytest.raises(ModelConfigError, match=says) as e:
        hfconfig.read({**raw, **change})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("raw, says", [
    (GEMMA2_2B, "the megatron learner does not build model_type 'gemma2'"),
    (GEMMA3_1B, "the megatron learner does not build model_type 'gemma3_text'"),
    (MISTRAL_7B, "the megatron learner does not build model_type 'mistral'"),
    (LLAMA32_1B, "the megatron learner does not implement RoPE scaling 'llama3'"),
    ({**QWEN25_05B, "use_sliding_window": True}, r"does not implement sliding-window attention \(window 32768\)"),
])
def test_megatron_refuses_the_families_it_cannot_build_and_torch_takes_them(raw, says):
    with pytest.raises(ModelConfigError, match=says):
        hfconfig.check_learner(raw, "megatron")
    assert hfconfig.check_learner(raw, "torch") == hfconfig.read(raw)
    assert hfconfig.check_learner(QWEN25_05B, "megatron") == hfconfig.read(QWEN25_05B)


def test_check_runnable_refuses_a_family_the_runs_learner_cannot_build(tmp_path):
    from stoa.fleet.config import ConfigError, RunConfig, check_runnable

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_1B))
    check_runnable(RunConfig.from_dict({"name": "x", "model": {"path": str(tmp_path)}}))
    cfg = RunConfig.from_dict({"name": "x", "model": {"path": str(tmp_path)}, "learner": {"kind": "megatron"}})
    with pytest.raises(ConfigError, match="cannot be run: .*megatron learner does not build model_type 'gemma3_text'"):
        check_runnable(cfg)


# -- every stack on small random models of each family's structure, a 16-token window ------------

pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")
pytest.importorskip("torch", reason="the learner needs torch")

from helpers import FAMILY_TEXTS as TEXTS  # noqa: E402
from helpers import FAMILY_WINDOW as WINDOW  # noqa: E402
from helpers import family_structure as structure  # noqa: E402

FAMILIES = ["qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b-v0.1", "gemma-2-2b", "gemma-3-1b"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.models.presets import build_preset
    from stoa.transport.quant import quantize_state

    path = build_preset(tmp_path_factory.mktemp(request.param), structure(request.param), TEXTS,
                        tokenizer_vocab=300, init_std=0.05)
    types = hfconfig.read(hfconfig.load(path)).layer_types
    assert SLIDING in types and (FULL in types or request.param.startswith("mistral"))  # both kinds where they mix
    learner = make_learner("torch", path, LearnerConfig(threads=1))
    return request.param, path, learner, quantize_state(learner.iter_weights("float32"))


def test_engine_decode_score_learner_and_int8_scorer_agree_beyond_the_window(family):
    import stoa.envs
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.backends.mlx import MLXEngine
    from stoa.backends.mlx.attention import set_window
    from stoa.backends.torch.int8 import make_scorer
    from stoa.envs.synthetic import SyntheticConfig
    from stoa.fleet import parity

    name, path, learner, state = family
    corpus = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
    eng = MLXEngine.from_state(path, dict(state), 0, mode="dequantized",
                               config=EngineConfig(max_batch=5, prefill_chunk=7))
    # Multi-turn episodes: observations prefilled onto kept caches, rows joining and leaving.
    eps = eng.rollout(lambda: stoa.envs.make("stoa/SyntheticSearch-v0", config=corpus),
                      [RolloutRequest(i, f"g{i}", 2) for i in range(3)],
                      SamplingConfig(max_turn_tokens=10, max_episode_tokens=150, seed=3))
    assert min(len(e) for e in eps) > 6 * WINDOW and max(e.metrics["turns"] for e in eps) >= 2
    mu = [e.behavior_logprobs() for e in eps]
    scored = eng.score(eps)
    assert parity.gap(mu, scored, eps)[1] < 1e-4  # batched decode with masked caches == one forward pass
    fl = learner.logprobs(eps, temperature=None)
    padded = make_learner("torch", path, LearnerConfig(threads=1, packing=False)).logprobs(eps, temperature=None)
    assert parity.gap(padded, fl, eps)[1] < 1e-4  # the packed learner's windows == transformers' own masks
    scorer = make_scorer(path, "cpu", "float32")
    scorer.load_state(0, state)
    sc = scorer.score(eps)
    quantized = MLXEngine.from_state(path, dict(state), 0, mode="quantized").score(eps)
    assert parity.gap(scored, sc, eps)[1] < 1e-4 and parity.gap(quantized, sc, eps)[1] < 1e-4
    e_f = parity.gap(mu, fl, eps)[0]
    print(f"{name}: engine vs float {e_f:.4f} nat (int8 rounding), engine vs scorer {parity.gap(scored, sc, eps)[0]:.1e}")
    assert 1e-4 < e_f < parity.INT8_BOUND
    if name != "gemma-3-1b":  # mlx-lm masks Gemma 3's windows itself; elsewhere the engine's windows are the only ones
        for layer in eng.mlx_model.layers:
            set_window(layer.self_attn, None)
        assert parity.gap(eng.score(eps), sc, eps)[0] > 0.05  # the window changes what is computed
    got = parity.check(path, learner, MLXEngine.from_state(path, dict(state), 0, mode="dequantized"), scorer)
    assert got.engine_vs_scorer < 1e-4


def test_both_stacks_report_what_they_built_and_a_misread_window_is_named(family):
    from stoa.backends.mlx import MLXEngine
    from stoa.backends.mlx import weights as W
    from stoa.backends.mlx.attention import set_window, window_of
    from stoa.backends.torch import families

    _, path, learner, state = family
    spec = hfconfig.read(hfconfig.load(path))
    assert hfconfig.disagreements(spec, families.built_fields(learner.model)) == []
    model = MLXEngine.from_state(path, dict(state), 0, mode="dequantized").mlx_model
    assert hfconfig.disagreements(spec, W.built_fields(model)) == []
    last = model.layers[-1].self_attn
    set_window(last, None if window_of(last) else WINDOW)
    assert [w for w in hfconfig.disagreements(spec, W.built_fields(model)) if w.startswith("layer_types: built")]
