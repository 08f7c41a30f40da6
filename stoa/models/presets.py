"""Random-weight Hugging Face models of real shape, built offline and streamed to disk.

``build_preset(out_dir, "qwen2.5-0.5b", texts)`` writes a model with the exact tensor names,
shapes and vocabulary size of the named checkpoint (see :data:`PRESETS`), random weights, and a
small byte-level BPE tokenizer trained on ``texts`` (the tokenizer of :mod:`stoa.models.tiny`).
As in Qwen's own checkpoints, the embedding has more rows than the tokenizer has ids: every id
the tokenizer can emit is below ``vocab_size``, the rest are padding rows that are never indexed.
``build_preset(out_dir, "path/to/config.json", texts)`` does the same for any Qwen2, Qwen3,
Llama, Mistral, Gemma 2 or Gemma 3 (text) ``config.json``.

Weights are written one tensor at a time (a tensor in blocks of rows), so building an 8B shape
needs only a few hundred MB of RAM. Each tensor's values come from its own seeded generator: the
same preset, seed and ``texts`` give byte-identical files. Only numpy is used here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from stoa.models.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer
from stoa.transport import tensorfile

__all__ = ["PRESETS", "build_preset", "decode_flops", "hf_config_for", "num_params", "tensor_specs", "write_safetensors"]

_QWEN2_COMMON = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0, "tie_word_embeddings": True,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {**_QWEN2_COMMON, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "max_window_layers": 24},
    "qwen2.5-1.5b": {**_QWEN2_COMMON, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "max_window_layers": 28},
    "qwen2.5-3b": {**_QWEN2_COMMON, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "max_window_layers": 36},
    "qwen2.5-7b": {**_QWEN2_COMMON, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_window_layers": 28, "tie_word_embeddings": False},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                   "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000.0, "max_position_embeddings": 40960, "attention_bias": False,
                   "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
                   "max_window_layers": 28, "tie_word_embeddings": True},
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                 "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "max_position_embeddings": 40960, "attention_bias": False,
                 "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
                 "max_window_layers": 36, "tie_word_embeddings": False},
    "llama-3.2-1b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                     "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
                     "rope_theta": 500000.0, "max_position_embeddings": 131072, "attention_bias": False,
                     "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True,
                     "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                     "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
                     "rope_theta": 100000.0, "max_position_embeddings": 8192, "attention_bias": False,
                     "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True},
    "mistral-7b-v0.1": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
                        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                        "rope_theta": 10000.0, "max_position_embeddings": 32768, "sliding_window": 4096,
                        "attention_dropout": 0.0, "tie_word_embeddings": False},
    "gemma-2-2b": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                   "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 256000, "hidden_size": 2304,
                   "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "max_position_embeddings": 8192, "sliding_window": 4096, "query_pre_attn_scalar": 256,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention_bias": False,
                   "attention_dropout": 0.0, "tie_word_embeddings": True},
    "gemma-3-1b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                   "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 262144, "hidden_size": 1152,
                   "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "rope_local_base_freq": 10000.0, "max_position_embeddings": 32768, "sliding_window": 512,
                   "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "attn_logit_softcapping": None,
                   "final_logit_softcapping": None, "attention_bias": False, "attention_dropout": 0.0,
                   "tie_word_embeddings": True},
}
"""Shapes of public checkpoints (their ``config.json`` fields that fix tensor shapes and numerics)."""

_DTYPES = {"float32": tensorfile.DTYPES["F32"], "bfloat16": tensorfile.DTYPES["BF16"]}
"""The weight dtypes a preset can be written in, by name."""


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


_KINDS = ("qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3_text")


def tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, init)`` of every tensor of a Qwen2/Qwen3/Llama/Mistral/Gemma 2/Gemma 3
    ``config``, in file order.

    ``init`` is ``"normal"`` (matrices), ``"ones"`` (norms), or ``"zeros"`` (linear biases, and
    Gemma's norms, which scale by ``1 + weight``).
    """
    kind = cfg.get("model_type")
    if kind not in _KINDS:
        raise ValueError(f"model_type {kind!r} is not supported ({', '.join(_KINDS)})")
    gemma = kind.startswith("gemma")
    norm = "zeros" if gemma else "ones"
    h, inter, n = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    hd = _head_dim(cfg)
    q, kv = int(cfg["num_attention_heads"]) * hd, int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * hd
    qkv_bias = kind == "qwen2" or bool(cfg.get("attention_bias"))
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (int(cfg["vocab_size"]), h), "normal")]
    for i in range(n):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), norm), (p + "post_attention_layernorm.weight", (h,), norm)]
        if gemma:
            specs += [(p + "pre_feedforward_layernorm.weight", (h,), norm),
                      (p + "post_feedforward_layernorm.weight", (h,), norm)]
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            specs.append((p + f"self_attn.{proj}.weight", (rows, h), "normal"))
            if qkv_bias:
                specs.append((p + f"self_attn.{proj}.bias", (rows,), "zeros"))
        specs.append((p + "self_attn.o_proj.weight", (h, q), "normal"))
        if cfg.get("attention_bias") and kind != "qwen2":
            specs.append((p + "self_attn.o_proj.bias", (h,), "zeros"))
        if kind in ("qwen3", "gemma3_text"):
            specs += [(p + "self_attn.q_norm.weight", (hd,), norm), (p + "self_attn.k_norm.weight", (hd,), norm)]
        specs += [(p + "mlp.gate_proj.weight", (inter, h), "normal"), (p + "mlp.up_proj.weight", (inter, h), "normal"),
                  (p + "mlp.down_proj.weight", (h, inter), "normal")]
    specs.append(("model.norm.weight", (h,), norm))
    if not cfg.get("tie_word_embeddings", False):
        specs.append(("lm_head.weight", (int(cfg["vocab_size"]), h), "normal"))
    return specs


