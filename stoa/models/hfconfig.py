"""One reading of a Hugging Face ``config.json`` that every stack of a run shares.

transformers and mlx-lm read the same file differently. transformers 5 writes RoPE's base and
scaling nested (``rope_parameters: {rope_theta, rope_type, ...}``), transformers 4 at the top
level (``rope_theta``, ``rope_scaling``); mlx-lm 0.32's ``llama`` and ``qwen2`` read only the
top-level form and silently fall back to their own defaults. The defaults differ too (mlx-lm's
``llama`` ties the head when the key is absent, transformers does not; mlx-lm's ``qwen2`` RoPE
base is 1e6, transformers' 1e4), and mlx-lm's ``qwen2`` derives the head size from the hidden
size whatever ``head_dim`` says.

:func:`read` turns a config dict into one :class:`ModelSpec` with transformers' meaning for every
field; :func:`normalized` writes a ``config.json`` dict in which both layouts say the same thing
and no default is left to a framework. The trainer publishes the normalized file to workers; the
MLX engine builds from it; :func:`disagreements` compares a spec with what a framework actually
built. What a stack cannot honour raises :class:`ModelConfigError` with one line naming it.
Only the standard library is used here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelConfigError", "ModelSpec", "SUPPORTED", "disagreements", "load", "normalized", "read"]

SUPPORTED = ("qwen2", "qwen3", "llama")
"""``model_type`` values every stack (MLX engine, torch and Megatron learners, int8 scorers) runs."""

_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
"""RoPE variants that transformers and mlx-lm both implement."""

# transformers' defaults for a key the file leaves out (its config classes, 4.51 through 5.x).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 2048},
    "qwen2": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 32768},
    "qwen3": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 32768, "head_dim": 128},
}


class ModelConfigError(ValueError):
    """The config cannot be read alike by every stack (the message is one line naming why)."""


@dataclass(frozen=True)
class ModelSpec:
    """The numerics-relevant fields of a decoder config, as transformers means them."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """Per-head width of queries and keys."""
    rope_theta: float
    """RoPE's base."""
    rope_scaling: tuple[tuple[str, Any], ...]
    """RoPE scaling fields (``rope_type`` first), sorted; empty for plain RoPE."""
    rms_norm_eps: float
    tie_word_embeddings: bool
    """The output head is the embedding matrix."""
    max_position_embeddings: int

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) or None
        return d


