"""The torch stacks' side of a model family: what they add to a ``transformers`` model so it
computes what the run's config means (:class:`stoa.models.hfconfig.ModelSpec`), and what they
check that it built.

* The head: the learner and the int8 scorer run the decoder and the output projection apart (to
  bound logits in memory); :func:`head` puts Gemma 2's final soft-capping, which ``transformers``
  applies in ``ForCausalLM.forward``, back on the projection.
* Gemma 3's embedding scale: ``sqrt(hidden_size)`` rounded to bfloat16, as the checkpoints were
  trained, as ``transformers`` computes it on bfloat16 weights and as mlx-lm always does
  (``transformers`` on float32 weights would use the unrounded root: 33.94 for 34.0 at Gemma 3
  1B's width, ~0.007 nat a token apart).
* :func:`attn_implementation`: soft-capped attention has no SDPA kernel; such models run
  ``transformers``' eager attention unless the learner packs (its own attention caps and masks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stoa.models import hfconfig
from stoa.models.hfconfig import FULL, SLIDING, ModelSpec

__all__ = ["attn_implementation", "built_fields", "head", "prepare", "read_spec"]


def read_spec(hf_dir: str | Path, learner: str, error: type[Exception]) -> ModelSpec:
    """The spec of ``hf_dir``'s config, refused (as ``error``, one line) where the ``learner``
    backend or any other stack of a run would not run it as written."""
    import json

    path = Path(hf_dir) / "config.json"
    try:
        return hfconfig.check_learner(json.loads(path.read_text()), learner, str(path))
    except FileNotFoundError:
        raise error(f"{hf_dir} is not a Hugging Face model folder (no config.json)") from None
    except (ValueError, hfconfig.ModelConfigError) as e:
        raise error(str(e)) from None


def attn_implementation(spec: ModelSpec, packed: bool) -> str:
    """``stoa_varlen`` for packed rows; else SDPA, or eager attention where scores are soft-capped."""
    from stoa.backends.torch import attention

    if packed:
        return attention.NAME
    return "eager" if spec.attn_logit_softcapping else "sdpa"


def head(model: torch.nn.Module, spec: ModelSpec) -> Callable[[torch.Tensor], torch.Tensor]:
    """``hidden -> logits`` exactly as ``model(...).logits`` computes them from the last hidden
    states (float32 where soft-capped)."""
    project = model.get_output_embeddings()
    cap = spec.final_logit_softcapping
    if not cap:
        return project
    return lambda h: torch.tanh(project(h).float() / cap) * cap


def prepare(model: torch.nn.Module, spec: ModelSpec) -> list[str]:
    """Fit ``model`` to ``spec`` in place (Gemma 3's embedding scale); then what it built that
    differs from ``spec`` (:func:`stoa.models.hfconfig.disagreements`), empty when nothing does."""
    if spec.model_type == "gemma3_text":
        emb = model.get_input_embeddings()
        scale = float(torch.tensor(spec.hidden_size ** 0.5, dtype=torch.bfloat16))
        emb.scalar_embed_scale = scale
        emb.embed_scale.fill_(scale)
    return hfconfig.disagreements(spec, built_fields(model))


def built_fields(model: torch.nn.Module) -> dict[str, Any]:
    """What ``transformers`` built, in :class:`~stoa.models.hfconfig.ModelSpec`'s terms."""
    cfg = model.config
    layers = model.get_decoder().layers
    windows = []
    for layer in layers:
        attn = layer.self_attn
        w = attn.sliding_window if hasattr(attn, "sliding_window") else (
            getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None)
        windows.append(w)
    attn = layers[0].self_attn
    rope = cfg.rope_parameters or {}
    full, local = (rope.get(FULL, {}), rope.get(SLIDING, {})) if FULL in rope else (rope, None)
    heads = int(cfg.num_attention_heads)
    return {"model_type": cfg.model_type, "num_hidden_layers": len(layers),
            "head_dim": int(attn.q_proj.weight.shape[0] // heads),
            "rope_theta": float(full["rope_theta"]),
            "rope_local_theta": None if local is None else float(local["rope_theta"]),
            "tie_word_embeddings": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            "layer_types": [FULL if w is None else SLIDING for w in windows],
            "sliding_window": next((w for w in windows if w is not None), None),
            "attention_scale": float(attn.scaling),
            "attn_logit_softcapping": getattr(attn, "attn_logit_softcapping", None),
            "final_logit_softcapping": getattr(cfg, "final_logit_softcapping", None)}
