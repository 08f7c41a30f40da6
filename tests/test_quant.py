"""int8 quantization: bit parity with MLX, mlx_lm's choice of tensors, and the re-quantization policy."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoa.models.tiny import TinyConfig, build_tiny
from stoa.transport.quant import (
    RequantPolicy,
    dequantize,
    dequantize_state,
    is_quantized,
    quantize,
    quantize_state,
)

mx = pytest.importorskip("mlx.core", reason="MLX parity tests need mlx")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]


def to_mx(a: np.ndarray):
    if a.dtype == BF16:
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    return mx.array(a)


def to_np(a) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)).view(BF16)
    return np.array(a)


def mlx_quantize(w: np.ndarray, group_size=64):
    q, s, b = mx.quantize(to_mx(w), group_size=group_size, bits=8)
    return np.array(q).view(np.uint8).reshape(w.shape), to_np(s), to_np(b)


def assert_same_bytes(a: np.ndarray, b: np.ndarray, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)), what


def edge_cases(rng, dtype):
    big = {np.dtype(np.float32): 1e37, np.dtype(np.float16): 6e4, BF16: 1e37}[dtype]
    tiny = {np.dtype(np.float32): 1e-40, np.dtype(np.float16): 1e-7, BF16: 1e-40}[dtype]
    base = rng.standard_normal((6, 192))
    cases = {
        "normal": base,
        "constant groups": np.repeat(rng.standard_normal((6, 3)), 64, axis=1),
        "zeros": np.zeros((6, 192)),
        "negative only": -np.abs(base) - 0.5,
        "positive only": np.abs(base) + 0.5,
        "huge": base * big / 4,
        "huge range": np.where(base > 0, big, -big / 3),
        "tiny": base * tiny,
        "tiny mixed with zero": np.where(base > 0.5, tiny, 0.0),
        "discrete": np.round(base * 4) / 4,
        "one outlier": np.where(np.arange(192) % 64 == 7, 1e3 if dtype != np.float16 else 6e4, base * 1e-3),
        "symmetric": np.concatenate([base[:, :96], -base[:, :96]], axis=1),
    }
    for scale in 10.0 ** rng.uniform(-6, 6, size=6):
        cases[f"scaled {scale:.2g}"] = base * scale
    with np.errstate(over="ignore"):
        return {k: np.asarray(v).astype(dtype) for k, v in cases.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bit_parity_with_mlx_on_edge_cases(dtype):
    rng = np.random.default_rng(1)
    for what, w in edge_cases(rng, dtype).items():
        with np.errstate(over="ignore"):
            if not np.isfinite(w.astype(np.float32)).all():
                continue
        codes, scales, biases = quantize(w)
        mq, ms, mb = mlx_quantize(w)
        assert_same_bytes(codes, mq, f"codes {what}")
        assert_same_bytes(scales, ms, f"scales {what}")
        assert_same_bytes(biases, mb, f"biases {what}")
        # the weights of record: MLX's dequantize of the same codes with the scales taken to float32
        got = dequantize(codes, scales, biases)
        f32 = lambda a: to_mx(a).astype(mx.float32)  # noqa: E731
        want = to_np(mx.dequantize(mx.array(mq.view(np.uint32)), f32(ms), f32(mb), group_size=64, bits=8))
        with np.errstate(over="ignore", invalid="ignore"):
            if not np.isfinite(want).all():  # a huge bfloat16 group overflows float32: nothing to compare
                continue
        assert_same_bytes(got, want, f"dequantize {what}")


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_bit_parity_with_mlx_on_random_tensors(group_size):
    rng = np.random.default_rng(group_size)
    for i in range(30):
        dtype = DTYPES[i % 3]
        rows, groups = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        w = rng.standard_normal((rows, groups * group_size)) * 10.0 ** rng.uniform(-4, 3)
        w += rng.standard_normal((rows, 1)) * rng.uniform(0, 3) * np.abs(w).mean()  # offset groups
        w = w.astype(dtype)
        mq, ms, mb = mlx_quantize(w, group_size)
        codes, scales, biases = quantize(w, group_size)
        assert_same_bytes(codes, mq, f"codes {i}")
        assert_same_bytes(scales, ms, f"scales {i}")
        assert_same_bytes(biases, mb, f"biases {i}")


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 6), groups=st.integers(1, 3),
       mode=st.sampled_from(["bits", "normal", "few values"]), exp=st.floats(-30, 30), seed=st.integers(0, 2**32 - 1))
def test_bit_parity_with_mlx_property(dtype, rows, groups, mode, exp, seed):
    rng = np.random.default_rng(seed)
    shape = (rows, groups * 64)
    if mode == "bits":  # arbitrary finite bit patterns: every exponent, subnormals, +-0
        w = np.frombuffer(rng.integers(0, 256, rows * groups * 64 * dtype.itemsize, dtype=np.uint8).tobytes(), dtype)
        w = np.where(np.isfinite(w.astype(np.float32)), w, dtype.type(0)).reshape(shape)
    else:
        with np.errstate(over="ignore"):
            base = rng.standard_normal(shape) if mode == "normal" else rng.choice([-1.5, 0.0, 2.0, 7.25], shape)
            w = (base * 10.0 ** min(exp, 300 if dtype == np.float32 else 4)).astype(dtype)
        w = np.where(np.isfinite(w.astype(np.float32)), w, dtype.type(1)).astype(dtype)
    mq, ms, mb = mlx_quantize(w)
    codes, scales, biases = quantize(w)
    assert_same_bytes(codes, mq, "codes")
    assert_same_bytes(scales, ms, "scales")
    assert_same_bytes(biases, mb, "biases")


def test_three_dims_and_noncontiguous_input():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 5, 128)).astype(np.float32)
    for x in (w, np.asfortranarray(w[0]), w[:, 1, :]):
        mq, ms, mb = mlx_quantize(np.ascontiguousarray(x))
        codes, scales, biases = quantize(x)
        assert_same_bytes(codes, mq)
        assert_same_bytes(scales, ms)


def test_quantize_refuses_bad_input():
    w = np.ones((4, 64), np.float32)
    with pytest.raises(ValueError):
        quantize(np.ones((4, 60), np.float32))
    with pytest.raises(ValueError):
        quantize(np.ones(64, np.float32))
    with pytest.raises(ValueError):
        quantize(w.astype(np.float64))
    with pytest.raises(ValueError):
        quantize(w, bits=4)
    w[1, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        quantize(w)


def test_dequantize_error_is_within_one_step():
    # Half a step, except at the far end of a group, which MLX's exact edge may clip by half a step.
    rng = np.random.default_rng(4)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    codes, scales, biases = quantize(w)
    err = np.abs(dequantize(codes, scales, biases) - w).reshape(16, 4, 64)
    step = np.abs(scales)[..., None]
    assert (err <= step * 1.0001).all() and np.median(err / step) < 0.3


# --- which tensors mlx_lm quantizes --------------------------------------------------------------

TEXTS = [" ".join(np.random.default_rng(i).choice(
    "the kinase binds a receptor in neurons and regulates expression of protein".split(), 9)) for i in range(400)]


def _mlx_quantized_names(model, config):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    quantize_model(model, config, group_size=64, bits=8)
    params = dict(tree_flatten(model.parameters()))
    return params, {k[: -len(".scales")] + ".weight" for k in params if k.endswith(".scales")}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_state_equals_mlx_lm_quantized_model(tmp_path, tied):
    from mlx_lm.utils import load_model
    from safetensors.numpy import load_file

    cfg = TinyConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                     intermediate_size=128, tie_word_embeddings=tied)
    path = build_tiny(tmp_path / "m", TEXTS, cfg)
    weights = load_file(str(path / "model.safetensors"))
    model, config = load_model(path)
    params, quantized = _mlx_quantized_names(model, config)
    assert {n for n, w in weights.items() if is_quantized(n, w.shape)} == quantized
    state = quantize_state(weights)
    assert set(state) == set(params)
    for name, p in params.items():
        ref = np.array(p)
        if p.dtype == mx.uint32:
            ref = ref.view(np.uint8)
        assert_same_bytes(state[name], ref, name)
    assert ("lm_head.scales" in state) == (not tied)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_is_quantized_matches_mlx_lm_on_other_architectures(arch):
    import importlib

    from mlx.utils import tree_flatten

    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    args = dict(model_type=arch, hidden_size=96, num_hidden_layers=2, intermediate_size=192,
                num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6, vocab_size=50,
                rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=128, head_dim=64)
    if arch == "qwen3":
        args.update(head_dim=64)
    model = mod.Model(mod.ModelArgs.from_dict(args))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    _, quantized = _mlx_quantized_names(model, {"model_type": arch})
    mine = {n for n, s in shapes.items() if is_quantized(n, tuple(s))}
    assert mine == quantized
    assert mine and mine != {n for n in shapes if n.endswith(".weight") and len(shapes[n]) == 2}


# --- the re-quantization policy ------------------------------------------------------------------

def _walk(dtype, policy, steps=6, lr=2e-6, seed=5):
    """Quantize a random walk of a weight matrix version by version: (states, float weights)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((64, 512)) * 0.02).astype(np.float32)
    states, ws = [quantize_state({"a.weight": w.astype(dtype)})], [w]
    for _ in range(steps):
        w = w - lr * np.sign(rng.standard_normal(w.shape)).astype(np.float32)
        states.append(quantize_state({"a.weight": w.astype(dtype)}, previous=states[-1], policy=policy))
        ws.append(w)
    return states, ws


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_keep_policy_changes_fewer_codes_and_stays_accurate(dtype):
    kept, ws = _walk(dtype, RequantPolicy())
    fresh, _ = _walk(dtype, RequantPolicy("fresh"))
    for s, w in zip(fresh, ws):  # fresh is exactly MLX's quantization of each version
        for got, want in zip((s["a.weight"], s["a.scales"], s["a.biases"]), quantize(w.astype(dtype))):
            assert_same_bytes(got, want)
    # Skip the first step: bf16/fp16 codes move once from MLX's float32 scale to the stored one.

    def rate(states):
        return np.mean([(a["a.weight"] != b["a.weight"]).mean() for a, b in zip(states[2:], states[1:])])

    assert rate(kept) < rate(fresh)
    # Scales and biases (1/8 of an fp32 matrix's bytes) almost never change under keep; fresh fp32
    # scales change with nearly every step (fp16/bf16 rounding hides most of those changes).
    assert np.mean([(a["a.scales"] == b["a.scales"]).mean() for a, b in zip(kept[2:], kept[1:])]) > 0.99
    if dtype == np.float32:
        assert np.mean([(a["a.scales"] == b["a.scales"]).mean() for a, b in zip(fresh[2:], fresh[1:])]) < 0.5
    # Codes round to nearest against the stored scale and bias (a group's far end may sit up to
    # one step out, as with MLX's own rule).
    s, w = kept[-1], ws[-1].astype(dtype).astype(np.float32)
    step = np.abs(s["a.scales"].astype(np.float32))[..., None]
    deq = s["a.weight"].reshape(64, 8, 64) * s["a.scales"].astype(np.float32)[..., None] \
        + s["a.biases"].astype(np.float32)[..., None]
    err = np.abs(deq - w.reshape(64, 8, 64))
    assert (err <= step * 1.001).all() and (err <= step * 0.501).mean() > 0.995
    err_fresh = np.abs(dequantize_state(fresh[-1])["a.weight"].astype(np.float32) - w).mean()
    err_kept = np.abs(dequantize_state(s)["a.weight"].astype(np.float32) - w).mean()
    assert err_kept <= err_fresh * 1.01


