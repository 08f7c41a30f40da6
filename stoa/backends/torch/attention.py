"""Attention over packed rows that never crosses an episode boundary (any device).

Registered in ``transformers``' ``AttentionInterface`` as ``"stoa_varlen"``. A packed row's
episodes are gathered into dense length buckets (see :class:`~stoa.backends.packing.VarlenLayout`),
each bucket runs causal SDPA, and the outputs are scattered back. Work is close to the exact
block-diagonal cost; a dense masked SDPA over the row would cost ``row_len**2`` per head, which
on a CPU is many times the rest of the model for rows of short episodes. Because no mask is
built here (the name is not in the mask registry), ``transformers`` passes ``attention_mask=None``;
called without a layout (a plain ``model(ids)``), it is ordinary causal SDPA.
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


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    stoa_varlen: VarlenTensors | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query [B, H, L, D]``, ``key``/``value [B, Hkv, L, D]`` -> output ``[B, L, H, D]``."""
    if stoa_varlen is None:  # a plain call (one sequence a row, no layout): ordinary SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if sliding_window is not None:
        raise NotImplementedError("sliding-window attention is not supported by the packed learner")
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
        ob = F.scaled_dot_product_attention(
            qb, kb, vb, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=hkv != h
        )
        outs.append(ob.transpose(1, 2).reshape(n * w, h, dv))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.index_select(0, stoa_varlen.slot).view(b, length, h, dv), None


AttentionInterface.register(NAME, varlen_attention)
