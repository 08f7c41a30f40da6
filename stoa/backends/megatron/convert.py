"""Hugging Face <-> Megatron-core weights for the Qwen2 / Qwen3 / Llama families.

Pure tensor bookkeeping (torch only, no megatron import): every function copies slices, so an
HF -> Megatron -> HF round trip is bit-exact. Megatron's layouts:

* ``linear_qkv``: one fused matrix, rows grouped per key/value head ("query group"):
  ``[q_0 .. q_{r-1}, k, v]`` for each of the ``num_kv_heads`` groups, ``r = heads / kv_heads``
  query heads each, ``head_dim`` rows per head. Tensor parallelism splits the rows into
  ``tp`` contiguous blocks, i.e. whole groups per rank (so ``kv_heads % tp == 0``).
* ``linear_fc1``: ``[gate; up]`` stacked on rows; under TP each rank holds its own slice of gate
  stacked on its own slice of up.
* ``linear_proj`` and ``linear_fc2``: row-parallel, split along columns (dim 1).
* word embeddings and the output layer: split along the vocabulary (dim 0), padded with zero
  rows to a multiple of ``tp``.
* norms and q/k norms are replicated. The Transformer Engine layer spec fuses the two
  pre-norms into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``
  (``fused_norms=True``); the local spec keeps ``input_layernorm`` / ``pre_mlp_layernorm``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stoa.models.hfconfig import LEARNERS, ModelConfigError, check_learner

__all__ = ["Arch", "ConversionError", "hf_shapes", "hf_to_megatron", "layer_of", "megatron_names", "megatron_to_hf",
           "padded_vocab", "renumber"]

SUPPORTED = LEARNERS["megatron"]


class ConversionError(ValueError):
    """A config or a state dict that this converter cannot map (the message says why)."""


@dataclass(frozen=True)
class Arch:
    """The shape of a decoder-only model, read from an HF ``config.json``."""

    model_type: str
    """``qwen2``, ``qwen3`` or ``llama``."""
    vocab_size: int
    """Rows of the HF embedding matrix."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """SwiGLU hidden width."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (query groups)."""
    head_dim: int
    """Width of one head (may differ from hidden_size / num_heads, as in Qwen3)."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """RoPE base."""
    tie_word_embeddings: bool
    """The LM head shares the input embedding."""
    qkv_bias: bool
    """q/k/v projections carry biases (Qwen2)."""
    qk_norm: bool
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    max_position_embeddings: int
    """Longest sequence the config advertises."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED:
            raise ConversionError(f"model_type {self.model_type!r} is not supported (one of {SUPPORTED})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConversionError(f"{name}={getattr(self, name)!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ConversionError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ConversionError("rms_norm_eps and rope_theta must be > 0")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> Arch:
        """Read (and check) an HF ``config.json`` dict as every stack reads it
        (:func:`stoa.models.hfconfig.check_learner`); refuses what Megatron would silently change."""
        try:
            spec = check_learner(cfg, "megatron")
        except ModelConfigError as e:
            raise ConversionError(str(e)) from None
        mt = spec.model_type
        return cls(
            model_type=mt,
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=cfg["intermediate_size"],
            num_layers=spec.num_hidden_layers,
            num_heads=spec.num_attention_heads,
            num_kv_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=spec.rms_norm_eps,
            rope_theta=spec.rope_theta,
            tie_word_embeddings=spec.tie_word_embeddings,
            qkv_bias=mt == "qwen2",  # Qwen2 hard-codes q/k/v biases whatever the config says
            qk_norm=mt == "qwen3",
            max_position_embeddings=spec.max_position_embeddings,
        )

    def num_params(self) -> int:
        """Parameters of the HF model (embedding counted once when tied)."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += (self.num_heads + 2 * self.num_kv_heads) * hd * self.qkv_bias + 2 * hd * self.qk_norm
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    def check_tp(self, tp: int) -> None:
        if tp < 1 or self.num_kv_heads % tp or self.num_heads % tp or self.intermediate_size % tp:
            raise ConversionError(
                f"tensor parallel size {tp} must divide num_kv_heads={self.num_kv_heads}, "
                f"num_heads={self.num_heads} and intermediate_size={self.intermediate_size}")


def padded_vocab(arch: Arch, tp: int) -> int:
    """Embedding rows in Megatron: the vocabulary rounded up to a multiple of ``tp``."""
    return -(-arch.vocab_size // tp) * tp


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def hf_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF folder by name and shape (no ``lm_head.weight`` when tied)."""
    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = _hf_layer(i)
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter)}
        if arch.qkv_bias:
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)}
        if arch.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    out["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = (arch.vocab_size, h)
    return out


def megatron_names(
    arch: Arch, fused_norms: bool = False, *, layers: Iterable[int] | None = None,
    embedding: bool = True, head: bool = True,
) -> list[str]:
    """Megatron parameter names (global layer numbers) of the selected parts of the model.

    ``head`` is the final norm plus, when untied, the output layer.
    """
    names = ["embedding.word_embeddings.weight"] * embedding
    for i in range(arch.num_layers) if layers is None else layers:
        p = f"decoder.layers.{i}."
        names += [p + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"),
                  p + "self_attention.linear_qkv.weight"]
        names += [p + "self_attention.linear_qkv.bias"] * arch.qkv_bias
        names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"] * arch.qk_norm
        names += [p + "self_attention.linear_proj.weight",
                  p + ("mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"),
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    if head:
        names.append("decoder.final_layernorm.weight")
        names += ["output_layer.weight"] * (not arch.tie_word_embeddings)
    return names


def _chunk(t: torch.Tensor, rank: int, tp: int, dim: int) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank].clone()


def _get(hf: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in hf:
        raise ConversionError(f"missing HF tensor {name}")
    t = hf[name]
    if tuple(t.shape) != shape:
        raise ConversionError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    return t


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], arch: Arch, *, tp_rank: int = 0, tp_size: int = 1, fused_norms: bool = False,
    layers: Iterable[int] | None = None, embedding: bool = True, head: bool = True,
) -> dict[str, torch.Tensor]:
    """Tensor-parallel shard ``tp_rank`` of the Megatron state dict (global layer numbers).

    ``hf`` holds the HF tensors by name (a tied ``lm_head.weight`` may be present or absent;
    it is ignored); only the tensors of the selected parts are read (see :func:`megatron_names`).
    Shapes are checked; dtypes are kept.
    """
    arch.check_tp(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ConversionError(f"tp_rank={tp_rank} outside [0, {tp_size})")
    h, hd, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    r, inter, vp = nq // nkv, arch.intermediate_size, padded_vocab(arch, tp_size)
    out: dict[str, torch.Tensor] = {}
    if embedding:
        emb = _get(hf, "model.embed_tokens.weight", (arch.vocab_size, h))
        out["embedding.word_embeddings.weight"] = _chunk(_pad_rows(emb, vp), tp_rank, tp_size, 0)
    for i in range(arch.num_layers) if layers is None else layers:
        p, m = _hf_layer(i), f"decoder.layers.{i}."
        q = _get(hf, p + "self_attn.q_proj.weight", (nq * hd, h)).reshape(nkv, r * hd, h)
        k = _get(hf, p + "self_attn.k_proj.weight", (nkv * hd, h)).reshape(nkv, hd, h)
        v = _get(hf, p + "self_attn.v_proj.weight", (nkv * hd, h)).reshape(nkv, hd, h)
        qkv = torch.cat([q, k, v], dim=1).reshape(-1, h)
        out[m + "self_attention.linear_qkv.weight"] = _chunk(qkv, tp_rank, tp_size, 0)
        if arch.qkv_bias:
            qb = _get(hf, p + "self_attn.q_proj.bias", (nq * hd,)).reshape(nkv, r * hd)
            kb = _get(hf, p + "self_attn.k_proj.bias", (nkv * hd,)).reshape(nkv, hd)
            vb = _get(hf, p + "self_attn.v_proj.bias", (nkv * hd,)).reshape(nkv, hd)
            out[m + "self_attention.linear_qkv.bias"] = _chunk(torch.cat([qb, kb, vb], 1).reshape(-1), tp_rank, tp_size, 0)
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = _get(hf, p + "self_attn.q_norm.weight", (hd,)).clone()
            out[m + "self_attention.k_layernorm.weight"] = _get(hf, p + "self_attn.k_norm.weight", (hd,)).clone()
        o = _get(hf, p + "self_attn.o_proj.weight", (h, nq * hd))
        out[m + "self_attention.linear_proj.weight"] = _chunk(o, tp_rank, tp_size, 1)
        gate = _chunk(_get(hf, p + "mlp.gate_proj.weight", (inter, h)), tp_rank, tp_size, 0)
        up = _chunk(_get(hf, p + "mlp.up_proj.weight", (inter, h)), tp_rank, tp_size, 0)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[m + "mlp.linear_fc2.weight"] = _chunk(_get(hf, p + "mlp.down_proj.weight", (h, inter)), tp_rank, tp_size, 1)
        ln1 = _get(hf, p + "input_layernorm.weight", (h,)).clone()
        ln2 = _get(hf, p + "post_attention_layernorm.weight", (h,)).clone()
        if fused_norms:
            out[m + "self_attention.linear_qkv.layer_norm_weight"] = ln1
            out[m + "mlp.linear_fc1.layer_norm_weight"] = ln2
        else:
            out[m + "input_layernorm.weight"] = ln1
            out[m + "pre_mlp_layernorm.weight"] = ln2
    if head:
        out["decoder.final_layernorm.weight"] = _get(hf, "model.norm.weight", (h,)).clone()
        if not arch.tie_word_embeddings:
            w = _get(hf, "lm_head.weight", (arch.vocab_size, h))
            out["output_layer.weight"] = _chunk(_pad_rows(w, vp), tp_rank, tp_size, 0)
    return out


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], arch: Arch, *, fused_norms: bool = False,
    layers: Iterable[int] | None = None, embedding: bool = True, head: bool = True,
) -> dict[str, torch.Tensor]:
    """Merge the ``tp`` shards (``shards[rank]``, global layer numbers) into HF tensors.

    The inverse of :func:`hf_to_megatron` for the selected parts: vocabulary padding is
    dropped and a tied model gets no ``lm_head.weight`` (as HF folders store it). Every name of
    :func:`megatron_names` for those parts must be present in every shard.
    """
    layers = list(range(arch.num_layers) if layers is None else layers)
    tp = len(shards)
    arch.check_tp(tp)
    h, hd, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    r = nq // nkv
    for name in megatron_names(arch, fused_norms, layers=layers, embedding=embedding, head=head):
        for rank, s in enumerate(shards):
            if name not in s:
                raise ConversionError(f"Megatron shard {rank} lacks {name}")

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    out: dict[str, torch.Tensor] = {}
    if embedding:
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[: arch.vocab_size].clone()
    for i in layers:
        p, m = _hf_layer(i), f"decoder.layers.{i}."
        qkv = cat(m + "self_attention.linear_qkv.weight", 0).reshape(nkv, (r + 2) * hd, h)
        out[p + "self_attn.q_proj.weight"] = qkv[:, : r * hd].reshape(nq * hd, h).clone()
        out[p + "self_attn.k_proj.weight"] = qkv[:, r * hd : (r + 1) * hd].reshape(nkv * hd, h).clone()
        out[p + "self_attn.v_proj.weight"] = qkv[:, (r + 1) * hd :].reshape(nkv * hd, h).clone()
        if arch.qkv_bias:
            b = cat(m + "self_attention.linear_qkv.bias", 0).reshape(nkv, (r + 2) * hd)
            out[p + "self_attn.q_proj.bias"] = b[:, : r * hd].reshape(-1).clone()
            out[p + "self_attn.k_proj.bias"] = b[:, r * hd : (r + 1) * hd].reshape(-1).clone()
            out[p + "self_attn.v_proj.bias"] = b[:, (r + 1) * hd :].reshape(-1).clone()
        if arch.qk_norm:
            out[p + "self_attn.q_norm.weight"] = shards[0][m + "self_attention.q_layernorm.weight"].clone()
            out[p + "self_attn.k_norm.weight"] = shards[0][m + "self_attention.k_layernorm.weight"].clone()
        out[p + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        out[p + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
        out[p + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
        out[p + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
        ln1 = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
        ln2 = "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"
        out[p + "input_layernorm.weight"] = shards[0][m + ln1].clone()
        out[p + "post_attention_layernorm.weight"] = shards[0][m + ln2].clone()
    if head:
        out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
        if not arch.tie_word_embeddings:
            out["lm_head.weight"] = cat("output_layer.weight", 0)[: arch.vocab_size].clone()
    return out


def layer_of(name: str) -> int | None:
    """The layer number in a Megatron name (``decoder.layers.N.``), or None for other tensors."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def renumber(state: Mapping[str, torch.Tensor], offset: int) -> dict[str, torch.Tensor]:
    """Shift every ``decoder.layers.N.`` by ``offset`` (global <-> pipeline-stage-local numbers)."""
    def shift(name: str) -> str:
        n = layer_of(name)
        return name if n is None else _LAYER.sub(f"decoder.layers.{n + offset}.", name, count=1)

    return {shift(k): v for k, v in state.items()}