def test_hysteresis_trades_accuracy_for_fewer_changes():
    plain, _ = _walk(np.float32, RequantPolicy())
    lazy, ws = _walk(np.float32, RequantPolicy(hysteresis=0.2))

    def n(states):
        return sum(int((a["a.weight"] != b["a.weight"]).sum()) for a, b in zip(states[1:], states))

    assert n(lazy) < n(plain)
    s = lazy[-1]
    deq = s["a.weight"].reshape(64, 8, 64) * s["a.scales"][..., None] + s["a.biases"][..., None]
    err = np.abs(deq - ws[-1].reshape(64, 8, 64)) / np.abs(s["a.scales"])[..., None]
    assert err.max() > 0.5 and (err <= 0.701).mean() > 0.995  # lags by up to 0.5 + 0.2 steps
    with pytest.raises(ValueError):
        RequantPolicy(hysteresis=0.7)
    with pytest.raises(ValueError):
        RequantPolicy(kind="lazy")


def test_keep_policy_requantizes_groups_whose_range_moved():
    rng = np.random.default_rng(6)
    w0 = rng.standard_normal((4, 128)).astype(np.float32)
    s0 = quantize_state({"a.weight": w0})
    w1 = w0.copy()
    w1[0, 5] = 10.0  # outside group (0, 0)'s range
    w1[1, 64:] *= 0.5  # group (1, 1)'s range shrank by half
    kept = quantize_state({"a.weight": w1}, previous=s0)
    fresh = quantize(w1)
    for g in [(0, 0), (1, 1)]:
        assert kept["a.scales"][g] == fresh[1][g] and kept["a.biases"][g] == fresh[2][g]
    same = np.ones((4, 2), bool)
    same[0, 0] = same[1, 1] = False
    assert_same_bytes(kept["a.scales"][same], s0["a.scales"][same])
    assert_same_bytes(kept["a.weight"][2:], s0["a.weight"][2:])


