"""OpenBLAS for MLX on Linux: its wheel bundles the slow netlib reference BLAS.

:func:`load_openblas` opens the system OpenBLAS with ``RTLD_GLOBAL`` before ``mlx`` is imported,
so MLX's BLAS calls bind to it. Unlike ``LD_PRELOAD`` this leaves torch's own MKL alone when
torch was imported first (measured speeds: docs/rollout.md, "OpenBLAS for MLX on Linux").
``stoa.backends.mlx`` calls it on import; set
``STOA_NO_OPENBLAS=1`` to opt out. OpenBLAS reads ``OPENBLAS_NUM_THREADS`` when it loads.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

__all__ = ["load_openblas", "openblas_path"]

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
_loaded: str | None = None


def openblas_path() -> str | None:
    """The system OpenBLAS, or None (not Linux, or not installed)."""
    if not sys.platform.startswith("linux"):
        return None
    return next((p for p in _CANDIDATES if os.path.exists(p)), None)


def load_openblas() -> str | None:
    """Make the system OpenBLAS MLX's BLAS in this process; returns its path, or None if not used."""
    global _loaded
    if _loaded or os.environ.get("STOA_NO_OPENBLAS"):
        return _loaded
    lib = openblas_path()
    if lib is None:
        return None
    if "mlx.core" in sys.modules:
        warnings.warn("mlx was imported before stoa.backends.mlx: it keeps its slow reference BLAS in this "
                      "process (import stoa.backends.mlx first, or call stoa.blas.load_openblas())", stacklevel=3)
        return None
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    _loaded = lib
    return lib
