"""Tiny models in real Hugging Face format, built offline and deterministically.

``build_tiny(out_dir, texts, TinyConfig(...))`` trains a byte-level BPE tokenizer on ``texts``
with the ``tokenizers`` library and writes a randomly initialised Qwen2 model next to it:
``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` (with a
ChatML chat template), ``special_tokens_map.json`` and ``generation_config.json``. The folder
loads offline with ``mlx_lm.load`` and ``transformers.AutoModelForCausalLM.from_pretrained``.

Only numpy is used here (no torch, no mlx), so the kit runs anywhere ``import stoa`` does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = ["TinyConfig", "build_tiny", "SPECIAL_TOKENS", "TAG_TOKENS", "CHAT_TEMPLATE"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Control tokens: pad/bos (``<|endoftext|>``) and the ChatML turn markers; ``<|im_end|>`` is EOS."""

TAG_TOKENS = [
    "<think>", "</think>", "<search>", "</search>",
    "<information>", "</information>", "<answer>", "</answer>",
]
"""Search-R1 protocol tags, added as whole (non-special) tokens so they decode as text."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the tiny Qwen2 model and its tokenizer."""

    vocab_size: int = 2048
    """Target BPE vocabulary (the model's vocab is the tokenizer's actual size, which may be smaller)."""
    hidden_size: int = 128
    """Model width; a multiple of 64 so every matrix int8-quantizes with group size 64."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention when smaller than num_heads)."""
    intermediate_size: int = 512
    """SwiGLU hidden width; a multiple of 64."""
    max_position_embeddings: int = 2048
    """Longest sequence the config advertises."""
    rope_theta: float = 10000.0
    """RoPE base."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the LM head."""
    init_std: float = 0.02
    """Std of the normal initialisation of every matrix."""
    seed: int = 0
    """Seed of the weight initialisation."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) <= 0 or getattr(self, name) % 64:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive multiple of 64")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS) + len(TAG_TOKENS):
            raise ValueError("vocab_size must cover the 256 byte tokens plus special and tag tokens")
        if self.num_layers < 1 or self.init_std <= 0:
            raise ValueError("num_layers must be >= 1 and init_std > 0")


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(TAG_TOKENS)
    return tok


def _init_weights(cfg: TinyConfig, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(cfg.seed)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = h // cfg.num_heads
    kv = cfg.num_kv_heads * head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * cfg.init_std).astype(np.float32)

    resid = np.float32(1.0 / np.sqrt(2 * cfg.num_layers))
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(vocab, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "self_attn.q_proj.weight"] = mat(h, h)
        w[p + "self_attn.q_proj.bias"] = np.zeros(h, np.float32)
        w[p + "self_attn.k_proj.weight"] = mat(kv, h)
        w[p + "self_attn.k_proj.bias"] = np.zeros(kv, np.float32)
        w[p + "self_attn.v_proj.weight"] = mat(kv, h)
        w[p + "self_attn.v_proj.bias"] = np.zeros(kv, np.float32)
        # Scaled like GPT-2's residual projections so depth does not blow up activations.
        w[p + "self_attn.o_proj.weight"] = mat(h, h) * resid
        w[p + "mlp.gate_proj.weight"] = mat(inter, h)
        w[p + "mlp.up_proj.weight"] = mat(inter, h)
        w[p + "mlp.down_proj.weight"] = mat(h, inter) * resid
    w["model.norm.weight"] = np.ones(h, np.float32)
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = mat(vocab, h)
    return w


def build_tiny(out_dir: str | Path, texts: Iterable[str], config: TinyConfig = TinyConfig()) -> Path:
    """Write a tiny Qwen2 model and its tokenizer to ``out_dir`` and return the path.

    The same ``texts`` (in the same order) and ``config`` give byte-identical files.
    """
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(texts, config.vocab_size)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    max_id = max(tok.get_vocab(with_added_tokens=True).values())
    if max_id >= vocab:  # every id the tokenizer can emit must have an embedding row
        raise RuntimeError(f"tokenizer emits id {max_id} but has only {vocab} entries")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(out / "tokenizer.json"))

    cfg = config
    hf_config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.hidden_size // cfg.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": cfg.num_layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "torch_dtype": "float32",
        "use_cache": True,
        "stoa_tiny": asdict(cfg),
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_position_embeddings,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    gen_config = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                  "pad_token_id": ids["<|endoftext|>"], "do_sample": True}
    for name, obj in (("config.json", hf_config), ("tokenizer_config.json", tok_config),
                      ("special_tokens_map.json", special_map), ("generation_config.json", gen_config)):
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    weights = _init_weights(cfg, vocab)
    assert all(a.dtype == np.float32 for a in weights.values())
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
