"""Megatron-core ``GPTModel`` built from an HF config (Qwen2 / Qwen3 / Llama).

The layers come from megatron-core's own layer specs: RMSNorm, SwiGLU (``linear_fc1`` =
gate and up), grouped-query attention with a fused ``linear_qkv`` (biases for Qwen2, per-head
q/k RMSNorm for Qwen3), RoPE at the config's theta, tied or untied embeddings. The core
attention kernel is chosen by ``attention``:

* ``"te"``: the Transformer Engine spec (fused kernels, THD packed sequences); CUDA only.
* ``"sdpa"``: the local spec with :class:`SDPAttention`, torch's ``scaled_dot_product_attention``
  (flash / memory-efficient kernels on CUDA); also takes THD packed sequences, one causal
  attention per sequence. The default when Transformer Engine is not installed.
* ``"local"``: the local spec unchanged (Megatron's ``DotProductAttention``, which materializes
  the score matrix and needs an explicit causal mask off CUDA). For checks; no packing.

Building a model needs ``torch.distributed`` and megatron's ``parallel_state`` initialized
(see :mod:`stoa.backends.megatron.learner`).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from .convert import Arch, padded_vocab
from .options import Attention

__all__ = ["Attention", "SDPAttention", "build_gpt", "has_transformer_engine", "resolve_attention",
           "transformer_config"]

def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_attention(kind: Attention, device: torch.device) -> str:
    """``auto`` -> ``te`` on CUDA with Transformer Engine installed, else ``sdpa``."""
    if kind == "auto":
        return "te" if device.type == "cuda" and has_transformer_engine() else "sdpa"
    if kind == "te" and (device.type != "cuda" or not has_transformer_engine()):
        raise ValueError("attention='te' needs CUDA and transformer_engine installed")
    if kind not in ("te", "sdpa", "local"):
        raise ValueError(f"attention={kind!r} must be auto, te, sdpa or local")
    return kind


def transformer_config(
    arch: Arch,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype = torch.float32,
    cpu_init: bool = True,
    recompute: bool = False,
) -> TransformerConfig:
    """The ``TransformerConfig`` of ``arch``: no dropout, no fused kernels that need apex."""
    arch.check_tp(tp)
    if arch.num_layers % pp:
        raise ValueError(f"pipeline size {pp} must divide num_layers={arch.num_layers}")
    extra = {}
    if recompute:
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Packed rows differ in length, so pipeline stages exchange shapes per micro-batch.
        variable_seq_lengths=pp > 1,
        use_cpu_initialization=cpu_init,
        perform_initialization=False,  # every weight is loaded from the HF folder
        **extra,
    )


class SDPAttention(MegatronModule):
    """Core attention with torch SDPA; a drop-in for megatron's ``DotProductAttention``.

    Inputs are megatron's: ``sbhd`` query ``[s, b, heads, d]`` and key/value
    ``[s, b, groups, d]``, or ``thd`` (``[t, heads, d]`` with ``packed_seq_params.cu_seqlens_q``).
    A given ``attention_mask`` is megatron's boolean "True = masked out" tensor.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0:
            raise ValueError("SDPAttention has no attention dropout")
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # q: [b, heads, s, d]; k, v: [b, groups, s, d]
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=self.scale, enable_gqa=True)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None):
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q.tolist()
            outs = []
            for a, b in zip(cu[:-1], cu[1:]):
                q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                outs.append(self._sdpa(q, k, v, None)[0].transpose(0, 1))
            out = torch.cat(outs)
            return out.reshape(out.shape[0], -1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._sdpa(q, k, v, attention_mask)  # [b, heads, s, d]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def build_gpt(
    arch: Arch,
    config: TransformerConfig,
    attention: str = "sdpa",
    *,
    pre_process: bool = True,
    post_process: bool = True,
) -> GPTModel:
    """An (uninitialized) ``GPTModel`` for ``arch``; load weights with :mod:`.convert`."""
    if attention == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    elif attention in ("sdpa", "local"):
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
        if attention == "sdpa":
            spec.submodules.self_attention.submodules.core_attention = SDPAttention
    else:
        raise ValueError(f"attention={attention!r} must be te, sdpa or local")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(arch, config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
    )
