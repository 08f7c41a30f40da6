"""A quantized CPU decoder's decode step in one C call (``kernels/step.c``, ``stoa_decode_layers``).

At one new token a row, a layer's arithmetic outside its four projections is a few thousand
floats; as ~35 torch ops and their Python it cost more than the projections themselves at batch
16 (about 10 of 34 ms a step on SmolLM2-135M). :class:`DecodeStep` hands every layer of a
:class:`~stoa.backends.torch.decoder.Decoder` to the C kernel at once: the same float32 arithmetic
in the same order (the norms' sums of squares aside), the projections by the int8 kernel the
decoder's :class:`~stoa.backends.torch.qlinear.QLinear` matrices use, attention by
``kernels/attention.c``.

It takes the Llama-shaped families (``llama``, ``mistral``, ``qwen2``, ``qwen3``) on a quantized
decoder, biases and sliding windows included; Gemma (its sandwich norms, GELU, scaled
embeddings and soft-caps) and every prefill keep the torch path.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from stoa.backends.torch.qlinear import QLinear, library

__all__ = ["DecodeStep", "FAMILIES"]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_P = ctypes.c_void_p


class _Mat(ctypes.Structure):
    _fields_ = [("m", ctypes.c_int64), ("K", ctypes.c_int64), ("N", ctypes.c_int64), ("codes", _P),
                ("scales", _P), ("biases", _P), ("outs", _P), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Mat), ("o", _Mat), ("gate_up", _Mat), ("down", _Mat), ("norm_in", _P), ("norm_post", _P),
                ("q_norm", _P), ("k_norm", _P), ("window", ctypes.c_int64), ("rope", ctypes.c_int64)]


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError("the C decode step takes contiguous float32 norms and biases")
    return t.data_ptr()


def _mat(w, bias: torch.Tensor | None) -> _Mat:
    if not isinstance(w, QLinear):
        raise ValueError("the C decode step takes int8 (QLinear) projections")
    # QLinear's ctypes arrays (codes, scales, biases, outs) stay alive as long as it does: the
    # step keeps the QLinear objects (see DecodeStep._keep)
    return _Mat(w._m, w.in_features, w.out_features, ctypes.cast(w._codes, _P), ctypes.cast(w._s, _P),
                ctypes.cast(w._b, _P), ctypes.cast(w._outs, _P), _ptr(bias))


class DecodeStep:
    """The C decode step of a bound quantized ``decoder`` (build again after each
    :meth:`~stoa.backends.torch.decoder.Decoder.bind`: it holds the projections' pointers).
    Raises ``ValueError`` for a decoder it does not take."""

    def __init__(self, decoder) -> None:
        spec = decoder.spec
        if spec.model_type not in FAMILIES:
            raise ValueError(f"model_type {spec.model_type!r}: the C decode step takes {FAMILIES}")
        if not decoder.quantized or spec.attn_logit_softcapping:
            raise ValueError("the C decode step takes quantized decoders without soft-capping")
        lib = library()
        if lib is None:
            raise ValueError("the kernel library is not available")
        self._fn = lib.stoa_decode_layers
        self._digits = decoder.digits
        self._eps, self._scale = float(spec.rms_norm_eps), float(spec.attention_scale)
        self._dims = (spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)
        layers = decoder.layers
        self._keep = [(ly.qkv, ly.o, ly.gate_up, ly.down) for ly in layers]
        arr = (_Layer * len(layers))()
        for i, ly in enumerate(layers):
            nm = ly.norms
            arr[i] = _Layer(_mat(ly.qkv, ly.qkv_bias), _mat(ly.o, ly.o_bias), _mat(ly.gate_up, ly.gate_up_bias),
                            _mat(ly.down, ly.down_bias), _ptr(nm["input_layernorm"]), _ptr(nm["post_attention_layernorm"]),
                            _ptr(nm.get("q_norm")), _ptr(nm.get("k_norm")), ly.window or 0, ly.rope)
        self._layers, self._n = arr, len(layers)
        self._cache_ptrs: tuple | None = None
        self.served = 0  # calls the kernel computed (a refused one falls back to the torch path unseen)

    def _caches(self, cache) -> tuple[object, object]:
        """Pointer arrays of ``cache``'s layers, made again when the cache or its capacity changes
        (growing replaces its tensors). A weak reference: a cache let go is freed, not kept."""
        held = self._cache_ptrs
        if held is None or held[0]() is not cache or held[1] != cache.capacity:
            k = (_P * self._n)(*[t.data_ptr() for t in cache.k])
            v = (_P * self._n)(*[t.data_ptr() for t in cache.v])
            held = self._cache_ptrs = (weakref.ref(cache), cache.capacity, k, v)
        return held[2], held[3]

    def __call__(self, x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, cache, cos: list[torch.Tensor],
                 sin: list[torch.Tensor]) -> torch.Tensor | None:
        """The residual stream after every layer, for ``x [n, 1, hidden]`` (float32) at cache rows
        ``rows [n]`` and positions ``pos [n]`` (int64); cos/sin: the decoder's RoPE tables. None
        when the kernel does not take the shapes (nothing was written: take the torch path)."""
        n = x.shape[0]
        h, nq, nkv, d = self._dims
        out = x.reshape(n, h).to(torch.float32, copy=True).contiguous()
        rows, pos = rows.contiguous(), pos.reshape(n).contiguous()
        if rows.shape != (n,) or int(rows.max()) >= cache.shape[0]:
            return None
        kc, vc = self._caches(cache)
        cp = (_P * len(cos))(*[c.data_ptr() for c in cos])
        sp = (_P * len(sin))(*[s.data_ptr() for s in sin])
        rc = self._fn(self._layers, self._n, out.data_ptr(), n, rows.data_ptr(), pos.data_ptr(), h, nq, nkv, d,
                      cache.capacity, kc, vc, cp, sp, min(c.shape[0] for c in cos), self._eps, self._scale, self._digits, torch.get_num_threads())
        if rc == -1:
            return None
        if rc == -2:
            raise MemoryError("the C decode step could not allocate its buffers")
        if rc != 0:
            raise MemoryError("an int8 projection of the C decode step failed part way (out of memory)")
        self.served += 1
        return out.view(n, 1, h)
