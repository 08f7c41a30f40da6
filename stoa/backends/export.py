"""``stoa export``: a learner checkpoint as a Hugging Face model folder.

:func:`export_checkpoint` writes ``config.json``, ``model.safetensors`` and the tokenizer and
generation files of the model the run started from, with the checkpoint's weights: a folder
``transformers.AutoModelForCausalLM.from_pretrained`` and ``mlx_lm.load`` read as they read the
starting model. Torch learner checkpoints are read with numpy alone; Megatron checkpoints (any
tensor / pipeline / data-parallel layout) need torch, not megatron-core.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any, Literal

import numpy as np

from stoa.errors import ExpectedFailure

__all__ = ["ExportError", "export_checkpoint", "find_checkpoint", "find_model_dir"]

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                 "*.ckpt", "*.h5", "*.msgpack", "*.gguf", "*.npz")
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_FORMATS = {"stoa.torch_learner.v1": "torch", "stoa.megatron_learner.v1": "megatron"}


class ExportError(ExpectedFailure, ValueError):
    """The checkpoint or the model folder cannot be exported (the message names what to pass)."""

    exit_code = 2


def find_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a checkpoint (has ``meta.json``), else the newest of a run folder's
    ``checkpoints/v*``."""
    if (path / "meta.json").is_file():
        return path
    found = sorted(p for p in (path / "checkpoints").glob("v*") if (p / "meta.json").is_file())
    if found:
        return found[-1]
    if not path.exists():
        raise ExportError(f"{path} does not exist: pass a checkpoint folder (runs/<name>/checkpoints/v...) "
                          "or a run folder (runs/<name>)")
    raise ExportError(f"{path} is neither a checkpoint (no meta.json) nor a run folder with checkpoints/v*")


def find_model_dir(checkpoint: Path) -> Path:
    """The Hugging Face folder a trainer's checkpoint started from: the run's ``model.path`` (from
    ``runs/<name>/config.json``), else the tiny model the trainer built in ``runs/<name>/model``."""
    run_dir = checkpoint.parent.parent
    model_path = ""
    if (run_dir / "config.json").is_file():
        try:
            model_path = json.loads((run_dir / "config.json").read_text()).get("model", {}).get("path") or ""
        except (ValueError, AttributeError):
            model_path = ""
    candidate = Path(model_path).expanduser() if model_path else run_dir / "model"
    if not (candidate / "config.json").is_file():
        where = f"model.path {model_path!r} of {run_dir / 'config.json'}" if model_path else str(candidate)
        raise ExportError(f"cannot find the model the checkpoint started from ({where} has no config.json): "
                          "pass it with --model DIR")
    return candidate


def _folder_tensors(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], str]:
    """Shapes of the starting folder's tensors and the dtype of its floating-point weights."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: set[str] = set()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{model_dir} holds no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="np") as h:
            for k in h.keys():  # noqa: SIM118 (not a dict)
                s = h.get_slice(k)
                shapes[k] = tuple(s.get_shape())
                dtypes.add(s.get_dtype())
    floats = [d for d in dtypes if d in _ST_DTYPES]
    return shapes, _ST_DTYPES[floats[0]] if len(floats) == 1 else "float32"


def _read(checkpoint: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """HF-named float tensors of a checkpoint (numpy; bf16 as ``ml_dtypes.bfloat16``) and its meta."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except ValueError as e:
        raise ExportError(f"{checkpoint}/meta.json is not JSON: {e}") from None
    backend = _FORMATS.get(meta.get("format")) if isinstance(meta, dict) else None
    if backend == "torch":
        from safetensors.numpy import load_file

        if not (checkpoint / "weights.safetensors").is_file():
            raise ExportError(f"{checkpoint} is not a complete checkpoint (no weights.safetensors)")
        return load_file(str(checkpoint / "weights.safetensors")), meta
    if backend == "megatron":
        import ml_dtypes
        import torch

        from stoa.backends.learner import LearnerError
        from stoa.backends.megatron.export import hf_state

        try:
            state, meta = hf_state(checkpoint)
        except LearnerError as e:
            raise ExportError(str(e)) from None
        out = {}
        for k, v in state.items():
            v = v.detach().cpu().contiguous()
            out[k] = (v.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16
                      else v.float().numpy())
        return out, meta
    raise ExportError(f"{checkpoint} is not a stoa learner checkpoint (meta.json format {meta.get('format')!r}; "
                      f"expected one of {sorted(_FORMATS)})")


def _cast(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return a.astype(ml_dtypes.bfloat16)
    return a.astype(np.dtype(dtype))


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, model_dir: str | Path | None = None,
                      dtype: Dtype = "auto") -> Path:
    """Write a Hugging Face folder at ``out_dir`` from a learner checkpoint; returns ``out_dir``.

    Args:
        checkpoint: a checkpoint folder written by a learner's ``save_checkpoint`` (torch or
            Megatron, recognised by ``meta.json``), or a run folder (its newest checkpoint).
        out_dir: the folder to create; refused if it exists and is not empty.
        model_dir: the Hugging Face folder the learner started from (its config and tokenizer
            are copied). Default: found from the run folder (:func:`find_model_dir`).
        dtype: weights' dtype; ``auto`` keeps the starting folder's.

    Raises:
        ExportError: not a checkpoint, no model folder, or tensors that differ from the model's.
    """
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ExportError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    checkpoint = find_checkpoint(Path(checkpoint))
    model_dir = Path(model_dir).expanduser() if model_dir else find_model_dir(checkpoint)
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir} is not a Hugging Face folder (no config.json)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not empty: choose a new folder")
    hf_config = json.loads((model_dir / "config.json").read_text())
    shapes, folder_dtype = _folder_tensors(model_dir)
    weights, meta = _read(checkpoint)
    tied_head = {"lm_head.weight"} if hf_config.get("tie_word_embeddings") else set()
    wrong = sorted(k for k, v in weights.items() if shapes.get(k) != tuple(v.shape))
    missing = sorted(set(shapes) - set(weights) - tied_head)
    if wrong or missing:
        raise ExportError(f"{checkpoint} does not hold the model in {model_dir} (tensors differing: "
                          f"{(wrong + missing)[:3]}): pass the model the run started from with --model DIR")
    target = folder_dtype if dtype == "auto" else dtype
    from safetensors.numpy import save_file

    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for f in model_dir.iterdir():
            if f.is_file() and not any(f.match(p) for p in _WEIGHT_FILES):
                shutil.copy2(f, tmp / f.name)
        save_file({k: np.ascontiguousarray(_cast(v, target)) for k, v in sorted(weights.items())},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        keys = [k for k in ("torch_dtype", "dtype") if k in hf_config] or ["torch_dtype"]
        hf_config.update({k: target for k in keys})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        (tmp / "stoa_export.json").write_text(json.dumps({
            "backend": _FORMATS[meta["format"]], "step": meta.get("step"), "version": meta.get("version"),
            "checkpoint": checkpoint.name, "dtype": target}, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
