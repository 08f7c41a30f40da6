"""A batched decoder over a per-row KV cache, written for the families Stoa runs.

The rollout engine's model (:mod:`stoa.backends.torch.engine`): the transformer of a
:class:`~stoa.models.hfconfig.ModelSpec` (``llama``, ``mistral``, ``qwen2``, ``qwen3``,
``gemma2``, ``gemma3_text``) as a few fused tensor ops a layer, computing what ``transformers``'
eager/SDPA modules compute (the same norms in float32, RoPE from ``transformers``' own rotary
module, the same scales, windows and soft-caps) on the weights of record. The projections are
fused (``q|k|v`` and ``gate|up`` as one matrix each); :attr:`Decoder.views` maps every Hugging
Face parameter name to its slice, so a PULSE delta rewrites only what it touched.

Keys and values live in :class:`KVCache`: ``slots`` rows, each its own episode at its own
length, with no padding inside a row. A forward pass feeds ``m`` new tokens to each of ``n``
rows, writing their keys at positions ``start .. start + m - 1`` of the rows' slots; a query
at position ``p`` attends to positions ``<= p`` of its row (and ``> p - window`` on sliding
layers). Positions a row has not written yet hold stale values and are never attended to. On a
float32 CPU decoder a decode step (one new token a row) attends with the C kernel
``kernels/attention.c`` (each row's keys and values read once, no batch-wide score matrix); prefill,
soft-capped scores and other devices use the torch path. A bound quantized decoder of the
Llama-shaped families goes further: a decode step runs every layer in one C call
(:attr:`Decoder.step_kernel`, :mod:`stoa.backends.torch.cstep`), the same arithmetic without
~35 torch ops and their Python per layer.

``quantized=True`` (CPUs): the int8 matrices hold no float32 copy; after :meth:`Decoder.bind`
every projection, the head and the embedding lookup compute on the weight state's own codes
(:class:`stoa.backends.torch.qlinear.QLinear`, the weights of record dequantized in cache;
``digits`` 3 or 2: the kernel's integer path, inputs rounded to 24- or 16-bit integers per group of
64).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import numpy as np
import torch.nn.functional as F

from stoa.models.hfconfig import ModelSpec

__all__ = ["FAMILIES", "KV_STEP", "Decoder", "KVCache", "kv_capacity"]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")

_ROTARY = {"llama": ("llama", "LlamaRotaryEmbedding"), "mistral": ("mistral", "MistralRotaryEmbedding"),
           "qwen2": ("qwen2", "Qwen2RotaryEmbedding"), "qwen3": ("qwen3", "Qwen3RotaryEmbedding"),
           "gemma2": ("gemma2", "Gemma2RotaryEmbedding"), "gemma3_text": ("gemma3", "Gemma3RotaryEmbedding")}
_GEMMA = ("gemma2", "gemma3_text")
KV_STEP = 256  # cache positions are allocated in multiples of this
_SCORES = 1 << 24  # most attention scores (float32) one call materializes


def kv_capacity(length: int, limit: int | None = None) -> int:
    """The positions a :class:`KVCache` allocates for room for ``length``: ``length`` rounded up to
    :data:`KV_STEP`, but past ``limit`` (when given) no more than ``length`` itself."""
    cap = -(-length // KV_STEP) * KV_STEP
    return max(length, min(cap, limit)) if limit else cap


class KVCache:
    """Keys and values of ``slots`` rows: per layer ``[slots, kv_heads, capacity, head_dim]``."""

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = KV_STEP, limit: int | None = None) -> None:
        self.shape = (slots, kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.layers, self.capacity = layers, 0
        self.limit = limit
        """The most positions a row will ever need (None: unbounded): growth stops there, so a
        cache never holds more than a memory cap counted for (a pipeline stage's)."""
        self.ensure(min(capacity, limit) if limit else capacity)

    def rounded(self, length: int) -> int:
        """The capacity that room for ``length`` positions allocates."""
        return kv_capacity(length, self.limit)

    def ensure(self, length: int) -> None:
        """Room for ``length`` positions in every row (grown in steps; rows keep their contents)."""
        if length <= self.capacity:
            return
        cap = self.rounded(length)
        s, h, _, d = self.shape
        for i in range(self.layers):
            for store in (self.k, self.v):
                # zeros: a masked position's weight is 0, and 0 * a NaN left in fresh memory would be NaN
                new = torch.zeros((s, h, cap, d), dtype=self.dtype, device=self.device)
                if self.capacity:
                    new[:, :, :self.capacity] = store[i]
                    store[i] = new
                else:
                    store.append(new)
        self.capacity = cap

    def copy_rows(self, src: int, dst: list[int], length: int) -> None:
        """Give rows ``dst`` row ``src``'s first ``length`` positions."""
        if not dst or not length:
            return
        idx = torch.tensor(dst, device=self.device)
        for store in (self.k, self.v):
            for t in store:
                t[idx, :, :length] = t[src, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Row ``dst`` takes row ``src``'s first ``length`` positions (compaction)."""
        if length:
            for store in (self.k, self.v):
                for t in store:
                    t[dst, :, :length] = t[src, :, :length]


def _linear(x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w^T + b`` for a float matrix or a :class:`~stoa.backends.torch.qlinear.QLinear`."""
    return F.linear(x, w, b) if isinstance(w, torch.Tensor) else w(x, b)


@dataclass(frozen=True)
class _Layer:
    qkv: torch.Tensor  # or a QLinear (quantized decoders, once bound); so are o, gate_up and down
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    norms: dict[str, torch.Tensor]
    window: int | None
    rope: int  # index into Decoder's cos/sin tables (Gemma 3's sliding layers have their own base)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """transformers' RMSNorm: normalized in float32; Llama multiplies after casting back, Gemma
    by ``1 + w`` before."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + w.float())).to(x.dtype)
    return w * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (``rotate_half`` form); ``x [n, m, h, d]``, ``cos``/``sin`` ``[n, m, 1, d]``."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Decoder:
    """The model of ``spec`` in ``dtype`` on ``device``; weights start uninitialized (write them
    through :attr:`views`). ``config``: the ``transformers`` config of the same folder (its
    rotary module computes RoPE's frequencies).

    ``part``: build only layers ``[a, b)`` (a pipeline stage), None: all of them. The first part
    (``a == 0``) holds the embeddings and takes token ids; the last (``b`` = the layer count) holds
    the final norm and the head (a tied head: the embeddings) and returns normed hidden states;
    a middle part takes and returns the residual stream. :attr:`views` then names only the part's
    tensors, and a :class:`KVCache` for it has ``b - a`` layers."""

    def __init__(self, spec: ModelSpec, config, device: torch.device, dtype: torch.dtype = torch.float32,
                 attention_bias: bool = False, mlp_bias: bool = False, part: tuple[int, int] | None = None,
                 quantized: bool = False, digits: int = 0) -> None:
        if spec.model_type not in FAMILIES:
            raise ValueError(f"model_type {spec.model_type!r} is not one of {FAMILIES}")
        n_layers = spec.num_hidden_layers
        lo, hi = (0, n_layers) if part is None else (int(part[0]), int(part[1]))
        if not 0 <= lo < hi <= n_layers:
            raise ValueError(f"part {part} is not a non-empty layer range of 0..{n_layers}")
        self.part, self.first, self.last = (lo, hi), lo == 0, hi == n_layers
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        self.gemma = spec.model_type in _GEMMA
        h, d, nq, nkv = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads
        inter = int(config.intermediate_size)
        self.dims = (nq * d, nkv * d, nkv * d)
        qkv_bias = spec.model_type == "qwen2" or attention_bias
        new = lambda *shape: torch.empty(shape, dtype=dtype, device=self.device)  # noqa: E731
        if quantized and (self.device.type != "cpu" or dtype != torch.float32):
            raise ValueError("a quantized decoder computes float32 on the CPU")
        if digits and not quantized:
            raise ValueError("digits: the integer path of a quantized decoder's kernel")
        self.quantized, self.digits = quantized, digits
        # decode steps of a bound quantized decoder: every layer in one C call (stoa.backends.torch.cstep);
        # use_step_kernel = False (then bind again) keeps them on the torch path
        self.use_step_kernel, self.step_kernel = True, None
        # decode steps (one new token a row) on a float32 CPU decoder: the C decode attention
        self._decode_attention = None
        if self.device.type == "cpu" and dtype == torch.float32:
            from stoa.backends.torch.qlinear import library

            lib = library()
            self._decode_attention = lib.stoa_attn_decode if lib is not None else None
        # int8 matrices of a quantized decoder: shape-only (meta) tensors, so views still name them
        mat = (lambda *shape: torch.empty(shape, dtype=dtype, device="meta") if shape[-1] % 64 == 0  # noqa: E731
               else new(*shape)) if quantized else new
        self.qembed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.views: dict[str, torch.Tensor] = {}
        tied = spec.tie_word_embeddings
        self.embed = self.head = self.final_norm = None
        if self.first or (self.last and tied):
            self.embed = self._param("model.embed_tokens.weight", mat(spec.vocab_size, h))
        if self.last:
            self.head = self.embed if tied else self._param("lm_head.weight", mat(spec.vocab_size, h))
            self.final_norm = self._param("model.norm.weight", new(h))
        norm_names = ["input_layernorm", "post_attention_layernorm"]
        if self.gemma:
            norm_names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        qk_norm = spec.model_type in ("qwen3", "gemma3_text")
        self.layers: list[_Layer] = []
        rope_kinds = sorted({t for t in spec.layer_types}) if spec.model_type == "gemma3_text" else [None]
        for i in range(lo, hi):
            p = f"model.layers.{i}."
            qkv = mat(sum(self.dims), h)
            qb = new(sum(self.dims)) if qkv_bias else None
            a, b = 0, 0
            for name, n_out in zip(("q", "k", "v"), self.dims):
                b = a + n_out
                self.views[f"{p}self_attn.{name}_proj.weight"] = qkv[a:b]
                if qb is not None:
                    self.views[f"{p}self_attn.{name}_proj.bias"] = qb[a:b]
                a = b
            gu = mat(2 * inter, h)
            self.views[f"{p}mlp.gate_proj.weight"], self.views[f"{p}mlp.up_proj.weight"] = gu[:inter], gu[inter:]
            gub = new(2 * inter) if mlp_bias else None
            if gub is not None:
                self.views[f"{p}mlp.gate_proj.bias"], self.views[f"{p}mlp.up_proj.bias"] = gub[:inter], gub[inter:]
            norms = {n: self._param(f"{p}{n}.weight", new(h)) for n in norm_names}
            if qk_norm:
                norms["q_norm"] = self._param(f"{p}self_attn.q_norm.weight", new(d))
                norms["k_norm"] = self._param(f"{p}self_attn.k_norm.weight", new(d))
            kind = spec.layer_types[i] if spec.layer_types else None
            self.layers.append(_Layer(
                qkv, qb, self._param(f"{p}self_attn.o_proj.weight", mat(h, nq * d)),
                self._param(f"{p}self_attn.o_proj.bias", new(h)) if attention_bias else None,
                gu, gub, self._param(f"{p}mlp.down_proj.weight", mat(h, inter)),
                self._param(f"{p}mlp.down_proj.bias", new(h)) if mlp_bias else None,
                norms, spec.windows[i] if spec.layer_types else None,
                rope_kinds.index(kind) if spec.model_type == "gemma3_text" else 0))
        self._rope_kinds = rope_kinds
        self._rotary = self._rotary_module(config)
        self._cos: list[torch.Tensor] = []
        self._sin: list[torch.Tensor] = []
        self.embed_scale = None
        if self.gemma:  # transformers: sqrt(hidden) in the weights' dtype (Gemma 3: rounded to bfloat16)
            s = torch.tensor(h ** 0.5, dtype=torch.bfloat16 if spec.model_type == "gemma3_text" else dtype)
            self.embed_scale = s.to(dtype).to(self.device)

    # -- int8 weights (quantized decoders) ----------------------------------------------------------
    def bind(self, state: Mapping[str, np.ndarray], names: set[str] | None = None) -> None:
        """Point a quantized decoder's int8 matrices at ``state``'s codes (kept and used in place),
        with float32 scales and biases; ``names`` (state entries written since the last bind, None:
        all) limits the work to the matrices they touch."""
        from stoa.backends.torch.qlinear import QLinear

        def part(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            stem = name[: -len(".weight")]
            return state[name], state[stem + ".scales"], state[stem + ".biases"]

        def touched(*weights: str) -> bool:
            return names is None or any(w[: -len("weight")] + leaf in names for w in weights
                                        for leaf in ("weight", "scales", "biases"))

        def q(current, *weights: str):
            if not all(w in self.views and self.views[w].is_meta for w in weights):
                return current
            if isinstance(current, QLinear) and not touched(*weights):
                return current
            return QLinear([part(w) for w in weights], digits=self.digits)

        lo = self.part[0]
        for j, ly in enumerate(self.layers):
            p = f"model.layers.{lo + j}."
            a = p + "self_attn."
            self.layers[j] = replace(
                ly, qkv=q(ly.qkv, a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                o=q(ly.o, a + "o_proj.weight"), gate_up=q(ly.gate_up, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=q(ly.down, p + "mlp.down_proj.weight"))
        emb = "model.embed_tokens.weight"
        if self.head is not None:
            self.head = q(self.head, emb if self.spec.tie_word_embeddings else "lm_head.weight")
        if self.embed is not None and emb in self.views and self.views[emb].is_meta and touched(emb):
            c, s, b = part(emb)
            self.qembed = (torch.from_numpy(c), torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)),
                           torch.from_numpy(np.ascontiguousarray(b, dtype=np.float32)))
        self.step_kernel = None
        if self.use_step_kernel and all(isinstance(w, QLinear) for ly in self.layers
                                        for w in (ly.qkv, ly.o, ly.gate_up, ly.down)):
            from stoa.backends.torch.cstep import FAMILIES as STEP_FAMILIES, DecodeStep

            if self.spec.model_type in STEP_FAMILIES and not self.spec.attn_logit_softcapping:
                self.step_kernel = DecodeStep(self)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qembed is None:
            return F.embedding(ids, self.embed)
        c, s, b = self.qembed  # the rows of record: code * scale, then + bias, in float32
        w = c[ids].to(torch.float32).unflatten(-1, (-1, 64))
        w.mul_(s[ids][..., None]).add_(b[ids][..., None])
        return w.flatten(-2)

    def _param(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.views[name] = t
        return t

    def _rotary_module(self, config):
        module, cls = _ROTARY[self.spec.model_type]
        rotary = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
        return rotary(config).to(self.device)

    # -- RoPE -------------------------------------------------------------------------------------
    def _tables(self, length: int) -> None:
        """cos/sin for positions ``0 .. length - 1`` (computed by transformers' rotary module)."""
        if self._cos and self._cos[0].shape[0] >= length:
            return
        n = -(-length // KV_STEP) * KV_STEP
        pos = torch.arange(n, device=self.device)[None]
        dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
        self._cos, self._sin = [], []
        for kind in self._rope_kinds:
            with torch.no_grad():
                c, s = (self._rotary(dummy, pos) if kind is None else self._rotary(dummy, pos, layer_type=kind))
            self._cos.append(c[0].to(self.dtype))
            self._sin.append(s[0].to(self.dtype))

    # -- the forward pass ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: KVCache,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[n, m, hidden]`` of new tokens ``ids [n, m]`` (int64) of cache rows
        ``rows`` (None: rows ``0 .. n-1``), the first at positions ``start [n]``; ``longest`` is
        ``max(start) + m`` (a host int, so no device sync). Their keys and values are written to
        the cache (which must hold ``longest`` positions). A part that is not the first takes the
        residual stream ``[n, m, hidden]`` in place of ``ids``; one that is not the last returns it."""
        spec = self.spec
        n, m = ids.shape[:2]
        pos = start[:, None] + torch.arange(m, device=self.device)[None]  # [n, m]
        self._tables(longest)
        rsel = torch.arange(n, device=self.device) if rows is None else rows
        if m == 1 and self.step_kernel is not None:
            x = self._embed_or_stream(ids)
            y = self.step_kernel(x, rsel, pos, cache, self._cos, self._sin)
            if y is not None:
                return _rms(y, self.final_norm, spec.rms_norm_eps, self.gemma) if self.last else y
        cos = [c[pos][:, :, None] for c in self._cos]
        sin = [s[pos][:, :, None] for s in self._sin]
        keys = torch.arange(longest, device=self.device)
        seen = keys[None, None, :] <= pos[:, :, None]  # [n, m, L]
        masks: dict[int | None, torch.Tensor] = {None: seen}
        for w in {ly.window for ly in self.layers if ly.window is not None}:
            masks[w] = seen & (keys[None, None, :] > pos[:, :, None] - w)
        masks = {w: mk[:, None, None] for w, mk in masks.items()}  # [n, 1, 1, m, L]
        x = self._embed_or_stream(ids)
        for li, ly in enumerate(self.layers):
            x = self._layer(li, ly, x, pos, rsel, rows is None, cos[ly.rope], sin[ly.rope], masks[ly.window],
                            longest, cache)
        return _rms(x, self.final_norm, spec.rms_norm_eps, self.gemma) if self.last else x

    def _embed_or_stream(self, ids: torch.Tensor) -> torch.Tensor:
        """The residual stream entering the first layer: embedded token ids (the first part), or
        the stream itself (a later part)."""
        if not self.first:
            return ids.to(self.dtype)
        x = self._embed(ids)
        return x * self.embed_scale if self.embed_scale is not None else x

    def _layer(self, li: int, ly: _Layer, x: torch.Tensor, pos: torch.Tensor, rsel: torch.Tensor, contiguous: bool,
               cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, longest: int, cache: KVCache) -> torch.Tensor:
        spec, eps, g = self.spec, self.spec.rms_norm_eps, self.gemma
        n, m, _ = x.shape
        nq, nkv, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        a = _rms(x, ly.norms["input_layernorm"], eps, g)
        q, k, v = _linear(a, ly.qkv, ly.qkv_bias).split(self.dims, dim=-1)
        q, k, v = q.view(n, m, nq, d), k.view(n, m, nkv, d), v.view(n, m, nkv, d)
        if "q_norm" in ly.norms:
            q, k = _rms(q, ly.norms["q_norm"], eps, g), _rms(k, ly.norms["k_norm"], eps, g)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        kc, vc = cache.k[li], cache.v[li]
        kc[rsel[:, None], :, pos] = k
        vc[rsel[:, None], :, pos] = v
        rep = nq // nkv
        if m == 1 and self._decode_attention is not None and not spec.attn_logit_softcapping:
            attn = torch.empty((n, nq * d), dtype=x.dtype)
            q, rs, ps = q.contiguous(), rsel.contiguous(), pos.reshape(n).contiguous()
            rc = self._decode_attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), rs.data_ptr(),
                                        ps.data_ptr(), n, nkv, rep, d, kc.shape[2], spec.attention_scale,
                                        ly.window or 0, attn.data_ptr(), torch.get_num_threads())
            if rc == 0:
                return self._mlp(ly, x, _linear(attn.view(n, 1, nq * d), ly.o, ly.o_bias))
        keys = kc[:n, :, :longest] if contiguous else kc[rsel, :, :longest]
        vals = vc[:n, :, :longest] if contiguous else vc[rsel, :, :longest]
        qg = q.view(n, m, nkv, rep, d).permute(0, 2, 3, 1, 4).reshape(n, nkv, rep * m, d)
        out = torch.empty((n, nkv, rep * m, d), dtype=x.dtype, device=x.device)
        step = max(1, _SCORES // max(1, nkv * rep * m * longest))
        for r0 in range(0, n, step):  # bound the scores held at once
            r1 = min(n, r0 + step)
            s = torch.matmul(qg[r0:r1], keys[r0:r1].transpose(-1, -2)) * spec.attention_scale
            if spec.attn_logit_softcapping:
                c = spec.attn_logit_softcapping
                s = torch.tanh(s / c) * c
            s = s.view(r1 - r0, nkv, rep, m, longest).masked_fill(~mask[r0:r1], -math.inf)
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(x.dtype)
            torch.matmul(p.view(r1 - r0, nkv, rep * m, longest), vals[r0:r1], out=out[r0:r1])
        attn = out.view(n, nkv, rep, m, d).permute(0, 3, 1, 2, 4).reshape(n, m, nq * d)
        return self._mlp(ly, x, _linear(attn, ly.o, ly.o_bias))

    def _mlp(self, ly: _Layer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The rest of a layer after attention's output projection ``o``: residual, norms, MLP."""
        eps, g = self.spec.rms_norm_eps, self.gemma
        if g:
            o = _rms(o, ly.norms["post_attention_layernorm"], eps, g)
            x = x + o
            a = _rms(x, ly.norms["pre_feedforward_layernorm"], eps, g)
        else:
            x = x + o
            a = _rms(x, ly.norms["post_attention_layernorm"], eps, g)
        gate, up = _linear(a, ly.gate_up, ly.gate_up_bias).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if g else F.silu(gate)
        f = _linear(act * up, ly.down, ly.down_bias)
        if g:
            f = _rms(f, ly.norms["post_feedforward_layernorm"], eps, g)
        return x + f

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states (Gemma 2's final soft-capping included)."""
        z = _linear(hidden, self.head, None).float()
        cap = self.spec.final_logit_softcapping
        return torch.tanh(z / cap) * cap if cap else z

    def write(self, name: str, value: torch.Tensor) -> None:
        """Copy ``value`` (any float dtype, on any device) into the parameter ``name``."""
        self.views[name].copy_(value)
