"""The MLX rollout backend (``stoa.backends.engine.make_engine(..., backend="mlx")``).

Imports ``mlx`` and ``mlx_lm``; nothing outside ``stoa.backends.mlx`` may import it at module level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stoa import blas
from stoa.backends.engine import EngineConfig

blas.load_openblas()  # before mlx loads: bind its BLAS calls to OpenBLAS, not the bundled reference BLAS

from stoa.backends.mlx.engine import MODES, MLXEngine, resolve_mode  # noqa: E402

__all__ = ["MLXEngine", "MODES", "make", "mode", "resolve_mode"]


def mode(mode: str = "auto") -> str:
    """The backend entry of :func:`stoa.backends.engine.engine_mode`: what ``mode`` resolves to here."""
    return resolve_mode(mode)


def make(hf_dir: str | Path, *, state: Any = None, version: int = 0, mode: str = "auto",
         config: EngineConfig = EngineConfig(), worker_id: str = "", fast_ops: bool | None = None) -> MLXEngine:
    """The backend entry of :func:`stoa.backends.engine.make_engine`: from ``state`` when given,
    else from the folder's float weights quantized to int8."""
    if state is not None:
        return MLXEngine.from_state(hf_dir, state, version, mode=mode, config=config, fast_ops=fast_ops,
                                    worker_id=worker_id)
    return MLXEngine.from_pretrained(hf_dir, mode=mode, version=version, config=config, fast_ops=fast_ops,
                                     worker_id=worker_id)
