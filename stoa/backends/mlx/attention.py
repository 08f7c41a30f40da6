"""Attention as the run's config means it, over the modules ``mlx_lm`` builds.

mlx-lm 0.32 builds sliding windows only for some families (``gemma3_text`` by its
``sliding_window_pattern``; ``llama`` by ``layer_types``, and only when some layer is full), none
for ``qwen2``, ``qwen3`` or ``gemma2``, and its ``gemma2`` attention broadcasts a batched mask
against the wrong axis when query heads share key/value heads. :func:`install` makes every model
attend as :class:`stoa.models.hfconfig.ModelSpec` says:

* every sliding layer's attention builds its own mask, causal and at most ``window`` positions
  back (the query's own included, as transformers counts), from the cache it is given;
* ``gemma2``'s attention is :class:`Gemma2Attention` (the same projections and RoPE, so parameter
  names do not change): soft-capped scores, masks shaped for grouped-query heads.

The engine keeps a full cache on every layer (``BatchKVCache``) and masks the sliding ones, so
a sliding layer computes exactly what the learner computes at any length; memory is that of full
attention (a rotating cache would hold only the window, see docs/fleet.md).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from stoa.backends.engine import EngineError

_MIN = float(mx.finfo(mx.float32).min)


def window_mask(n: int, cache: Any, window: int, mask: Any) -> Any:
    """The mask of ``n`` new queries for a layer seeing ``window`` positions: ``mask`` (the
    model's causal one) unchanged while no key is that far back, else a boolean array
    (``[n, L]`` without a cache, the cache's own ``[B, 1, n, L]`` with one)."""
    seen = (cache.size() if cache is not None else 0) + n
    if seen <= window:
        return mask
    if cache is None:
        from mlx_lm.models.base import create_causal_mask

        return create_causal_mask(n, 0, window_size=window)
    return cache.make_mask(n, return_array=True, window_size=window)


class _Windowed:
    """Mixed in before an attention class: replaces the mask it is called with by a window's."""

    window: int

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        return super().__call__(x, window_mask(x.shape[1], cache, self.window, mask), cache)  # type: ignore[misc]


_CLASSES: dict[type, type] = {}


def set_window(attn: nn.Module, window: int | None) -> nn.Module:
    """``attn`` made to attend over ``window`` positions (None: as its class does), in place:
    its class becomes a subclass that builds the window's mask, so its parameters keep their names."""
    base = getattr(type(attn), "_stoa_base", type(attn))
    if window is None:
        attn.__class__ = base
        return attn
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Windowed{base.__name__}", (_Windowed, base), {"_stoa_base": base})
    attn.__class__ = _CLASSES[base]
    attn.window = int(window)
    return attn


def window_of(attn: nn.Module) -> int | None:
    return attn.window if isinstance(attn, _Windowed) else None


class Gemma2Attention(nn.Module):
    """``mlx_lm.models.gemma2.Attention`` with masks that broadcast over grouped-query heads.

    Scores are ``c * tanh((q * scale) · k / c)`` (``c``: ``attn_logit_softcapping``), then
    masked, then a float32-precise softmax, as transformers' eager Gemma 2 computes them."""

    def __init__(self, src: nn.Module) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = src.n_heads, src.n_kv_heads, src.head_dim
        self.scale, self.attn_logit_softcapping = src.scale, src.attn_logit_softcapping
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = src.q_proj, src.k_proj, src.v_proj, src.o_proj
        self.rope = src.rope

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        hkv, lk, rep = self.n_kv_heads, k.shape[2], self.n_heads // self.n_kv_heads
        s = ((q * self.scale).reshape(b, hkv, rep * n, self.head_dim) @ k.swapaxes(-1, -2)).reshape(b, hkv, rep, n, lk)
        cap = self.attn_logit_softcapping
        if cap:
            s = mx.tanh(s / cap) * cap
        if isinstance(mask, str):
            mask = mx.arange(lk - n, lk)[:, None] >= mx.arange(lk)[None]
        if mask is not None:
            if mask.dtype != mx.bool_:
                raise TypeError("Gemma2Attention takes boolean masks only")
            if mask.ndim == 4:  # [B, 1, n, L] against s's [B, Hkv, rep, n, L]
                mask = mask.reshape(mask.shape[0], 1, 1, *mask.shape[-2:])
            s = mx.where(mask, s, mx.array(_MIN, s.dtype))
        p = mx.softmax(s, axis=-1, precise=True)
        out = (p.reshape(b, hkv, rep * n, lk) @ v).reshape(b, self.n_heads, n, self.head_dim)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def install(model: nn.Module, windows: tuple[int | None, ...]) -> None:
    """Make ``model`` (an ``mlx_lm`` decoder) attend with ``windows`` (one per layer, None: full),
    in place. Raises :class:`EngineError` where mlx-lm's own layout disagrees (a layer it would
    give a rotating cache of another size, a Gemma 3 layer whose RoPE base it chose for the
    other kind)."""
    from mlx_lm.models import gemma2

    layers = model.layers
    if len(windows) != len(layers):
        raise EngineError(f"{len(windows)} layer windows for a model of {len(layers)} layers")
    own = model.make_cache() if hasattr(model, "make_cache") else None
    for i, (layer, w) in enumerate(zip(layers, windows)):
        if own is not None:
            size = getattr(own[i], "max_size", None)
            if size is not None and size != w:
                raise EngineError(f"layer {i}: mlx_lm built a window of {size}, the config says {w}")
        sliding = getattr(layer.self_attn, "is_sliding", None)  # gemma3_text: picks the RoPE base
        if sliding is not None and sliding != (w is not None):
            raise EngineError(f"layer {i}: mlx_lm built it {'sliding' if sliding else 'full'}, the config says "
                              f"{'full' if w is None else 'sliding'}")
        if isinstance(layer.self_attn, gemma2.Attention):
            layer.self_attn = Gemma2Attention(layer.self_attn)
        set_window(layer.self_attn, w)
