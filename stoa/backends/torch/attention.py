"""Attention over packed rows that never crosses an episode boundary (any device).

Registered in ``transformers``' ``AttentionInterface`` as ``"stoa_varlen"``. A packed row's
episodes are gathered into dense length buckets (see :class:`~stoa.backends.packing.VarlenLayout`),
each bucket runs causal SDPA, and the outputs are scattered back. Work is close to the exact
block-diagonal cost; a dense masked SDPA over the row would cost ``row_len**2`` per head, which
on a CPU is many times the rest of the model for rows of short episodes. Because no mask is
built here (the name is not in the mask registry), ``transformers`` passes ``attention_mask=None``;
called without a layout (a plain ``model(ids)``), it is ordinary causal attention. Sliding
windows and soft-capped scores (the ``sliding_window`` and ``softcap`` the model's attention
passes) are applied within each episode, as ``transformers`` applies them to one sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from stoa.backends.packing import VarlenLayout

NAME = "stoa_varlen"


class VarlenTensors(NamedTuple):
    """:class:`VarlenLayout` on the model's device; passed to the model as ``stoa_varlen=``."""

    buckets: tuple[tuple[torch.Tensor, int, int], ...]
    slot: torch.Tensor

    @classmethod
    def from_layout(cls, layout: VarlenLayout, device: torch.device) -> VarlenTensors:
        return cls(
            tuple((torch.from_numpy(i).to(device), n, w) for i, n, w in layout.buckets),
            torch.from_numpy(layout.slot).to(device),
        )


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, window: int | None,
                    softcap: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of rows that each start at position 0: ``q [n, H, w, D]``, ``k``/``v``
    ``[n, Hkv, w, D]`` -> ``[n, H, w, D]``. ``window``: a query sees the ``window`` latest
    positions, its own included (transformers' ``sliding_window``); ``softcap``: scores become
    ``c * tanh(scores / c)`` before the mask (Gemma 2), computed without SDPA, softmax in float32."""
    w = q.shape[2]
    mask = None
    if window is not None and w > window:
        i = torch.arange(w, device=q.device)
        mask = (i[:, None] >= i[None]) & (i[:, None] - i[None] < window)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                              scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if mask is None:
        i = torch.arange(w, device=q.device)
        mask = i[:, None] >= i[None]
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    p = F.dropout(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), p=dropout)
    return torch.matmul(p, v)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    stoa_varlen: VarlenTensors | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query [B, H, L, D]``, ``key``/``value [B, Hkv, L, D]`` -> output ``[B, L, H, D]``.
    ``sliding_window`` and ``softcap`` as the model's attention passes them (see
    :func:`dense_attention`)."""
    if stoa_varlen is None:  # a plain call (one sequence a row from position 0, no layout)
        if sliding_window is None and softcap is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        if attention_mask is not None:
            raise NotImplementedError("stoa_varlen takes no padding mask; pack rows with a layout instead")
        out = dense_attention(query, key, value, scaling, sliding_window, softcap, dropout)
        return out.transpose(1, 2).contiguous(), None
    b, h, length, d = query.shape
    hkv, dv = key.shape[1], value.shape[-1]
    q = query.transpose(1, 2).reshape(b * length, h, d)
    k = key.transpose(1, 2).reshape(b * length, hkv, d)
    v = value.transpose(1, 2).reshape(b * length, hkv, dv)
    outs = []
    for idx, n, w in stoa_varlen.buckets:
        qb = q.index_select(0, idx).view(n, w, h, d).transpose(1, 2)
        kb = k.index_select(0, idx).view(n, w, hkv, d).transpose(1, 2)
        vb = v.index_select(0, idx).view(n, w, hkv, dv).transpose(1, 2)
        ob = dense_attention(qb, kb, vb, scaling, sliding_window, softcap, dropout)
        outs.append(ob.transpose(1, 2).reshape(n * w, h, dv))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.index_select(0, stoa_varlen.slot).view(b, length, h, dv), None


AttentionInterface.register(NAME, varlen_attention)
