"""The MLX rollout backend (``stoa.backends.engine.make_engine(..., backend="mlx")``).

Imports ``mlx`` and ``mlx_lm``; nothing outside ``stoa.backends.mlx`` may import it at module level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stoa import _blas

_blas.load_openblas()  # before mlx loads: bind its BLAS calls to OpenBLAS, not the bundled reference BLAS

from stoa.backends.mlx.engine import MODES, MLXEngine, resolve_mode  # noqa: E402

__all__ = ["MLXEngine", "MODES", "make", "resolve_mode"]


def make(hf_dir: str | Path, **options: Any) -> MLXEngine:
    """``MLXEngine.from_pretrained(hf_dir, **options)`` (options: ``mode``, ``version``, ``config``)."""
    return MLXEngine.from_pretrained(hf_dir, **options)
