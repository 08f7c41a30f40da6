"""The activation channel's frames: a JSON header and raw numpy arrays, over a byte stream.

A frame is::

    b"STF1" | u32 big-endian header length | header (UTF-8 JSON object) | array bytes

and the header is ``{"op": str, "meta": {...}, "arrays": [{"dtype": str, "shape": [int, ...]}, ...]}``:
the arrays' bytes follow the header in order, C order, little-endian, each exactly
``prod(shape) * itemsize`` bytes. A reader checks everything before it allocates: the magic, the
header's length (at most :data:`MAX_HEADER`), that it is a JSON object of exactly these fields, the
op's name, each dtype (one of :data:`DTYPES`), each shape (at most 4 non-negative dimensions), and
the arrays' total size against the caller's ``max_payload``. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import re
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["DTYPES", "MAGIC", "MAX_HEADER", "Frame", "FrameError", "read_frame", "write_frame", "encode"]

MAGIC = b"STF1"
MAX_HEADER = 64 << 10
"""Most bytes of a frame's JSON header."""
DTYPES = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}
"""The dtypes a frame may carry: activations and logits (float32), positions and rows (int64)."""
_OP = re.compile(r"[a-z_]{1,32}")
_MAX_DIMS = 4


class FrameError(ConnectionError):
    """A frame that breaks the format, or a stream that ended inside one: the connection is unusable."""


@dataclass(frozen=True)
class Frame:
    """One message: an ``op`` name, a small JSON ``meta`` object and numpy ``arrays``."""

    op: str
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: tuple[np.ndarray, ...] = ()


def encode(frame: Frame) -> bytes:
    """The frame's bytes (the arrays converted to their little-endian C-order form)."""
    if not _OP.fullmatch(frame.op):
        raise FrameError(f"bad op name {frame.op!r}")
    specs, parts = [], []
    for a in frame.arrays:
        name = next((n for n, d in DTYPES.items() if np.dtype(a.dtype) == d.newbyteorder("=") or a.dtype == d), None)
        if name is None or a.ndim > _MAX_DIMS:
            raise FrameError(f"a frame cannot carry a {a.dtype} array of {a.ndim} dimensions")
        specs.append({"dtype": name, "shape": [int(s) for s in a.shape]})
        parts.append(np.ascontiguousarray(a, dtype=DTYPES[name]).tobytes())
    head = json.dumps({"op": frame.op, "meta": frame.meta, "arrays": specs}, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER:
        raise FrameError(f"a frame header of {len(head)} bytes is over {MAX_HEADER}")
    return b"".join([MAGIC, struct.pack(">I", len(head)), head, *parts])


def write_frame(sock: socket.socket, frame: Frame) -> int:
    """Send ``frame``; returns its size in bytes."""
    data = encode(frame)
    sock.sendall(data)
    return len(data)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise FrameError(f"the stream ended {got} bytes into a {n}-byte read")
        got += k
    return bytes(buf)


def _spec(s: object) -> tuple[np.dtype, tuple[int, ...]]:
    if not (isinstance(s, dict) and set(s) == {"dtype", "shape"} and s["dtype"] in DTYPES
            and isinstance(s["shape"], list) and len(s["shape"]) <= _MAX_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in s["shape"])):
        raise FrameError(f"bad array spec {str(s)[:200]}")
    return DTYPES[s["dtype"]], tuple(s["shape"])


def parse_header(head: bytes) -> tuple[str, dict[str, Any], list[tuple[np.dtype, tuple[int, ...]]]]:
    """The op, meta and array specs of a header (raises :class:`FrameError` on anything else)."""
    try:
        h = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise FrameError(f"a frame header is not JSON: {e}") from None
    if not (isinstance(h, dict) and set(h) == {"op", "meta", "arrays"} and isinstance(h["op"], str)
            and _OP.fullmatch(h["op"]) and isinstance(h["meta"], dict) and isinstance(h["arrays"], list)
            and len(h["arrays"]) <= 8):
        raise FrameError(f"bad frame header {head[:200]!r}")
    return h["op"], h["meta"], [_spec(s) for s in h["arrays"]]


def read_frame(sock: socket.socket, max_payload: int) -> Frame:
    """The next frame from ``sock``; its arrays may hold at most ``max_payload`` bytes in all.

    Raises:
        FrameError: a broken frame, or the stream ended (the connection is then unusable).
        OSError: the socket failed (a timeout included).
    """
    pre = _exactly(sock, 8)
    if pre[:4] != MAGIC:
        raise FrameError(f"not a stage frame (magic {pre[:4]!r})")
    (n,) = struct.unpack(">I", pre[4:])
    if n > MAX_HEADER:
        raise FrameError(f"a frame header of {n} bytes is over {MAX_HEADER}")
    op, meta, specs = parse_header(_exactly(sock, n))
    sizes = [int(np.prod(shape, dtype=np.int64)) * dt.itemsize for dt, shape in specs]
    if sum(sizes) > max_payload:
        raise FrameError(f"a frame of {sum(sizes)} array bytes is over this end's limit of {max_payload}")
    arrays = tuple(np.frombuffer(_exactly(sock, size), dtype=dt).reshape(shape)
                   for size, (dt, shape) in zip(sizes, specs))
    return Frame(op, meta, arrays)


def meta_int(meta: dict[str, Any], key: str, lo: int, hi: int) -> int:
    """``meta[key]``, an int in ``[lo, hi]`` (raises :class:`FrameError` otherwise)."""
    v = meta.get(key)
    if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi):
        raise FrameError(f"{key} must be an integer in [{lo}, {hi}], not {str(v)[:50]}")
    return v


def meta_ints(meta: dict[str, Any], key: str, lo: int, hi: int, most: int) -> list[int]:
    """``meta[key]``, a list of at most ``most`` ints in ``[lo, hi]``."""
    v = meta.get(key)
    if not (isinstance(v, list) and len(v) <= most
            and all(isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in v)):
        raise FrameError(f"{key} must be a list of at most {most} integers in [{lo}, {hi}]")
    return v


def check_array(frames: Sequence[np.ndarray], i: int, dtype: str, shape: tuple[int | None, ...]) -> np.ndarray:
    """Array ``i`` of a frame, checked for ``dtype`` and ``shape`` (None: any size there)."""
    if i >= len(frames):
        raise FrameError(f"the frame has {len(frames)} arrays; array {i} is missing")
    a = frames[i]
    if a.dtype != DTYPES[dtype] or a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape)):
        raise FrameError(f"array {i} is {a.dtype} {a.shape}, not {dtype} {shape}")
    return a
