"""The MLX model and its weight state: int8 codes are the state of record in both compute modes.

Both modes compute in float32 from the same weights, ``code * scale + bias`` evaluated in
float32 (``stoa.transport.quant.dequantize``), whatever dtype the state stores its scales and
unquantized tensors in; the trainer's re-score uses the same rule (``stoa.backends.torch.int8``).
``quantized``: the model runs MLX's int8 kernels (``QuantizedLinear`` / ``QuantizedEmbedding``)
on the state's codes (numpy views of the model's own buffers, so an in-place PULSE apply reaches
them) with float32 copies of any bfloat16/float16 scales, biases and unquantized tensors (kept
current by :func:`refresh_float32`). ``dequantized``: the model runs float32 ``Linear`` /
``Embedding`` layers whose weights are the dequantized codes; the state keeps the codes, and a
delta rebuilds only the float tensors it touched.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from stoa.backends.engine import EngineError
from stoa.backends.mlx import attention

GROUP_SIZE, BITS = 64, 8

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BF16 = None

_HEAD_TYPES = {"qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3_text"}


def load_model(hf_dir: str | Path, with_weights: bool = True) -> tuple[nn.Module, dict[str, Any]]:
    """The ``mlx_lm`` model of a local HF folder (its own weights, or an unevaluated skeleton),
    built from the folder's normalized config (:mod:`stoa.models.hfconfig`) and checked against
    it: a field ``mlx_lm`` would read otherwise raises :class:`EngineError` naming it."""
    from mlx_lm.utils import load_model as _load

    from stoa.models import hfconfig

    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise EngineError(f"{path} is not a Hugging Face model folder (no config.json)")
    has_weights = any(path.glob("model*.safetensors"))
    if with_weights and not has_weights:
        raise EngineError(f"{path} holds no model*.safetensors weights")
    try:
        norm = hfconfig.load(path)
    except hfconfig.ModelConfigError as e:
        raise EngineError(str(e)) from None
    # lazy: a skeleton's random init (or its files) is never computed before the state replaces it
    model, cfg = _load(path, lazy=True, strict=with_weights, model_config=norm)
    spec = hfconfig.read(norm)
    attention.install(model, spec.windows)
    wrong = hfconfig.disagreements(spec, built_fields(model))
    if wrong:
        raise EngineError(f"{path}: mlx_lm built the model differently from its config ({'; '.join(wrong)})")
    return model, cfg


def built_fields(model: nn.Module) -> dict[str, Any]:
    """What ``mlx_lm`` built (with :func:`stoa.backends.mlx.attention.install`'s windows), in
    :class:`stoa.models.hfconfig.ModelSpec`'s terms."""
    from stoa.models.hfconfig import FULL, SLIDING

    args = model.args
    layers = model.model.layers
    windows = [attention.window_of(layer.self_attn) for layer in layers]
    full = next((i for i, w in enumerate(windows) if w is None), 0)
    slide = next((i for i, w in enumerate(windows) if w is not None), None)
    heads = int(args.num_attention_heads)
    attn = layers[full].self_attn
    rope = getattr(attn, "rope", None)
    local = None
    if args.model_type == "gemma3_text":  # its sliding layers' own RoPE base
        local = float(getattr(layers[slide].self_attn.rope, "base", 0) if slide is not None
                      else args.rope_local_base_freq)
    return {"model_type": args.model_type, "vocab_size": int(args.vocab_size), "hidden_size": int(args.hidden_size),
            "num_hidden_layers": len(layers), "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(args, "num_key_value_heads", None) or heads),
            "head_dim": int(attn.q_proj.weight.shape[0] // heads),
            "rope_theta": float(getattr(rope, "base", None) or args.rope_theta),
            "rope_scaling": getattr(args, "rope_scaling", None), "rms_norm_eps": float(args.rms_norm_eps),
            "tie_word_embeddings": "lm_head" not in model,
            "layer_types": [FULL if w is None else SLIDING for w in windows],
            "sliding_window": None if slide is None else windows[slide], "rope_local_theta": local,
            "attention_scale": float(attn.scale),
            "attn_logit_softcapping": getattr(attn, "attn_logit_softcapping", None),
            "final_logit_softcapping": getattr(model, "final_logit_softcapping", None)}


def quantize(model: nn.Module, config: dict[str, Any]) -> None:
    """int8, group 64, exactly ``mlx_lm``'s conversion (its own ``quantize_model``), in place."""
    from mlx_lm.utils import quantize_model

    if "quantization" in config or "quantization_config" in config:
        raise EngineError("the model folder is already quantized; give the float checkpoint")
    with contextlib.redirect_stdout(io.StringIO()):  # it prints bits-per-weight
        quantize_model(model, config, GROUP_SIZE, BITS)


def dequantize(model: nn.Module) -> None:
    """Replace the int8 layers with float32 ones holding their dequantized codes (scales and
    biases taken to float32 first, so nothing is rounded to a narrower dtype on the way)."""
    from mlx_lm.utils import dequantize_model

    model.set_dtype(mx.float32)
    dequantize_model(model)
    mx.eval(model.parameters())


def float32_compute(model: nn.Module, state: dict[str, np.ndarray]) -> set[str]:
    """Quantized mode: give the model float32 copies of its narrower float tensors (scales,
    biases, norms, ...), so MLX's int8 kernels and every other layer compute in float32 (with
    bfloat16 scales they would compute in bfloat16, several logits away from the trainer's
    float32 re-score on a real model: docs/trust.md). Returns the state names now copied."""
    names = {k for k, v in state.items() if v.dtype != np.uint8 and v.dtype != np.float32}
    refresh_float32(model, state, names)
    return names


def refresh_float32(model: nn.Module, state: dict[str, np.ndarray], names) -> None:
    """Quantized mode: re-copy the float32 twins of the state tensors ``names`` into the model."""
    pairs = [(n, to_mx(state[n]).astype(mx.float32)) for n in sorted(names)]
    if pairs:
        model.load_weights(pairs, strict=False)
        mx.eval([w for _, w in pairs])


def quantized_stems(model: nn.Module) -> set[str]:
    """Module paths whose weight is int8 codes (``X`` of ``X.weight``/``X.scales``/``X.biases``)."""
    return {name for name, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


def to_numpy(a: mx.array) -> np.ndarray:
    """A writeable numpy view sharing ``a``'s (evaluated) buffer; bfloat16 as ``ml_dtypes``."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16), copy=False).view(BF16)
    return np.array(a, copy=False)


def to_mx(a: np.ndarray) -> mx.array:
    """An MLX copy of a numpy array (bfloat16 through its bits)."""
    a = np.ascontiguousarray(a)
    if BF16 is not None and a.dtype == BF16:
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    return mx.array(a)


def codes_to_mx(codes: np.ndarray) -> mx.array:
    """uint8 codes ``(out, in)`` as MLX's packed uint32 words ``(out, in / 4)``."""
    return mx.array(np.ascontiguousarray(codes).view(np.uint32))


def state_views(model: nn.Module) -> dict[str, np.ndarray]:
    """The weight state of a quantized model, as views of its buffers (codes viewed as bytes)."""
    stems = quantized_stems(model)
    params = tree_flatten(model.parameters())
    mx.eval([a for _, a in params])
    state = {}
    for name, a in params:
        v = to_numpy(a)
        if name.endswith(".weight") and name[: -len(".weight")] in stems:
            v = v.view(np.uint8)
        state[name] = v
    return state


def layout(state: dict[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def check_state(state: dict[str, np.ndarray], expected: dict[str, tuple[tuple[int, ...], Any]],
                exact_dtypes: bool) -> None:
    """Raise :class:`EngineError` unless ``state`` has exactly the expected names and shapes
    (and dtypes: exactly, or for float tensors any float dtype of the right kind)."""
    if not isinstance(state, dict):
        raise EngineError(f"a weight state is a dict of numpy arrays, got {type(state).__name__}")
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        more = lambda xs: "..." if len(xs) > 5 else ""  # noqa: E731
        raise EngineError(f"weight state does not fit the model: missing {missing[:5]}{more(missing)}, "
                          f"unexpected {extra[:5]}{more(extra)}")
    floats = {np.dtype(np.float32), np.dtype(np.float16)} | ({BF16} if BF16 is not None else set())
    for name, (shape, dtype) in expected.items():
        a = state[name]
        if not isinstance(a, np.ndarray):
            raise EngineError(f"{name}: expected a numpy array, got {type(a).__name__}")
        if tuple(a.shape) != shape:
            raise EngineError(f"{name}: shape {tuple(a.shape)}, the model needs {shape}")
        ok = a.dtype == dtype if exact_dtypes or dtype == np.uint8 else a.dtype in floats
        if not ok:
            raise EngineError(f"{name}: dtype {a.dtype}, the model needs {dtype}")


def skeleton_layout(model: nn.Module) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Names and shapes a state must have for this quantized model (dtypes of floats are free)."""
    stems = quantized_stems(model)
    out = {}
    for name, a in tree_flatten(model.parameters()):
        if name.endswith(".weight") and name[: -len(".weight")] in stems:
            out[name] = ((*a.shape[:-1], a.shape[-1] * 4), np.dtype(np.uint8))
        else:
            out[name] = (tuple(a.shape), np.dtype(np.float32))
    return out


def load_state_into(model: nn.Module, state: dict[str, np.ndarray]) -> None:
    """Give a quantized model the weights of ``state`` (fresh MLX copies)."""
    stems = quantized_stems(model)
    pairs = [(k, codes_to_mx(v) if k.endswith(".weight") and k[: -len(".weight")] in stems else to_mx(v))
             for k, v in state.items()]
    model.load_weights(pairs, strict=True)
    mx.eval(model.parameters())


def rebuild_float(model: nn.Module, state: dict[str, np.ndarray], stems: set[str], names: list[str]) -> int:
    """Dequantized mode: recompute the float32 model tensors that depend on ``names``."""
    targets: set[str] = set()
    for n in names:
        stem, _, leaf = n.rpartition(".")
        targets.add(stem + ".weight" if stem in stems and leaf in ("weight", "scales", "biases") else n)
    pairs = []
    for t in sorted(targets):
        stem = t[: -len(".weight")]
        if t.endswith(".weight") and stem in stems:
            w = mx.dequantize(codes_to_mx(state[t]), to_mx(state[stem + ".scales"]).astype(mx.float32),
                              to_mx(state[stem + ".biases"]).astype(mx.float32), group_size=GROUP_SIZE, bits=BITS)
        else:
            w = to_mx(state[t])
        pairs.append((t, w.astype(mx.float32)))
    model.load_weights(pairs, strict=False)
    mx.eval([w for _, w in pairs])
    return len(pairs)


def split_head(model: nn.Module):
    """``(body, head)`` with ``model(x) == head(body(x))`` for the common decoder layouts, so
    prefill and scoring skip the vocabulary projection where it is not needed; else None. The
    head includes Gemma 2's final soft-capping."""
    inner, args = getattr(model, "model", None), getattr(model, "args", None)
    if inner is None or args is None or getattr(model, "model_type", None) not in _HEAD_TYPES:
        return None
    if "lm_head" in model:
        project = lambda h: model.lm_head(h)  # noqa: E731 - looked up per call: modules get swapped
    else:
        project = lambda h: inner.embed_tokens.as_linear(h)  # noqa: E731
    cap = getattr(model, "final_logit_softcapping", None)
    if not cap:
        return inner, project
    return inner, lambda h: mx.tanh(project(h) / cap) * cap
