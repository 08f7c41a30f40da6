"""One reading of a Hugging Face ``config.json`` that every stack of a run shares.

transformers and mlx-lm read the same file differently. transformers 5 writes RoPE's base and
scaling nested (``rope_parameters: {rope_theta, rope_type, ...}``), transformers 4 at the top
level (``rope_theta``, ``rope_scaling``); mlx-lm 0.32's ``llama`` and ``qwen2`` read only the
top-level form and silently fall back to their own defaults. The defaults differ too (mlx-lm's
``llama`` ties the head when the key is absent, transformers does not; mlx-lm's ``qwen2`` RoPE
base is 1e6, transformers' 1e4), and mlx-lm's ``qwen2`` derives the head size from the hidden
size whatever ``head_dim`` says. Sliding windows are spelled per family: Qwen's
``use_sliding_window`` with ``max_window_layers``, Mistral's ``sliding_window`` on every layer,
Gemma's ``layer_types`` (or Gemma 3's older ``sliding_window_pattern``), and mlx-lm reads only
some of them (its ``gemma2`` and ``qwen2`` build no windows at all); Gemma 3 gives its sliding
layers their own RoPE base, nested per layer type in transformers 5.

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

__all__ = ["FULL", "LEARNERS", "ModelConfigError", "ModelSpec", "SLIDING", "SUPPORTED", "check_learner",
           "disagreements", "load", "normalized", "read"]

SUPPORTED = ("qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3_text")
"""``model_type`` values the MLX engine, the torch learner and the int8 scorers run."""

LEARNERS = {"torch": SUPPORTED, "megatron": ("qwen2", "qwen3", "llama")}
"""``model_type`` values each learner backend builds (Megatron's layer specs have no Gemma norms,
soft-capping or embedding scale, and :func:`check_learner` refuses what else it lacks)."""

FULL, SLIDING = "full_attention", "sliding_attention"
"""The two ``layer_types`` values: causal attention over everything before, or over the last
``sliding_window`` positions (the query's own included)."""

_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
"""RoPE variants that transformers and mlx-lm both implement."""

_GEMMA = ("gemma2", "gemma3_text")

# transformers' defaults for a key the file leaves out (its config classes, 4.51 through 5.x).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 2048},
    "qwen2": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 32768, "head_dim": 128, "sliding_window": 4096, "max_window_layers": 28},
    "mistral": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "gemma2": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
               "max_position_embeddings": 8192, "head_dim": 256, "sliding_window": 4096,
               "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True, "max_position_embeddings": 131072, "head_dim": 256,
                    "sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": None,
                    "final_logit_softcapping": None, "sliding_window_pattern": 6},
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
    """RoPE's base (of the full-attention layers, where the two kinds differ)."""
    rope_scaling: tuple[tuple[str, Any], ...]
    """RoPE scaling fields (``rope_type`` first), sorted; empty for plain RoPE."""
    rms_norm_eps: float
    tie_word_embeddings: bool
    """The output head is the embedding matrix."""
    max_position_embeddings: int
    layer_types: tuple[str, ...] = ()
    """:data:`FULL` or :data:`SLIDING`, one per layer."""
    sliding_window: int | None = None
    """Positions a sliding layer's query sees (its own included); None when no layer slides."""
    rope_local_theta: float | None = None
    """RoPE's base of the sliding layers, where the family gives them their own (Gemma 3); None: ``rope_theta``."""
    attention_scale: float = 0.0
    """Multiplier of q·k: ``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5`` (Gemma)."""
    attn_logit_softcapping: float | None = None
    """``c * tanh(scores / c)`` on attention scores before the mask (Gemma 2); None: none."""
    final_logit_softcapping: float | None = None
    """``c * tanh(logits / c)`` on the output logits (Gemma 2); None: none."""
    hidden_act: str = "silu"
    """The gated MLP's activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (Gemma's GeGLU)."""

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention)."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) or None
        d["layer_types"] = list(self.layer_types)
        return d