def num_params(cfg: dict[str, Any]) -> int:
    """Parameter count of ``cfg`` (a tied head counted once, as Hugging Face counts it)."""
    return sum(int(np.prod(s)) for _, s, _ in tensor_specs(cfg))


def decode_flops(cfg: dict[str, Any], context: float) -> float:
    """Floating-point operations of one generated token: 2 per weight of every matrix it
    multiplies (the projections and the output head; the embedding lookup is free) plus attention
    over ``context`` earlier positions (scores and weighted values: 4 * heads * head_dim each)."""
    matmul = sum(int(np.prod(s)) for name, s, _ in tensor_specs(cfg) if len(s) == 2 and "embed_tokens" not in name)
    if cfg.get("tie_word_embeddings", False):
        matmul += int(cfg["vocab_size"]) * int(cfg["hidden_size"])
    attn = 4 * int(cfg["num_attention_heads"]) * _head_dim(cfg) * int(cfg["num_hidden_layers"]) * context
    return 2.0 * matmul + attn


def _fill(name: str, shape: tuple[int, ...], init: str, index: int, seed: int, std: float, n_layers: int,
          dtype: str, rows_per_block: int) -> Iterable[bytes]:
    """The bytes of one tensor, a block of rows at a time."""
    out_dt = _DTYPES[dtype]
    if init != "normal":
        yield (np.ones if init == "ones" else np.zeros)(shape, out_dt).tobytes()
        return
    rng = np.random.default_rng([seed, index])
    # Residual projections scaled down with depth (GPT-2 style) so activations stay bounded.
    scale = std / np.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
    for a in range(0, shape[0], rows_per_block):
        rows = min(rows_per_block, shape[0] - a)
        block = rng.standard_normal((rows, *shape[1:]), dtype=np.float32)
        block *= np.float32(scale)
        yield block.astype(out_dt).tobytes()


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...], str]], chunks: Iterable[Iterable[bytes]],
                      dtype: str = "float32", metadata: dict[str, str] | None = None) -> int:
    """Write a ``.safetensors`` file tensor by tensor; ``chunks`` yields each tensor's bytes in
    ``specs`` order. The header is computed from the shapes first, so nothing is held whole.
    Written to a temporary name and renamed, so a crash never leaves a truncated file. Returns
    the file size (:func:`stoa.transport.tensorfile.write`)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return tensorfile.write(path, [(name, _DTYPES[dtype], shape) for name, shape, _ in specs], chunks,
                            metadata=dict(metadata or {}))


def hf_config_for(preset_or_config: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The HF config of a preset name, a ``config.json`` path, or a config dict (copied)."""
    if isinstance(preset_or_config, dict):
        return dict(preset_or_config)
    key = str(preset_or_config)
    if key.lower() in PRESETS:
        return dict(PRESETS[key.lower()])
    path = Path(key)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{key!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    cfg = json.loads(path.read_text())
    for k in ("quantization", "quantization_config"):
        cfg.pop(k, None)
    return cfg


def build_preset(out_dir: str | Path, preset_or_config: str | Path | dict[str, Any], texts: Iterable[str],
                 tokenizer_vocab: int = 2048, dtype: str = "float32", seed: int = 0, init_std: float = 0.02) -> Path:
    """Write a random-weight model of the given shape with a BPE tokenizer trained on ``texts``.

    ``dtype``: ``float32`` or ``bfloat16`` weights on disk. The tokenizer's ids all fall below
    the config's ``vocab_size`` (checked); the embedding rows past them are padding.
    """
    cfg = hf_config_for(preset_or_config)
    vocab = int(cfg["vocab_size"])
    if tokenizer_vocab > vocab:
        raise ValueError(f"tokenizer_vocab {tokenizer_vocab} exceeds the model's vocab_size {vocab}")
    specs = tensor_specs(cfg)
    for name, shape, _ in specs:
        if len(shape) == 2 and shape[1] % 64:
            raise ValueError(f"{name}: input width {shape[1]} is not a multiple of 64 (int8 groups)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(texts, tokenizer_vocab)
    max_id = max(tok.get_vocab(with_added_tokens=True).values())
    if max_id >= vocab or tok.get_vocab_size(with_added_tokens=True) > vocab:
        raise RuntimeError(f"tokenizer emits id {max_id} but the model has only {vocab} embedding rows")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(out / "tokenizer.json"))
    cfg.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
               torch_dtype=dtype, use_cache=True, initializer_range=init_std)
    cfg.setdefault("hidden_act", "gelu_pytorch_tanh" if str(cfg["model_type"]).startswith("gemma") else "silu")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(cfg.get("max_position_embeddings", 2048)),
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    gen_config = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                  "pad_token_id": ids["<|endoftext|>"], "do_sample": True}
    for name, obj in (("config.json", cfg), ("tokenizer_config.json", tok_config),
                      ("special_tokens_map.json", special_map), ("generation_config.json", gen_config)):
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    n_layers = int(cfg["num_hidden_layers"])
    width = 4 if dtype == "float32" else 2
    chunks = (_fill(name, shape, init, i, seed, init_std, n_layers, dtype,
                    rows_per_block=max(1, (32 << 20) // (width * int(np.prod(shape[1:])) or 1)))
              for i, (name, shape, init) in enumerate(specs))
    write_safetensors(out / "model.safetensors", specs, chunks, dtype, metadata={"format": "pt"})
    return out