def _num(cfg: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise ModelConfigError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    if not math.isfinite(v) or v <= 0:
        raise ModelConfigError(f"{where}: {key} must be positive, got {v!r}")
    return kind(v)


def _rope(cfg: Mapping[str, Any], defaults: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """RoPE's base and scaling from either layout; refuses the two layouts disagreeing."""
    nested = cfg.get("rope_parameters")
    if nested is not None and not isinstance(nested, Mapping):
        raise ModelConfigError(f"{where}: rope_parameters must be a mapping, got {type(nested).__name__}")
    top_scaling = cfg.get("rope_scaling")
    if top_scaling is not None and not isinstance(top_scaling, Mapping):
        raise ModelConfigError(f"{where}: rope_scaling must be a mapping, got {type(top_scaling).__name__}")
    thetas = {k: float(v) for k, v in (("rope_theta", cfg.get("rope_theta")),
                                      ("rope_parameters.rope_theta", (nested or {}).get("rope_theta")))
              if v is not None}
    if len(set(thetas.values())) > 1:
        raise ModelConfigError(f"{where}: rope_theta {thetas['rope_theta']:g} and rope_parameters.rope_theta "
                               f"{thetas['rope_parameters.rope_theta']:g} disagree")
    theta = next(iter(thetas.values()), defaults["rope_theta"])
    if not math.isfinite(theta) or theta <= 0:
        raise ModelConfigError(f"{where}: rope_theta must be positive, got {theta!r}")
    scaling: dict[str, Any] = {}
    for src in (top_scaling or {}, {k: v for k, v in (nested or {}).items() if k != "rope_theta"}):
        s = dict(src)
        if "type" in s:  # the older spelling of rope_type
            s.setdefault("rope_type", s.pop("type"))
        if s.get("rope_type", "default") == "default" and set(s) <= {"rope_type"}:
            continue
        if scaling and s != scaling:
            raise ModelConfigError(f"{where}: rope_scaling {scaling} and rope_parameters {s} disagree")
        scaling = s
    kind = scaling.get("rope_type", "default")
    if kind not in _ROPE_TYPES:
        raise ModelConfigError(f"{where}: RoPE type {kind!r} is not one of {_ROPE_TYPES} (what every stack implements)")
    if kind == "default":
        scaling = {}
    elif "factor" not in scaling:
        raise ModelConfigError(f"{where}: RoPE type {kind!r} needs a factor")
    return theta, scaling


def read(cfg: Mapping[str, Any], where: str = "config.json") -> ModelSpec:
    """The :class:`ModelSpec` of an HF config dict (either transformers layout). Raises
    :class:`ModelConfigError` for a model that some stack of a run would not run as written."""
    if not isinstance(cfg, Mapping):
        raise ModelConfigError(f"{where}: a config is a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ModelConfigError(f"{where}: model_type {mt!r} is not one of {SUPPORTED}")
    d = _DEFAULTS[mt]
    if "text_config" in cfg:
        raise ModelConfigError(f"{where}: a multimodal config (text_config) is not supported")
    sliding = [t for t in cfg.get("layer_types") or () if t != "full_attention"]
    if sliding or (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
        what = f"layer_types {sorted(set(sliding))}" if sliding else f"sliding_window {cfg.get('sliding_window')}"
        raise ModelConfigError(f"{where}: sliding-window attention ({what}) is not supported: the engine, "
                               "learners and scorers run full attention only")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{where}: partial_rotary_factor {cfg['partial_rotary_factor']} is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    for key in ("quantization_config", "quantization"):
        if key in cfg:
            raise ModelConfigError(f"{where}: the model is already quantized ({key}); give the float checkpoint")
    hidden, heads = _num(cfg, "hidden_size", int, where), _num(cfg, "num_attention_heads", int, where)
    kv = _num(cfg, "num_key_value_heads", int, where) if cfg.get("num_key_value_heads") is not None else heads
    if heads % kv:
        raise ModelConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = cfg.get("head_dim")
    head_dim = (_num(cfg, "head_dim", int, where) if head_dim is not None
                else int(d.get("head_dim", hidden // heads)))
    if mt == "qwen2" and head_dim * heads != hidden:
        # mlx-lm's qwen2 derives the head size from hidden_size and ignores head_dim.
        raise ModelConfigError(f"{where}: qwen2 with head_dim {head_dim} != hidden_size / num_attention_heads "
                               f"({hidden // heads}) is not read alike by mlx-lm")
    theta, scaling = _rope(cfg, d, where)
    eps = _num(cfg, "rms_norm_eps", float, where) if cfg.get("rms_norm_eps") is not None else d["rms_norm_eps"]
    tie = cfg.get("tie_word_embeddings", d["tie_word_embeddings"])
    if not isinstance(tie, bool):
        raise ModelConfigError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
    maxpos = (_num(cfg, "max_position_embeddings", int, where) if cfg.get("max_position_embeddings") is not None
              else d["max_position_embeddings"])
    return ModelSpec(model_type=mt, vocab_size=_num(cfg, "vocab_size", int, where), hidden_size=hidden,
                     num_hidden_layers=_num(cfg, "num_hidden_layers", int, where), num_attention_heads=heads,
                     num_key_value_heads=kv, head_dim=head_dim, rope_theta=theta,
                     rope_scaling=tuple(sorted(scaling.items())), rms_norm_eps=eps, tie_word_embeddings=tie,
                     max_position_embeddings=maxpos)


def normalized(cfg: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """``cfg`` with every field of its :class:`ModelSpec` written explicitly and RoPE written in
    both layouts (top-level ``rope_theta``/``rope_scaling`` for transformers 4 and mlx-lm,
    ``rope_parameters`` for transformers 5), so no stack falls back to a default of its own."""
    spec = read(cfg, where)
    out = dict(cfg)
    scaling = dict(spec.rope_scaling)
    out.update(num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim, rope_theta=spec.rope_theta,
               rope_scaling=scaling or None, rope_parameters={"rope_theta": spec.rope_theta, "rope_type": "default",
                                                              **scaling},
               rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=spec.tie_word_embeddings,
               max_position_embeddings=spec.max_position_embeddings)
    return out


def load(model_dir: str | Path) -> dict[str, Any]:
    """The normalized config of a model folder (see :func:`normalized`)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{model_dir} is not a Hugging Face model folder (no config.json)") from None
    except ValueError as e:
        raise ModelConfigError(f"{path}: not JSON ({e})") from None
    return normalized(raw, str(path))


def disagreements(spec: ModelSpec, built: Mapping[str, Any]) -> list[str]:
    """Fields where what a framework built (``built``: any subset of :class:`ModelSpec`'s fields,
    ``rope_scaling`` as a dict or None) differs from ``spec``, one ``"name: built X, config Y"``
    phrase each."""
    want = spec.to_dict()
    out = []
    for k, v in built.items():
        w = want[k]
        if k == "rope_scaling":
            v = {kk: vv for kk, vv in dict(v or {}).items() if kk not in ("rope_theta", "type")} or None
            if v is not None and v.get("rope_type", "default") == "default" and len(v) == 1:
                v = None
        same = (math.isclose(float(v), float(w), rel_tol=1e-6) if isinstance(w, float) and v is not None
                else v == w)
        if not same:
            out.append(f"{k}: built {v!r}, config {w!r}")
    return out