def _num(cfg: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise ModelConfigError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    if not math.isfinite(v) or v <= 0:
        raise ModelConfigError(f"{where}: {key} must be positive, got {v!r}")
    return kind(v)


def _opt(cfg: Mapping[str, Any], key: str, defaults: Mapping[str, Any], kind: type, where: str) -> Any:
    """``cfg[key]`` (None allowed when given as null), else the family's default."""
    if key not in cfg:
        return defaults.get(key)
    return None if cfg[key] is None else _num(cfg, key, kind, where)


def _rope(top_theta: Any, top_scaling: Any, nested: Any, default: float, where: str,
          names: tuple[str, str, str] = ("rope_theta", "rope_parameters", "rope_scaling")) -> tuple[float, dict]:
    """RoPE's base and scaling from either layout; refuses the two layouts disagreeing. ``names``:
    the keys as the message should call them (top-level base, nested table, top-level scaling)."""
    theta_key, nested_key, scaling_key = names
    if nested is not None and not isinstance(nested, Mapping):
        raise ModelConfigError(f"{where}: {nested_key} must be a mapping, got {type(nested).__name__}")
    if top_scaling is not None and not isinstance(top_scaling, Mapping):
        raise ModelConfigError(f"{where}: {scaling_key} must be a mapping, got {type(top_scaling).__name__}")
    # Newer transformers write the base into both tables as well as (or instead of) the top level.
    thetas = {k: float(v) for k, v in ((theta_key, top_theta),
                                       (f"{nested_key}.rope_theta", (nested or {}).get("rope_theta")),
                                       (f"{scaling_key}.rope_theta", (top_scaling or {}).get("rope_theta")))
              if v is not None}
    if len(set(thetas.values())) > 1:
        (first, v0), *rest = thetas.items()
        other, v1 = next((k, v) for k, v in rest if v != v0)
        raise ModelConfigError(f"{where}: {first} {v0:g} and {other} {v1:g} disagree")
    theta = next(iter(thetas.values()), default)
    if not math.isfinite(theta) or theta <= 0:
        raise ModelConfigError(f"{where}: {theta_key} must be positive, got {theta!r}")
    scaling: dict[str, Any] = {}
    for src in ({k: v for k, v in (top_scaling or {}).items() if k != "rope_theta"},
                {k: v for k, v in (nested or {}).items() if k != "rope_theta"}):
        s = dict(src)
        if "type" in s:  # the older spelling of rope_type
            s.setdefault("rope_type", s.pop("type"))
        if s.get("rope_type", "default") == "default" and set(s) <= {"rope_type"}:
            continue
        if scaling and s != scaling:
            raise ModelConfigError(f"{where}: {scaling_key} {scaling} and {nested_key} {s} disagree")
        scaling = s
    kind = scaling.get("rope_type", "default")
    if kind not in _ROPE_TYPES:
        raise ModelConfigError(f"{where}: RoPE type {kind!r} is not one of {_ROPE_TYPES} (what every stack implements)")
    if kind == "default":
        scaling = {}
    elif "factor" not in scaling:
        raise ModelConfigError(f"{where}: RoPE scaling {kind!r} needs a factor")
    return theta, scaling


def _ropes(mt: str, cfg: Mapping[str, Any], d: Mapping[str, Any], where: str) -> tuple[float, dict, float | None]:
    """(base, scaling, sliding layers' own base or None) of the family's RoPE layout."""
    if mt != "gemma3_text":
        theta, scaling = _rope(cfg.get("rope_theta"), cfg.get("rope_scaling"), cfg.get("rope_parameters"),
                               d["rope_theta"], where)
        if mt == "gemma2" and scaling:
            raise ModelConfigError(f"{where}: gemma2 with RoPE scaling ({scaling['rope_type']}) is not supported: "
                                   "mlx-lm's gemma2 builds plain RoPE")
        return theta, scaling, None
    # Gemma 3: transformers 5 nests one table per layer type; transformers 4 and mlx-lm read
    # rope_theta / rope_scaling (full layers) and rope_local_base_freq (sliding layers).
    nested = cfg.get("rope_parameters")
    if nested is not None and (not isinstance(nested, Mapping) or not set(nested) <= {FULL, SLIDING}):
        raise ModelConfigError(f"{where}: gemma3_text's rope_parameters must map {FULL!r} and {SLIDING!r} to "
                               f"their RoPE tables, got {nested!r}")
    theta, scaling = _rope(cfg.get("rope_theta"), cfg.get("rope_scaling"), (nested or {}).get(FULL),
                           d["rope_theta"], where, ("rope_theta", f"rope_parameters.{FULL}", "rope_scaling"))
    local, local_scaling = _rope(cfg.get("rope_local_base_freq"), None, (nested or {}).get(SLIDING),
                                 d["rope_local_base_freq"], where,
                                 ("rope_local_base_freq", f"rope_parameters.{SLIDING}", "rope_scaling"))
    if local_scaling:
        raise ModelConfigError(f"{where}: RoPE scaling on gemma3_text's sliding layers ({local_scaling}) is not "
                               "supported: mlx-lm scales only the full-attention layers")
    return theta, scaling, local


def _layers(mt: str, cfg: Mapping[str, Any], d: Mapping[str, Any], n: int,
            where: str) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention kind and the sliding window, as transformers derives them."""
    given = cfg.get("layer_types")
    if given is not None:
        if not isinstance(given, (list, tuple)) or len(given) != n or not set(given) <= {FULL, SLIDING}:
            raise ModelConfigError(f"{where}: layer_types must list {FULL!r} or {SLIDING!r} for each of the "
                                   f"{n} layers, got {given!r}")
    if mt == "llama":
        if given and SLIDING in given or (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
            what = f"layer_types {sorted(set(given))}" if given and SLIDING in given else \
                f"sliding_window {cfg.get('sliding_window')}"
            raise ModelConfigError(f"{where}: sliding-window attention ({what}) is not supported for llama: "
                                   "transformers' Llama has none (a Llama with windows is a mistral)")
        return (FULL,) * n, None
    if mt == "mistral":
        if given is not None:  # transformers' Mistral ignores them; mlx-lm's would not
            raise ModelConfigError(f"{where}: mistral with layer_types is not read alike (transformers' Mistral "
                                   "ignores them and slides every layer by sliding_window)")
        window = _opt(cfg, "sliding_window", d, int, where)
        return ((SLIDING if window else FULL),) * n, window
    if mt in ("qwen2", "qwen3"):
        window = _opt(cfg, "sliding_window", d, int, where) if cfg.get("use_sliding_window") else None
        start = cfg.get("max_window_layers", d["max_window_layers"])
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ModelConfigError(f"{where}: max_window_layers must be a non-negative integer, got {start!r}")
        types = tuple(given) if given is not None else tuple(
            SLIDING if window is not None and i >= start else FULL for i in range(n))
        if SLIDING in types and window is None:
            raise ModelConfigError(f"{where}: layer_types name sliding layers but use_sliding_window is not set")
        return types, window if SLIDING in types else None
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{where}: {mt} with use_bidirectional_attention is not supported (causal LMs only)")
    window = _opt(cfg, "sliding_window", d, int, where)
    if mt == "gemma2":
        types = tuple(given) if given is not None else tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    else:  # gemma3_text: mlx-lm builds sliding_window_pattern - 1 sliding layers, then a full one
        pattern = cfg.get("sliding_window_pattern")
        if given is not None and pattern is None and FULL in given:
            pattern = given.index(FULL) + 1
        pattern = d["sliding_window_pattern"] if pattern is None else pattern
        if not isinstance(pattern, int) or isinstance(pattern, bool) or not 1 <= pattern <= n:
            raise ModelConfigError(f"{where}: sliding_window_pattern must be an integer from 1 to "
                                   f"num_hidden_layers ({n}), got {pattern!r}")
        periodic = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
        types = tuple(given) if given is not None else periodic
        if types != periodic:
            raise ModelConfigError(f"{where}: gemma3_text layer_types that are not sliding_window_pattern - 1 "
                                   "sliding layers then one full one are not read alike by mlx-lm")
    if SLIDING in types and window is None:
        raise ModelConfigError(f"{where}: {mt} has sliding layers but sliding_window is null")
    return types, window if SLIDING in types else None


def read(cfg: Mapping[str, Any], where: str = "config.json") -> ModelSpec:
    """The :class:`ModelSpec` of an HF config dict (either transformers layout). Raises
    :class:`ModelConfigError` for a model that some stack of a run would not run as written."""
    if not isinstance(cfg, Mapping):
        raise ModelConfigError(f"{where}: a config is a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ModelConfigError(f"{where}: model_type {mt!r} is not supported (not one of {SUPPORTED})")
    d = _DEFAULTS[mt]
    if "text_config" in cfg:
        raise ModelConfigError(f"{where}: a multimodal config (text_config) is not supported")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{where}: partial_rotary_factor {cfg['partial_rotary_factor']} is not supported")
    if mt in _GEMMA:
        # transformers' Gemma reads hidden_activation (hidden_act is ignored); mlx-lm's is tanh-GELU
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ModelConfigError(f"{where}: {mt} with hidden_activation {act!r} is not supported "
                                   "(gelu_pytorch_tanh only, what mlx-lm builds)")
    elif (act := cfg.get("hidden_act", "silu")) != "silu":
        raise ModelConfigError(f"{where}: hidden_act {act!r} is not supported (silu only: a SwiGLU MLP)")
    if mt in ("mistral", *_GEMMA):
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ModelConfigError(f"{where}: {mt} with {key} is not supported (transformers builds none)")
    for key in ("quantization_config", "quantization"):
        if key in cfg:
            raise ModelConfigError(f"{where}: the model is already quantized ({key}); give the float checkpoint")
    hidden, heads = _num(cfg, "hidden_size", int, where), _num(cfg, "num_attention_heads", int, where)
    layers = _num(cfg, "num_hidden_layers", int, where)
    kv = _num(cfg, "num_key_value_heads", int, where) if cfg.get("num_key_value_heads") is not None else heads
    if heads % kv:
        raise ModelConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if mt in ("llama", *_GEMMA) and hidden % heads:  # transformers' config classes refuse it, head_dim or not
        raise ModelConfigError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                               f"(transformers refuses a {mt} config so)")
    head_dim = cfg.get("head_dim")
    head_dim = (_num(cfg, "head_dim", int, where) if head_dim is not None
                else int(d.get("head_dim", hidden // heads)))
    if mt == "qwen2" and head_dim * heads != hidden:
        # mlx-lm's qwen2 derives the head size from hidden_size and ignores head_dim.
        raise ModelConfigError(f"{where}: qwen2 with head_dim {head_dim} != hidden_size / num_attention_heads "
                               f"({hidden // heads}) is not read alike by mlx-lm")
    theta, scaling, local = _ropes(mt, cfg, d, where)
    types, window = _layers(mt, cfg, d, layers, where)
    eps = _num(cfg, "rms_norm_eps", float, where) if cfg.get("rms_norm_eps") is not None else d["rms_norm_eps"]
    tie = cfg.get("tie_word_embeddings", d["tie_word_embeddings"])
    if not isinstance(tie, bool):
        raise ModelConfigError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
    if mt in _GEMMA and not tie:
        raise ModelConfigError(f"{where}: {mt} with an untied head is not supported (mlx-lm's {mt} ties it)")
    maxpos = (_num(cfg, "max_position_embeddings", int, where) if cfg.get("max_position_embeddings") is not None
              else d["max_position_embeddings"])
    scalar = _opt(cfg, "query_pre_attn_scalar", d, float, where) if mt in _GEMMA else None
    caps = {k: _opt(cfg, k, d, float, where) if mt in _GEMMA else None
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    if mt == "gemma3_text" and any(caps.values()):
        raise ModelConfigError(f"{where}: gemma3_text with soft-capping ({', '.join(k for k, v in caps.items() if v)}) "
                               "is not supported: mlx-lm's gemma3_text applies none")
    return ModelSpec(model_type=mt, vocab_size=_num(cfg, "vocab_size", int, where), hidden_size=hidden,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                     rope_theta=theta, rope_scaling=tuple(sorted(scaling.items())), rms_norm_eps=eps,
                     tie_word_embeddings=tie, max_position_embeddings=maxpos, layer_types=types,
                     sliding_window=window, rope_local_theta=local,
                     attention_scale=float(scalar or head_dim) ** -0.5, **caps,
                     hidden_act="gelu_pytorch_tanh" if mt in _GEMMA else "silu")


def check_learner(cfg: Mapping[str, Any], kind: str, where: str = "config.json") -> ModelSpec:
    """:func:`read`, and what the ``kind`` learner backend cannot build refused in one line."""
    spec = read(cfg, where)
    if kind not in LEARNERS:
        raise ModelConfigError(f"learner {kind!r} is not one of {sorted(LEARNERS)}")
    if spec.model_type not in LEARNERS[kind]:
        raise ModelConfigError(f"{where}: the {kind} learner does not build model_type {spec.model_type!r} "
                               f"(it builds {', '.join(LEARNERS[kind])}); use the torch learner")
    if kind == "megatron":
        why = None
        if spec.sliding_window is not None:
            why = f"sliding-window attention (window {spec.sliding_window})"
        elif spec.rope_scaling:
            why = f"RoPE scaling {spec.rope_type!r}"
        elif spec.model_type != "qwen2" and cfg.get("attention_bias"):
            # Llama/Qwen3 attention_bias also puts a bias on o_proj, which Megatron ties to the MLP biases.
            why = f"attention_bias on {spec.model_type}"
        elif cfg.get("mlp_bias"):
            why = "mlp_bias"
        if why:
            raise ModelConfigError(f"{where}: the megatron learner does not implement {why}; use the torch learner")
    return spec


def normalized(cfg: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """``cfg`` with every field of its :class:`ModelSpec` written explicitly and RoPE written in
    both layouts (top-level ``rope_theta``/``rope_scaling`` for transformers 4 and mlx-lm,
    ``rope_parameters`` for transformers 5), so no stack falls back to a default of its own."""
    spec = read(cfg, where)
    out = dict(cfg)
    scaling = dict(spec.rope_scaling)
    rope = {"rope_theta": spec.rope_theta, "rope_type": "default", **scaling}
    out.update(num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim, rope_theta=spec.rope_theta,
               rope_scaling=scaling or None, rope_parameters=rope, rms_norm_eps=spec.rms_norm_eps,
               tie_word_embeddings=spec.tie_word_embeddings, max_position_embeddings=spec.max_position_embeddings)
    mt = spec.model_type
    if mt == "gemma3_text":
        out.update(rope_local_base_freq=spec.rope_local_theta, rope_parameters={
            FULL: rope, SLIDING: {"rope_theta": spec.rope_local_theta, "rope_type": "default"}},
            sliding_window_pattern=spec.layer_types.index(FULL) + 1)
    if mt in _GEMMA:
        scalar = round(spec.attention_scale ** -2, 6)
        out.update(query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,  # transformers: an int
                   hidden_activation=spec.hidden_act,
                   attn_logit_softcapping=spec.attn_logit_softcapping,
                   final_logit_softcapping=spec.final_logit_softcapping)
    if mt == "mistral":
        out["sliding_window"] = spec.sliding_window
    elif mt != "llama":
        out.update(layer_types=list(spec.layer_types), sliding_window=spec.sliding_window or out.get("sliding_window"))
        if mt in ("qwen2", "qwen3"):
            out["use_sliding_window"] = spec.sliding_window is not None
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
        if k == "layer_types":
            v = list(v)
        if k == "rope_scaling":
            v = {kk: vv for kk, vv in dict(v or {}).items() if kk not in ("rope_theta", "type")} or None
            if v is not None and v.get("rope_type", "default") == "default" and len(v) == 1:
                v = None
        same = (math.isclose(float(v), float(w), rel_tol=1e-6) if isinstance(w, float) and v is not None
                else v == w)
        if not same:
            out.append(f"{k}: built {v!r}, config {w!r}")
    return out
