"""The torch engine's int8 matmul on CPUs: a small C kernel over the weight state's own codes.

``QLinear`` computes ``x @ W^T`` where ``W = code * scale + bias`` per group of 64 inputs is the
int8 state of record, without a float32 copy of ``W``: the kernel (``kernels/qmatmul.c``)
dequantizes a few hundred rows at a time into a cache-resident buffer exactly as the weights of
record are computed (``stoa.transport.quant.dequantize``: the product rounded, then the bias
added) and multiplies in float32, so its results are a float32 matmul's on the same weights up to
the order of the sums, while it reads one byte per weight from memory instead of four and the
engine holds no float32 weights at all. The codes are the state's numpy arrays, shared: a PULSE
delta written into the state in place is what the next call computes with.

The kernel is compiled once per machine with the system C compiler (``$CC``, else ``cc``/``gcc``;
``-O3 -march=native -fopenmp -ffp-contract=off``, ``-mcpu=native`` on ARM; ``$STOA_KERNEL_MARCH`` names
another CPU, e.g. ``haswell`` for AVX2 without AVX-512: :func:`_attempts`) into
``$STOA_KERNEL_CACHE`` (default ``~/.cache/stoa/kernels``), keyed by the sources' hash, the compiler
and the CPU's flags, and loaded with ``ctypes``; it vectorizes with AVX-512 or AVX2 on x86 and NEON
on 64-bit ARM, in portable C elsewhere (``kernels/simd.h``). The same library (:func:`library`)
holds the decoder's decode attention (``kernels/attention.c``), its whole decode step
(``kernels/step.c``, :mod:`stoa.backends.torch.cstep`) and the host sampler (``kernels/sample.c``,
:mod:`stoa.backends.torch.csample`). :func:`available` says whether it could be, and why not; the
engine's ``auto`` mode falls back to float32 weights when it cannot.

``QLinear(..., digits=3)`` (or ``2``) runs the kernel's integer path instead (the engine's ``int24``
and ``int16`` modes; x86 CPUs with AVX-512 VNNI or AVX2, :func:`integer_available`): each input row
is rounded per group of 64 to 24-bit (16-bit) integers on the group's own scale, and the products
with the int8 codes are exact integer dot products. Its results are the weights of record applied to
those rounded inputs: an error of at most 6e-8 (1.5e-5) of the group's largest entry per input. The
AVX2 build (``kernels/qmatmul_avx2.c``: 16-bit products, no VNNI) gives the VNNI build's bits. With
VNNI it is 1.2-1.4x (1.5-1.8x) faster at batch 16-64 than the float32 path; with AVX2 alone 24-bit
inputs are not (:func:`integer_faster`), 16-bit ones 1.3-2x.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

__all__ = ["QLinear", "available", "integer_available", "integer_faster", "kernel_path", "library"]

_KERNELS = Path(__file__).with_name("kernels")
_SOURCE = _KERNELS / "qmatmul.c"
_SOURCES = (_SOURCE, _KERNELS / "qmatmul_avx2.c", _KERNELS / "attention.c", _KERNELS / "step.c",
            _KERNELS / "sample.c")  # one library; all but qmatmul_avx2.c include simd.h
_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu11", "-ffp-contract=off")
_P = ctypes.c_void_p
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha256(line.encode()).hexdigest()[:12]
    except OSError:
        pass
    return hashlib.sha256(platform.processor().encode()).hexdigest()[:12]


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def kernel_path() -> Path | None:
    """Where this machine's build of the kernel lives (None: no C compiler)."""
    cc = _compiler()
    if cc is None:
        return None
    src = hashlib.sha256(b"".join(p.read_bytes() for p in (*_SOURCES, _KERNELS / "simd.h"))).hexdigest()[:12]
    tag = hashlib.sha256(f"{cc}|{platform.machine()}|{_cpu_key()}|{' '.join(_FLAGS)}|{_target()}".encode()).hexdigest()[:12]
    root = Path(os.environ.get("STOA_KERNEL_CACHE", Path.home() / ".cache" / "stoa" / "kernels"))
    return root / f"qmatmul-{src}-{tag}.so"


