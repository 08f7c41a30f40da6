"""safetensors files: the one reader and the one writer of the tensor files Stoa makes.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (padded
with spaces so the data starts 8-byte aligned), then the data: raw little-endian arrays back to
back. The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [start, end)}``
(offsets into the data) and may hold a ``"__metadata__"`` object. Three kinds of file use it:

* PULSE anchors (:func:`stoa.transport.pulse.encode_state`): built in memory by :func:`encode`;
* held states (:mod:`stoa.fleet.trainer.heldstates`): streamed, hashed and renamed by :func:`write`,
  read memory-mapped by :func:`read`;
* random-weight presets (:mod:`stoa.models.presets`): streamed tensor by tensor by :func:`write`.

Every dtype any of them may carry is in :data:`DTYPES`, the only table of safetensors dtype
names. :func:`read` treats every byte as untrusted: the header's length, every shape and offset
are checked against the buffer before an array is made, and any inconsistency raises
:class:`TensorFileError`. Only numpy (and ml_dtypes for bfloat16) is used.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["DTYPES", "TensorFile", "TensorFileError", "check_name", "code", "encode", "header", "header_length",
           "index", "read", "write"]

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "U32": np.dtype("<u4"), "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"), "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8"),
}
"""safetensors dtype name -> numpy dtype (little-endian)."""
_CODE = {dt: name for name, dt in DTYPES.items()}
MAX_HEADER = 64 << 20
"""Largest JSON header :func:`read` accepts (bytes)."""
MAX_TENSORS = 1 << 20
"""Most tensors :func:`read` accepts in one file."""
_MAX_NAME = 1024
_MAX_DIMS = 8

Spec = tuple[str, np.dtype, Sequence[int]]
"""``(name, dtype, shape)`` of one tensor, in file order."""


class TensorFileError(ValueError):
    """A tensor file (or a state to write as one) is malformed; the message names what."""


def code(dtype: Any) -> str:
    """The safetensors name of ``dtype`` (one of :data:`DTYPES`; byte order must be little-endian or native)."""
    name = _CODE.get(np.dtype(dtype))
    if name is None:
        raise TensorFileError(f"unsupported dtype {np.dtype(dtype)} (supported: {', '.join(DTYPES)})")
    return name


def check_name(name: object) -> str:
    """``name`` if it can name a tensor: a non-empty string of at most 1024 characters without NUL."""
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME or "\x00" in name:
        raise TensorFileError(f"invalid tensor name {name!r}")
    return name


def header(specs: Iterable[Spec], metadata: Mapping[str, str] | None = None) -> tuple[bytes, int]:
    """The file's first bytes (length and padded JSON) for tensors laid out back to back in the
    order given, and the size of the data section that must follow."""
    table: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata is not None else {}
    offset = 0
    for name, dtype, shape in specs:
        size = math.prod(int(s) for s in shape) * np.dtype(dtype).itemsize
        table[check_name(name)] = {"dtype": code(dtype), "shape": [int(s) for s in shape],
                                   "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def encode(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """The whole file in memory, tensors in the mapping's order."""
    head, _ = header(((n, a.dtype, a.shape) for n, a in arrays.items()), metadata)
    return b"".join([head, *(_bytes_of(a) for a in arrays.values())])


def write(path: str | Path, specs: Sequence[Spec], chunks: Iterable[Iterable[Any]],
          metadata: Mapping[str, str] | None = None, digest: Any = None) -> int:
    """Write a file tensor by tensor: ``chunks`` yields, for each spec in order, that tensor's
    bytes in pieces (numpy arrays, or anything with the buffer protocol), so nothing is held whole. Written to
    ``<path>.tmp``, fsynced and renamed, so a crash never leaves a truncated file under ``path``.
    ``digest`` (a hashlib object), when given, is fed every byte written. Returns the file size."""
    path = Path(path)
    head, data = header(specs, metadata)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        if digest is not None:
            digest.update(head)
        for (name, dtype, shape), parts in zip(specs, chunks, strict=True):
            expected, written = math.prod(int(s) for s in shape) * np.dtype(dtype).itemsize, 0
            for piece in parts:
                if isinstance(piece, np.ndarray):
                    piece = _bytes_of(piece)
                f.write(piece)
                if digest is not None:
                    digest.update(piece)
                written += memoryview(piece).nbytes
            if written != expected:
                raise TensorFileError(f"{name}: wrote {written} bytes, expected {expected}")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(head) + data


