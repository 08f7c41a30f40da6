"""Affine int8 quantization, bit-identical to MLX, in numpy (the trainer needs no MLX).

``quantize(w, 64, 8)`` reproduces ``mlx.core.quantize(w, group_size=64, bits=8)`` bit for bit on
float32, float16 and bfloat16 (``ml_dtypes.bfloat16``) input: per group of 64 inputs, in float32,

    scale = max((max - min) / 255, 1e-7), negated unless |min| > |max|
    edge  = min if |min| > |max| else max           (made exactly representable)
    q0    = rint(edge / scale);  if q0 != 0: scale = edge / q0, bias = edge  else bias = 0
    code  = clip(rint((w - bias) / scale), 0, 255)

with scale and bias then cast to the weight's dtype (the codes use the float32 values). Codes are
returned as uint8 with the shape of ``w``: MLX's packed uint32 words viewed as little-endian bytes.
``dequantize`` reproduces ``mx.dequantize``: ``code * scale + bias``, each op rounded in the
weight's dtype.

``quantize_state`` turns HF-named float weights into the *weight state* of
``docs/architecture.md``: every tensor :func:`is_quantized` selects becomes ``X.weight`` (codes),
``X.scales`` and ``X.biases``; everything else is kept as is. Given the previous state, the
``keep`` policy reuses a group's scale and bias while its values still fit them, so an optimizer
step changes only the codes it really moved (see :class:`RequantPolicy`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np

__all__ = [
    "RequantPolicy",
    "dequantize",
    "dequantize_state",
    "is_quantized",
    "quantize",
    "quantize_state",
]

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
_EPS = np.float32(1e-7)
_CHUNK = 1 << 22  # elements per block: bounds temporaries to a few tens of MiB


@dataclass(frozen=True)
class RequantPolicy:
    """How the trainer re-quantizes a matrix that already has a published quantization."""

    kind: Literal["fresh", "keep"] = "keep"
    """``fresh``: quantize from scratch every version (what ``mlx_lm`` would do); ``keep``: reuse
    a group's previous scale and bias while every value lands within codes -1..256 (MLX's own
    slack at a group's far end), rounding against the stored scale and bias. ``keep`` changes about
    half as many codes as ``fresh`` per step at equal or better accuracy (docs/pulse.md)."""
    shrink: float = 0.05
    """Under ``keep``, re-quantize a group anyway once its values span less than ``1 - shrink``
    of the 255 steps (bounds the precision lost to a stale, too-wide range)."""
    hysteresis: float = 0.0
    """Under ``keep``, a code stays unchanged while its weight is within ``0.5 + hysteresis``
    steps of it (0: plain rounding; larger values trade accuracy for fewer flips)."""

    def __post_init__(self) -> None:
        if self.kind not in ("fresh", "keep"):
            raise ValueError(f"kind must be 'fresh' or 'keep', not {self.kind!r}")
        if not 0.0 <= self.shrink < 1.0:
            raise ValueError(f"shrink must be in [0, 1), got {self.shrink}")
        if not 0.0 <= self.hysteresis <= 0.5:
            raise ValueError(f"hysteresis must be in [0, 0.5], got {self.hysteresis}")


def _check(w: np.ndarray, group_size: int, bits: int) -> np.ndarray:
    if bits != 8:
        raise ValueError(f"only bits=8 is supported (codes are stored one per byte), got {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
    w = np.asarray(w)
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quantize needs float32, float16 or bfloat16 input, got {w.dtype}")
    if w.ndim < 2 or w.shape[-1] % group_size:
        raise ValueError(f"quantize needs >= 2 dims with the last a multiple of {group_size}, got {w.shape}")
    return w


def _fresh(w32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MLX's per-group scale and bias (float32) for ``w32`` of shape (groups, group_size)."""
    wmax, wmin = w32.max(axis=1), w32.min(axis=1)
    mask = np.abs(wmin) > np.abs(wmax)
    scale = np.maximum((wmax - wmin) / np.float32(255), _EPS)
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, wmin, wmax)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    scale = np.where(nz, edge / np.where(nz, q0, np.float32(1)), scale)
    return scale.astype(np.float32), np.where(nz, edge, np.float32(0)).astype(np.float32)


