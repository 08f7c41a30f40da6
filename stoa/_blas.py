"""OpenBLAS preloading for MLX on Linux (its wheel bundles a slow reference BLAS)."""

from __future__ import annotations

import os
import sys

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


def openblas_path() -> str | None:
    """The system OpenBLAS to preload, or None (not Linux, or not installed)."""
    if not sys.platform.startswith("linux"):
        return None
    return next((p for p in _CANDIDATES if os.path.exists(p)), None)


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) with OpenBLAS in ``LD_PRELOAD`` where available."""
    env = dict(os.environ if env is None else env)
    lib = openblas_path()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    return env


def needs_reexec() -> bool:
    """True when this process would run MLX on its reference BLAS but OpenBLAS is available."""
    if os.environ.get("STOA_NO_PRELOAD"):
        return False
    lib = openblas_path()
    return bool(lib) and lib not in os.environ.get("LD_PRELOAD", "")