@dataclass(frozen=True)
class TensorFile:
    """What :func:`read` found: the arrays (views of the buffer), the metadata, and where the data starts."""

    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]
    data_start: int


def read(buf: Any, max_header: int = MAX_HEADER, max_tensors: int = MAX_TENSORS) -> TensorFile:
    """The tensors of a file held in ``buf`` (bytes, bytearray, mmap: anything with the buffer
    protocol), as arrays that share its memory (writeable when ``buf`` is).

    Every tensor must have exactly ``dtype``, ``shape`` and ``data_offsets``, a dtype of
    :data:`DTYPES`, at most 8 dimensions, and an offset span that fits its shape; the spans must
    tile the data section exactly (no gap, no overlap, no byte unclaimed).

    Raises:
        TensorFileError: anything else.
    """
    size = memoryview(buf).nbytes
    spans, meta, base = _index(buf, size, size, max_header, max_tensors)
    tensors = {name: np.frombuffer(buf, dt, math.prod(shape), base + a).reshape(shape)
               for a, _, name, dt, shape in spans}
    return TensorFile(tensors, meta, base)


def header_length(first8: bytes) -> int:
    """The JSON header's length from a file's first 8 bytes (read ``8 + header_length`` bytes to
    have the whole header, then :func:`index` it)."""
    if len(first8) < 8:
        raise TensorFileError("not a tensor file (shorter than its 8-byte header length)")
    return struct.unpack_from("<Q", first8)[0]


def index(head: bytes, size: int, max_header: int = MAX_HEADER,
          max_tensors: int = MAX_TENSORS) -> dict[str, tuple[np.dtype, tuple[int, ...], int, int]]:
    """name -> (dtype, shape, start, end) with absolute byte offsets into the file, from its first
    ``8 + header_length`` bytes ``head`` and its total ``size``: what to range-read for any one
    tensor. Checked as :func:`read` checks a whole file."""
    spans, _, base = _index(head, len(head), size, max_header, max_tensors)
    return {name: (dt, shape, base + a, base + b) for a, b, name, dt, shape in spans}


def _index(buf: Any, have: int, size: int, max_header: int, max_tensors: int
           ) -> tuple[list[tuple[int, int, str, np.dtype, tuple[int, ...]]], dict[str, Any], int]:
    """The header of a file of ``size`` bytes whose first ``have`` bytes are ``buf``: the tensors'
    spans in data order, the metadata, and where the data starts."""
    if have < 8:
        raise TensorFileError("not a tensor file (shorter than its 8-byte header length)")
    (hlen,) = struct.unpack_from("<Q", buf)
    if hlen > min(size - 8, max_header) or 8 + hlen > have:
        raise TensorFileError(f"header length {hlen} exceeds the file or the {max_header}-byte limit")
    try:
        table = json.loads(bytes(buf[8:8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise TensorFileError(f"header is not valid JSON: {e}") from None
    if not isinstance(table, dict) or len(table) > max_tensors + 1:
        raise TensorFileError(f"header must be a JSON object of at most {max_tensors} tensors")
    meta = table.pop("__metadata__", {})
    if not isinstance(meta, dict):
        raise TensorFileError("__metadata__ must be an object")
    base, total = 8 + hlen, size - 8 - hlen
    ints = lambda x: isinstance(x, list) and all(type(v) is int and v >= 0 for v in x)  # noqa: E731
    spans = []
    for name, info in table.items():
        check_name(name)
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise TensorFileError(f"{name!r}: entry must have exactly dtype, shape and data_offsets")
        dt, shape, offs = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None, \
            info["shape"], info["data_offsets"]
        if dt is None:
            raise TensorFileError(f"{name!r}: unsupported dtype {info['dtype']!r}")
        if not ints(shape) or len(shape) > _MAX_DIMS or not ints(offs) or len(offs) != 2:
            raise TensorFileError(f"{name!r}: bad shape {shape!r} or data_offsets {offs!r}")
        if offs[1] - offs[0] != math.prod(shape) * dt.itemsize or offs[1] > total:
            raise TensorFileError(f"{name!r}: data_offsets {offs} do not fit shape {shape} of {info['dtype']} "
                                  f"in {total} data bytes")
        spans.append((offs[0], offs[1], name, dt, tuple(shape)))
    spans.sort()
    end = 0
    for a, b, name, _, _ in spans:
        if a != end:
            raise TensorFileError(f"{name!r}: data at {a} leaves a gap or overlaps (expected {end})")
        end = b
    if end != total:
        raise TensorFileError(f"{total - end} bytes of data no tensor claims")
    return spans, meta, base