def _target() -> str:
    """``$STOA_KERNEL_MARCH``: a CPU to build for instead of this one (e.g. ``haswell`` or
    ``x86-64-v3`` for AVX2 without AVX-512; ``""``: this CPU)."""
    return os.environ.get("STOA_KERNEL_MARCH", "").strip()


def _attempts(machine: str) -> list[list[str]]:
    """The flag sets a build tries in order on a CPU of this ``platform.machine()``: tuned for the
    CPU (``-march=native`` on x86; ``-mcpu=native`` elsewhere, which GCC and Clang take on ARM), then
    without that (a compiler that cannot name the CPU, e.g. a cross compiler), then without OpenMP
    (Apple's clang: one thread). With ``$STOA_KERNEL_MARCH`` set, the named CPU replaces the native
    one and there is no fallback: a build for another CPU that fails is an error, not a slower build."""
    x86 = machine in ("x86_64", "AMD64")
    if _target():
        if not re.fullmatch(r"[A-Za-z0-9_.+-]{1,40}", _target()):
            raise OSError(f"STOA_KERNEL_MARCH={_target()!r} is not a CPU name")
        named = f"-march={_target()}" if x86 else f"-mcpu={_target()}"
        return [[*_FLAGS, named]]
    native = "-march=native" if x86 else "-mcpu=native"
    return [[*_FLAGS, native], list(_FLAGS), [f for f in _FLAGS if f != "-fopenmp"]]


