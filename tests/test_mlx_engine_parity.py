"""MLX vs torch: float32 logits parity, and the int8 engine's gap to the float32 torch policy.

The gap is what the trainer's DPPO gate sees as train/inference mismatch: per model token,
``log mu`` (int8 engine, behaviour) against ``log pi`` (float32 torch on the same tokens).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")
torch = pytest.importorskip("torch", reason="parity against torch needs torch")
transformers = pytest.importorskip("transformers", reason="parity against torch needs transformers")

import stoa.envs  # noqa: E402
from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig  # noqa: E402
from stoa.backends.mlx import MLXEngine  # noqa: E402
from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts  # noqa: E402
from stoa.models.tiny import TinyConfig, build_tiny  # noqa: E402

CORPUS = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
MODEL = TinyConfig(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=256, seed=0, init_std=0.05)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), list(tokenizer_texts(generate(CORPUS))), MODEL)


@pytest.fixture(scope="module")
def torch_model(tiny):
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    return m.eval()


def torch_logprobs(model, tokens: np.ndarray, temperature: float) -> np.ndarray:
    """``log pi(tokens[t] | tokens[:t])`` at the temperature, aligned like ``Episode.tokens()``."""
    with torch.no_grad():
        logits = model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].float() / temperature
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:, None], dtype=torch.long))[:, 0]
    return np.concatenate([[0.0], lp.numpy()]).astype(np.float32)


def test_mlx_float32_logits_match_torch_float32(tiny, torch_model):
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(tiny))  # float32, unquantized
    rng = np.random.default_rng(0)
    vocab = torch_model.config.vocab_size
    x = rng.integers(0, vocab, size=(3, 40))
    ours = np.array(model(mx.array(x)).astype(mx.float32))
    with torch.no_grad():
        theirs = torch_model(torch.tensor(x)).logits.float().numpy()
    assert ours.shape == theirs.shape == (3, 40, vocab)
    err = np.abs(ours - theirs).max()
    assert err < 1e-4, f"max |logit difference| {err:.2e}"
    assert theirs.std() > 0.1  # the comparison is not between two near-constant outputs


@pytest.mark.parametrize("mode", ["dequantized", "quantized"])
def test_int8_engine_vs_float32_torch_mismatch(tiny, torch_model, mode, record_property):
    eng = MLXEngine.from_pretrained(tiny, mode=mode, config=EngineConfig(max_batch=16))
    temperature = 0.8
    env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", config=CORPUS)  # noqa: E731
    eps = eng.rollout(env, [RolloutRequest(i, f"g{i}", 3) for i in range(6)],
                      SamplingConfig(temperature=temperature, max_turn_tokens=12, max_episode_tokens=400, seed=11))
    mu, pi = [], []
    for ep in eps:
        m = ep.loss_mask()
        mu.append(ep.behavior_logprobs()[m])
        pi.append(torch_logprobs(torch_model, ep.tokens(), temperature)[m])
    mu, pi = np.concatenate(mu), np.concatenate(pi)
    d = mu - pi
    ratio = np.exp(-d)  # pi / mu
    report = {
        "tokens": int(d.size),
        "mean_abs_dlogprob": float(np.abs(d).mean()),
        "max_abs_dlogprob": float(np.abs(d).max()),
        "kl_k1": float(d.mean()),  # E_mu[log mu - log pi]: tokens were drawn from mu
        "kl_k3": float((ratio - 1 - np.log(ratio)).mean()),  # non-negative estimator of the same KL
        "mean_logprob": float(mu.mean()),
    }
    for k, v in report.items():
        record_property(k, v)
    print(f"\nint8 ({mode}) vs float32 torch: {report}")
    assert d.size > 200
    # The int8 rounding is small next to the entropy of the policy: the DPPO gate sees ~1e-3 gaps.
    assert report["mean_abs_dlogprob"] < 0.02 and report["max_abs_dlogprob"] < 0.2
    assert 0 <= report["kl_k3"] < 1e-3 and abs(report["kl_k1"]) < 5e-3
    assert report["mean_abs_dlogprob"] > 1e-6  # int8 is not float32: a real, measured gap