def test_state_layout_and_dequantize_state():
    rng = np.random.default_rng(7)
    w = {"m.embed.weight": rng.standard_normal((10, 64)).astype(BF16),
         "m.odd.weight": rng.standard_normal((3, 40)).astype(np.float32),
         "m.q.bias": rng.standard_normal(64).astype(np.float32),
         "m.norm.weight": np.ones(64, np.float16)}
    s = quantize_state(w)
    assert s["m.embed.weight"].dtype == np.uint8 and s["m.embed.scales"].dtype == BF16
    assert s["m.embed.scales"].shape == (10, 1)
    for k in ("m.odd.weight", "m.q.bias", "m.norm.weight"):
        assert_same_bytes(s[k], w[k])
    d = dequantize_state(s)
    assert set(d) == set(w)
    assert np.abs(d["m.embed.weight"].astype(np.float32) - w["m.embed.weight"].astype(np.float32)).max() < 0.05
    with pytest.raises(ValueError, match="collides"):
        quantize_state({**w, "m.embed.scales": np.ones((10, 1), np.float32)})
    streamed = quantize_state(iter(w.items()))  # (name, array) pairs, quantized as they come
    assert list(streamed) == list(s) and all(np.array_equal(streamed[k].view(np.uint8), s[k].view(np.uint8)) for k in s)
    for pairs in ([("m.embed.scales", np.ones((10, 1), np.float32)), *w.items()],
                  [*w.items(), ("m.embed.biases", np.ones((10, 1), np.float32))]):
        with pytest.raises(ValueError, match="collides"):  # either order
            quantize_state(iter(pairs))
    with pytest.raises(ValueError, match="twice"):
        quantize_state(iter([*w.items(), ("m.q.bias", w["m.q.bias"])]))