def _build(out: Path, cc: str, machine: str | None = None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        for flags in _attempts(machine or platform.machine()):
            r = subprocess.run([cc, *flags, "-o", tmp, *map(str, _SOURCES)], capture_output=True, text=True,
                               timeout=300)
            if r.returncode == 0:
                break
        else:
            raise OSError(f"{cc} failed: {r.stderr.strip()[-400:]}")
        os.replace(tmp, out)  # atomic: racing builders each install a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL | None:
    global _lib, _why
    with _lock:
        if _lib is not None or _why is not None:
            return _lib
        if os.environ.get("STOA_NO_KERNELS"):
            _why = "STOA_NO_KERNELS is set"
            return None
        path = kernel_path()
        if path is None:
            _why = "no C compiler found ($CC, cc, gcc, clang)"
            return None
        try:
            if not path.is_file():
                _build(path, _compiler())
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as e:
            _why = f"could not build or load the int8 kernel: {e}"
            return None
        lib.stoa_qmatmul.restype = ctypes.c_int
        lib.stoa_qmatmul.argtypes = [_P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, _P, _P, _P, _P, _P,
                                     ctypes.c_int64, ctypes.c_int]
        lib.stoa_qmatmul_int.restype = ctypes.c_int
        lib.stoa_qmatmul_int.argtypes = [*lib.stoa_qmatmul.argtypes, ctypes.c_int]
        lib.stoa_qmatmul_width.restype = ctypes.c_int
        lib.stoa_qmatmul_has_int.restype = ctypes.c_int
        lib.stoa_attn_decode.restype = ctypes.c_int
        lib.stoa_attn_decode.argtypes = [_P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_int64, ctypes.c_float, ctypes.c_int64, _P, ctypes.c_int]
        lib.stoa_decode_layers.restype = ctypes.c_int
        lib.stoa_decode_layers.argtypes = [_P, ctypes.c_int, _P, ctypes.c_int64, _P, _P, ctypes.c_int64, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_int64, _P, _P, _P, _P, ctypes.c_int64,
                                           ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        _lib = lib
        return lib


def library() -> ctypes.CDLL | None:
    """The built kernel library (the int8 matmul, ``stoa_attn_decode``, ``stoa_decode_layers`` and
    ``stoa_sample``), or None where it cannot be built (:func:`available` says why)."""
    return _load()


def available() -> tuple[bool, str]:
    """(whether the kernel is usable here, a reason when not / its vector width when it is)."""
    lib = _load()
    if lib is None:
        return False, str(_why)
    return True, f"{lib.stoa_qmatmul_width()} float32 lanes"


_INTEGER = {1: "AVX-512 VNNI", 2: "AVX2 (16-bit products, no VNNI)"}  # stoa_qmatmul_has_int's answers


def integer_available() -> tuple[bool, str]:
    """(whether the kernel's integer path is usable here, which one it is / a reason when not)."""
    lib = _load()
    if lib is None:
        return False, str(_why)
    kind = lib.stoa_qmatmul_has_int()
    if kind not in _INTEGER:
        return False, "this CPU (or this compiler) has neither AVX-512 VNNI nor AVX2, which the integer path needs"
    return True, _INTEGER[kind]


def integer_faster() -> bool:
    """Whether the integer path beats the float32 path here, so the engine's ``auto`` takes it:
    with AVX-512 VNNI (byte products, 1.2-1.4x at 16-64 rows); not with AVX2 alone, whose 16-bit
    products measured 0.86-0.96x of its float32 path (docs/rollout.md)."""
    lib = _load()
    return lib is not None and lib.stoa_qmatmul_has_int() == 1


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


class QLinear:
    """``x @ [W_0; W_1; ...]^T`` (the matrices' outputs side by side) for int8 matrices of the same
    input width, given as ``(codes, scales, biases)`` numpy arrays of the weight state (codes uint8
    ``[out, in]``, C-contiguous; scales and biases ``[out, in / 64]`` in any float dtype). The codes
    are used in place; float32 copies of scales and biases are made only when they are not float32
    already (:meth:`refresh` re-reads them after a write). ``digits`` 3 or 2: the kernel's integer
    path on inputs of that many bytes (see the module's docstring); 0: the float32 path."""

    def __init__(self, parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], digits: int = 0) -> None:
        lib = _load()
        if lib is None:
            raise RuntimeError(str(_why))
        if digits not in (0, 2, 3):
            raise ValueError(f"digits={digits}: 0 (float32 inputs), 2 or 3 (16- or 24-bit integer inputs)")
        if digits and not lib.stoa_qmatmul_has_int():
            raise RuntimeError(integer_available()[1])
        self._lib = lib
        self.digits = digits
        if digits:
            self._matmul = lambda *args: lib.stoa_qmatmul_int(*args, digits)
        else:
            self._matmul = lib.stoa_qmatmul
        self.parts = [tuple(p) for p in parts]
        widths = {int(c.shape[1]) for c, _, _ in self.parts}
        if len(widths) != 1:
            raise ValueError(f"matrices of one QLinear share their input width, got {sorted(widths)}")
        self.in_features = widths.pop()
        if self.in_features % 64:
            raise ValueError(f"input width {self.in_features} is not a multiple of 64")
        for c, s, b in self.parts:
            if c.dtype != np.uint8 or not c.flags.c_contiguous or c.ndim != 2:
                raise ValueError("codes must be C-contiguous uint8 [out, in]")
            if s.shape != (c.shape[0], c.shape[1] // 64) or b.shape != s.shape:
                raise ValueError(f"scales/biases {s.shape}/{b.shape} do not fit codes {c.shape}")
        self.outs = [int(c.shape[0]) for c, _, _ in self.parts]
        self.out_features = sum(self.outs)
        m = len(self.parts)
        self._m = m
        self._outs = (ctypes.c_int64 * m)(*self.outs)
        self._codes = (_P * m)(*[c.ctypes.data for c, _, _ in self.parts])
        self.refresh()

    def refresh(self) -> None:
        """Re-read scales and biases (after the state's float arrays were written)."""
        self._scales = [_f32(s) for _, s, _ in self.parts]
        self._biases = [_f32(b) for _, _, b in self.parts]
        m = self._m
        self._s = (_P * m)(*[s.ctypes.data for s in self._scales])
        self._b = (_P * m)(*[b.ctypes.data for b in self._biases])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError("QLinear computes float32 on the CPU")
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()
        n = x2.shape[0]
        y = torch.empty((n, self.out_features), dtype=torch.float32)
        if n:
            rc = self._matmul(x2.data_ptr(), n, self.in_features, self._m, self._codes, self._s, self._b,
                               self._outs, y.data_ptr(), self.out_features, torch.get_num_threads())
            if rc != 0:
                raise MemoryError("the int8 kernel could not allocate its buffers")
        if bias is not None:
            y += bias
        return y.reshape(*shape[:-1], self.out_features)