def _codes(w32: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    q = np.rint((w32 - bias[:, None]) / scale[:, None])
    return np.clip(q, 0, 255).astype(np.uint8)


def quantize(w: np.ndarray, group_size: int = 64, bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes, scales, biases)`` equal to ``mx.quantize(w, group_size, bits)``.

    ``codes``: uint8, ``w.shape``; ``scales``/``biases``: ``w.shape[:-1] + (in // group_size,)``
    in ``w.dtype``. Non-finite input raises ``ValueError`` (MLX would silently produce garbage).
    """
    w = _check(w, group_size, bits)
    lead, n_in = w.shape[:-1], w.shape[-1]
    flat = w.reshape(-1, group_size)
    codes = np.empty(flat.shape, np.uint8)
    scales = np.empty(flat.shape[0], w.dtype)
    biases = np.empty(flat.shape[0], w.dtype)
    step = max(1, _CHUNK // group_size)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for a in range(0, flat.shape[0], step):
            w32 = flat[a:a + step].astype(np.float32)
            if not np.isfinite(w32).all():
                raise ValueError("quantize got a non-finite value (NaN or inf)")
            s, b = _fresh(w32)
            codes[a:a + step] = _codes(w32, s, b)
            scales[a:a + step], biases[a:a + step] = s.astype(w.dtype), b.astype(w.dtype)
    gshape = lead + (n_in // group_size,)
    return codes.reshape(w.shape), scales.reshape(gshape), biases.reshape(gshape)


def dequantize(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int = 64) -> np.ndarray:
    """The weights of record of an int8 tensor: ``codes * scales + biases`` per group, evaluated
    in float32 whatever dtype the scales are stored in (float32 result). Every stack computes with
    exactly these weights: the MLX engine in both modes (``mx.dequantize`` of float32 scales, or
    its int8 kernels with float32 scales) and the trainer's torch re-score. Rounding the product
    to bfloat16 first, as ``mx.dequantize`` of bfloat16 scales does, moves a real model's logits
    by up to about a logit (docs/trust.md)."""
    codes, scales, biases = np.asarray(codes), np.asarray(scales), np.asarray(biases)
    if codes.dtype != np.uint8 or scales.dtype not in FLOAT_DTYPES or biases.dtype != scales.dtype:
        raise ValueError(f"dequantize needs uint8 codes and float scales/biases of one dtype, got "
                         f"{codes.dtype}, {scales.dtype}, {biases.dtype}")
    gshape = codes.shape[:-1] + (codes.shape[-1] // group_size,) if codes.ndim else ()
    if codes.ndim < 2 or codes.shape[-1] % group_size or scales.shape != gshape or biases.shape != gshape:
        raise ValueError(f"shapes do not match: codes {codes.shape}, scales {scales.shape}, "
                         f"biases {biases.shape}, group_size {group_size}")
    c = codes.reshape(-1, group_size)
    s = scales.reshape(-1, 1).astype(np.float32)
    b = biases.reshape(-1, 1).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # product, then sum (no fused multiply-add)
        out = c.astype(np.float32) * s + b
    return out.reshape(codes.shape)


def is_quantized(name: str, shape: tuple[int, ...], group_size: int = 64) -> bool:
    """Whether ``mlx_lm``'s 8-bit conversion quantizes the HF parameter ``name`` of ``shape``.

    ``mlx_lm.utils.quantize_model`` quantizes every module with ``to_quantized`` (``Linear`` and
    ``Embedding`` in dense decoders) whose weight's last dimension is a multiple of the group
    size. In Llama/Qwen2/Qwen3-style checkpoints those modules are exactly the 2-D ``*.weight``
    tensors (norms are 1-D, linear biases are ``*.bias``).
    """
    return name.endswith(".weight") and len(shape) == 2 and shape[-1] % group_size == 0 and shape[-1] > 0


def _stem(name: str) -> str:
    return name[: -len(".weight")]


def _requant_keep(w: np.ndarray, codes0: np.ndarray, scales0: np.ndarray, biases0: np.ndarray,
                  group_size: int, policy: RequantPolicy) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Requantize ``w`` reusing (scales0, biases0) for every group whose values still fit them."""
    flat, c0 = w.reshape(-1, group_size), codes0.reshape(-1, group_size)
    s0, b0 = scales0.reshape(-1), biases0.reshape(-1)
    codes = np.empty(flat.shape, np.uint8)
    scales, biases = s0.copy(), b0.copy()
    step = max(1, _CHUNK // group_size)
    min_range = np.float32(255 * (1.0 - policy.shrink))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for a in range(0, flat.shape[0], step):
            w32 = flat[a:a + step].astype(np.float32)
            if not np.isfinite(w32).all():
                raise ValueError("quantize got a non-finite value (NaN or inf)")
            t = w32 - b0[a:a + step, None].astype(np.float32)
            t /= s0[a:a + step, None].astype(np.float32)
            lo, hi = t.min(axis=1), t.max(axis=1)
            # Keep while every value lands within MLX's own slack (a group's far end may sit up to
            # one step past code 255) and the range still spans most of the 256 codes.
            keep = (lo >= -1) & (hi <= 256) & (hi - lo >= min_range)
            q = np.rint(t)
            if policy.hysteresis > 0:
                old = c0[a:a + step]
                q = np.where(np.abs(t - old) <= np.float32(0.5 + policy.hysteresis), old, q)
            redo = np.flatnonzero(~keep)
            if redo.size:
                fs, fb = _fresh(w32[redo])
                # Round against the stored (dtype-cast) scale and bias, as kept groups do, so the
                # codes of a redone group do not all shift again on the next version.
                fs, fb = fs.astype(w.dtype), fb.astype(w.dtype)
                q[redo] = np.rint((w32[redo] - fb[:, None].astype(np.float32)) / fs[:, None].astype(np.float32))
                scales[a + redo], biases[a + redo] = fs, fb
            codes[a:a + step] = np.clip(q, 0, 255).astype(np.uint8)
    return codes.reshape(w.shape), scales.reshape(scales0.shape), biases.reshape(biases0.shape)


def quantize_state(
    weights: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    group_size: int = 64,
    bits: int = 8,
    previous: Mapping[str, np.ndarray] | None = None,
    policy: RequantPolicy = RequantPolicy(),
) -> dict[str, np.ndarray]:
    """The weight state of HF-named float ``weights`` (see the module docstring).

    ``weights``: a mapping, or ``(name, array)`` pairs (e.g. ``Learner.iter_weights``), which are
    quantized as they come, so only one float tensor need exist at a time; the result is the
    same either way. Tensors selected by :func:`is_quantized` must be float32/float16/bfloat16;
    each becomes ``X.weight`` (uint8 codes), ``X.scales`` and ``X.biases``. Other tensors are
    copied unchanged. With ``previous`` (the last published state of the same weights) and
    ``policy.kind == "keep"``, groups whose values still fit their previous scale and bias keep
    them; with ``previous=None`` or ``kind == "fresh"`` the result equals what ``mlx_lm`` holds
    after ``nn.quantize(model, group_size, bits)`` on the same weights.

    Raises:
        ValueError: a name given twice, or one that collides with another tensor's ``.scales`` /
            ``.biases``.
    """
    if bits != 8:
        raise ValueError(f"only bits=8 is supported, got {bits}")
    state: dict[str, np.ndarray] = {}
    made: dict[str, str] = {}  # a quantization parameter's name -> the tensor it belongs to

    def put(name: str, a: np.ndarray, owner: str | None = None) -> None:
        if name in made or (owner is not None and name in state):
            raise ValueError(f"{name!r} collides with the quantization parameters of {made.get(name, owner)!r}")
        if name in state:
            raise ValueError(f"{name!r} is given twice")
        state[name] = a
        if owner is not None:
            made[name] = owner

    for name, w in (weights.items() if isinstance(weights, Mapping) else weights):
        w = np.asarray(w)
        if not is_quantized(name, w.shape, group_size):
            put(name, np.array(w, copy=True))
            continue
        stem = _stem(name)
        prev = None
        if previous is not None and policy.kind == "keep":
            p = [previous.get(stem + s) for s in (".weight", ".scales", ".biases")]
            if all(x is not None for x in p) and p[0].dtype == np.uint8 and p[0].shape == w.shape \
                    and p[1].dtype == w.dtype == p[2].dtype \
                    and p[1].shape == p[2].shape == w.shape[:-1] + (w.shape[-1] // group_size,):
                prev = p
        if prev is None:
            codes, scales, biases = quantize(w, group_size, bits)
        else:
            _check(w, group_size, bits)
            codes, scales, biases = _requant_keep(w, *prev, group_size=group_size, policy=policy)
        put(name, codes)
        put(stem + ".scales", scales, name)
        put(stem + ".biases", biases, name)
    return state


def dequantize_state(state: dict[str, np.ndarray], group_size: int = 64) -> dict[str, np.ndarray]:
    """Float weights back from a weight state: ``X.weight`` codes with ``X.scales``/``X.biases``
    are dequantized; every other tensor is copied through."""
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for name, a in state.items():
        if name.endswith(".weight") and np.asarray(a).dtype == np.uint8:
            stem = _stem(name)
            s, b = state.get(stem + ".scales"), state.get(stem + ".biases")
            if s is not None and b is not None:
                out[name] = dequantize(a, s, b, group_size)
                used.update((stem + ".scales", stem + ".biases"))
                continue
        out[name] = np.array(a, copy=True)
    for name in used:
        out.pop(name, None)
    return out
