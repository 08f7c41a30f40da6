"""PULSE weight states: what a state is, its layout fingerprint and its hash.

A *state* is a flat ``dict[str, numpy.ndarray]`` (see ``docs/architecture.md``, "Weight state"):
uint8 int8-codes, their scales and biases, and unquantized tensors, in any of the dtypes in
:data:`DTYPES`. :func:`state_hash` names a state (the chain signs it); the layout fingerprint
(sorted names, dtypes, shapes) is what a delta is made for. Pure functions, no I/O; the codec is
:mod:`stoa.transport.pulse_codec`, applying deltas :mod:`stoa.transport.pulse_apply`, and
:mod:`stoa.transport.pulse` the one import path of all three.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping

import numpy as np

from stoa.transport import tensorfile

__all__ = ["DTYPES", "PulseError", "layout_of", "state_hash", "state_hashes"]

DTYPES = tensorfile.DTYPES
"""Accepted dtypes by their safetensors names (little-endian): :data:`stoa.transport.tensorfile.DTYPES`."""
UINT = {1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
"""The unsigned integer dtype of each element width: an array's raw bits (:func:`raw_bits`)."""


class PulseError(ValueError):
    """A PULSE blob is malformed, corrupted, or does not fit the state it is applied to."""


def dtype_code(name: str, a: np.ndarray) -> str:
    """The safetensors dtype name of tensor ``name`` (:class:`PulseError` if it is not a supported array)."""
    if not isinstance(a, np.ndarray):
        raise PulseError(f"{name!r}: expected a numpy array, got {type(a).__name__}")
    try:
        return tensorfile.code(a.dtype)
    except tensorfile.TensorFileError as e:
        raise PulseError(f"{name!r}: {e}") from None


def check_name(name: object) -> str:
    """``name`` if it is a valid tensor name (:func:`stoa.transport.tensorfile.check_name`), else
    :class:`PulseError`."""
    try:
        return tensorfile.check_name(name)
    except tensorfile.TensorFileError as e:
        raise PulseError(str(e)) from None


def fingerprint(state: Mapping[str, np.ndarray]) -> tuple[list[str], bytes]:
    """Sorted names and the sha256 fingerprint of (name, dtype, shape) for each."""
    names = sorted(state)
    h = hashlib.sha256(b"stoa.pulse.layout/1")
    for n in names:
        check_name(n)
        a = state[n]
        h.update(_describe(n, dtype_code(n, a), a.shape))
    return names, h.digest()


def _describe(name: str, code: str, shape: tuple[int, ...]) -> bytes:
    nb = name.encode()
    return struct.pack(f"<I{len(nb)}sB{len(code)}sI{len(shape)}Q", len(nb), nb, len(code),
                       code.encode(), len(shape), *shape)


def feed(h, name: str, a: np.ndarray) -> None:
    """Hash one tensor into ``h`` (a :func:`new_hasher`): its name, dtype, shape, size and raw bytes."""
    h.update(_describe(name, dtype_code(name, a), a.shape))
    h.update(struct.pack("<Q", a.nbytes))
    h.update(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))


def new_hasher():
    """A sha256 primed for a state's hash (fed with :func:`feed`, tensors in sorted-name order)."""
    return hashlib.sha256(b"stoa.pulse.state/1")


def state_hash(state: Mapping[str, np.ndarray]) -> str:
    """Hex sha256 naming a state: over sorted names, each with its dtype, shape and raw bytes."""
    h = new_hasher()
    for n in sorted(state):
        feed(h, n, state[check_name(n)])
    return h.hexdigest()


def state_hashes(state: Mapping[str, np.ndarray], group: Callable[[str], str]) -> tuple[str, dict[str, str]]:
    """The :func:`state_hash` of ``state`` and, in the same pass over its tensors, of each part
    ``{n: state[n] for n in state if group(n) == g}``: ``(whole, {g: hash})``. Each tensor's
    bytes are read once and hashed twice (the whole and its part)."""
    whole, parts = new_hasher(), {}
    for n in sorted(state):
        a, g = state[check_name(n)], group(n)
        h = parts.get(g)
        if h is None:
            h = parts[g] = new_hasher()
        feed(whole, n, a)
        feed(h, n, a)
    return whole.hexdigest(), {g: h.hexdigest() for g, h in parts.items()}


def raw_bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as flat unsigned integers of the same width (a view when possible)."""
    return np.ascontiguousarray(a).reshape(-1).view(UINT[a.dtype.itemsize])


def layout_of(state: Mapping[str, np.ndarray]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor of ``state`` (what
    :func:`stoa.transport.pulse_apply.apply_delta_share` needs)."""
    return {n: (a.dtype, tuple(a.shape)) for n, a in state.items()}
