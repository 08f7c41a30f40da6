"""The sampling rule of :mod:`stoa.backends.sampling` in C, for the torch engine's CPU host path.

:func:`sample` draws what :class:`stoa.backends.sampling.HostSampler` draws from float32 logits
without top-k / top-p (``kernels/sample.c``, built into the library of
:mod:`stoa.backends.torch.qlinear`): the same float32 scaling, shift and candidate bounds, the same
integer noise codes and deficit table, a float32 Gumbel noise whose two logs are correctly rounded
(numpy's float32 ``log`` / ``log1p`` are within one unit in the last place of them; so the two
samplers' tokens differ only where two noised scores lie within float32 rounding of each other, as
the torch sampler's do), and the log-prob ``z_t - log(sum exp z)`` with the sum in double (within
~1e-6 of numpy's float32 sum). Its bound on the winner rises as it scans a row, so a flat
distribution (a random model's) costs about what a peaked one does. A row's result does not depend
on the other rows of its batch or on the threads.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from stoa.backends.sampling import split_seeds
from stoa.backends.torch import qlinear

__all__ = ["available", "built", "noise", "sample", "supports", "table"]

_P = ctypes.c_void_p
_lock = threading.Lock()
_typed: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL | None:
    """The kernel library with this module's functions typed (None where it cannot be built)."""
    global _typed
    lib = qlinear.library()
    if lib is None or _typed is lib:
        return lib
    with _lock:
        lib.stoa_sample.restype = ctypes.c_int
        lib.stoa_sample.argtypes = [_P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _P, _P, ctypes.c_float,
                                    _P, _P, ctypes.c_int]
        lib.stoa_sample_noise.restype = ctypes.c_int
        lib.stoa_sample_noise.argtypes = [_P, ctypes.c_int64, _P]
        lib.stoa_sample_table.restype = ctypes.c_int
        lib.stoa_sample_table.argtypes = [_P, ctypes.c_int]
        _typed = lib
    return lib


def available() -> tuple[bool, str]:
    """(whether the C sampler can run here, why not when it cannot): :func:`qlinear.available`."""
    return qlinear.available()


def built() -> bool:
    """Whether the kernel library is built and loaded here (building it on the first call)."""
    return qlinear.library() is not None


def supports(top_k: int, top_p: float) -> bool:
    """Whether :func:`sample` takes these truncation settings (none: ``top_k == 0``, ``top_p == 1``)."""
    return top_k == 0 and top_p == 1.0


def sample(logits: torch.Tensor | np.ndarray, seeds: np.ndarray, temperature: float, top_k: int = 0,
           top_p: float = 1.0, threads: int = 1) -> tuple[np.ndarray, np.ndarray] | None:
    """Tokens (int64) and behaviour log-probs (float32) of raw float32 CPU logits ``[n, V]`` (a torch
    tensor or numpy array, rows of unit stride) for uint64 row seeds ``[n]``, on ``threads`` OpenMP
    threads. None when some row's scaled logits hold a NaN or no finite maximum (what such a row
    gives is :class:`HostSampler`'s business). Raises ``RuntimeError`` where the library cannot be
    built and ``ValueError`` for top-k / top-p or arguments it does not take."""
    if not supports(top_k, top_p):
        raise ValueError(f"top_k={top_k}, top_p={top_p}: the C sampler draws untruncated (top_k 0, top_p 1)")
    if not (np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature} must be finite and > 0")
    lib = _library()
    if lib is None:
        raise RuntimeError(available()[1])
    if isinstance(logits, torch.Tensor):
        if logits.device.type != "cpu" or logits.dtype != torch.float32:
            raise ValueError(f"logits on {logits.device} as {logits.dtype}: the C sampler takes float32 CPU logits")
        x = logits.detach().numpy()
    else:
        x = np.asarray(logits)
        if x.dtype != np.float32:
            raise ValueError(f"logits dtype {x.dtype}: the C sampler takes float32 logits")
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"logits of shape {x.shape}: expected [n, V], V >= 1")
    n, v = x.shape
    if x.strides[1] != 4 or (n > 1 and (x.strides[0] % 4 or x.strides[0] < 4 * v)):
        x = np.ascontiguousarray(x)
    ld = x.strides[0] // 4 if n > 1 else v
    seeds = np.asarray(seeds)
    if seeds.shape != (n,) or seeds.dtype != np.uint64:
        raise ValueError(f"seeds: uint64 [{n}] expected, got {seeds.dtype} {seeds.shape}")
    lo, hi = split_seeds(seeds)
    lo, hi = np.ascontiguousarray(lo), np.ascontiguousarray(hi)
    tok = np.empty(n, np.int64)
    lp = np.empty(n, np.float32)
    if n == 0:
        return tok, lp
    rc = lib.stoa_sample(x.ctypes.data, n, v, ld, lo.ctypes.data, hi.ctypes.data, float(np.float32(1.0 / temperature)),
                         tok.ctypes.data, lp.ctypes.data, max(1, int(threads)))
    if rc == 1:
        return None
    if rc:
        raise (MemoryError if rc == -2 else ValueError)(f"stoa_sample failed ({rc}) on logits {x.shape}")
    return tok, lp


def noise(codes: np.ndarray) -> np.ndarray:
    """float32 Gumbel noise of 23-bit codes, as the C sampler computes it (for tests)."""
    lib = _library()
    if lib is None:
        raise RuntimeError(available()[1])
    c = np.ascontiguousarray(codes, np.uint32)
    out = np.empty(c.shape, np.float32)
    if lib.stoa_sample_noise(c.ctypes.data, c.size, out.ctypes.data):
        raise ValueError("codes must be below 2^23")
    return out


def table() -> np.ndarray:
    """The C sampler's code threshold per deficit bin (:data:`stoa.backends.sampling._NEED`; for tests)."""
    lib = _library()
    if lib is None:
        raise RuntimeError(available()[1])
    out = np.zeros(256, np.uint32)
    k = lib.stoa_sample_table(out.ctypes.data, out.size)
    return out[:k].copy()
