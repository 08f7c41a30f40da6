"""PULSE: exact sparse deltas between weight states, full-state anchors, and state hashes.

Pure functions, no I/O. A *state* is a flat ``dict[str, numpy.ndarray]`` (see
``docs/architecture.md``, "Weight state"): uint8 int8-codes, their scales and biases, and
unquantized tensors, in any of the dtypes in ``DTYPES``. Every array is compared and rebuilt as
raw bits, so a delta reproduces ``new_state`` byte for byte (NaN payloads and -0.0 included).

Delta format (``encode_delta``), all integers little-endian::

    b"PLSD" | u8 version | 3 zero bytes | u32 crc32 of everything after this field
    | 32-byte layout fingerprint (sha256 of the sorted names, dtypes, shapes)
    | varint number of entries | entries, by increasing tensor index (varints are LEB128)

    entry    = varint tensor index (in sorted-name order) | u8 kind | mask | values
    mask     = which elements changed, a bitmask coded by ``_put_mask``: nothing / everything /
               raw bits / Golomb-coded gaps between set bits / between clear bits, whichever
               is smallest. Gap codes keep the unary quotients and the truncated-binary
               remainders in separate bit streams, so both sides are vectorized numpy.
    values   = kind 1 (1-byte dtypes, i.e. int8 codes): the wrapped difference d = new - old,
               as a sign bitmask, then for the negative and the positive d in turn a bitmask
               of |d| > 1 and, among those, of |d| > 2; then |d| - 3 of the rest (zstd);
               kind 2 (wider dtypes): the wrapped integer difference of the bit patterns,
               zigzag-mapped, split into byte planes and zstd-compressed.

A change mask with k of n elements set costs about n * H(k/n) + 0.03 * k bits for scattered
changes (within ~1% of its entropy); code differences of +-1 cost ~1 bit for the sign plus the
entropy of the (rare) larger ones. ``docs/pulse.md`` has the measurements.

Anchor format (``encode_state``): a valid safetensors file (8-byte header length, JSON header,
data), with ``__metadata__`` holding ``format`` and a crc32 of the data. Decoders treat every
byte as untrusted: sizes are checked against the previous state or the blob before anything is
allocated, and any inconsistency raises :class:`PulseError`.
"""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import zstandard

from stoa.transport import tensorfile

__all__ = [
    "DTYPES",
    "PulseError",
    "apply_delta",
    "apply_delta_inplace",
    "ShareMismatch",
    "apply_delta_share",
    "apply_deltas_inplace",
    "apply_deltas_share_verified",
    "apply_deltas_verified",
    "decode_state",
    "encode_delta",
    "encode_state",
    "layout_of",
    "state_hash",
    "state_hashes",
]

DTYPES = tensorfile.DTYPES
"""Accepted dtypes by their safetensors names (little-endian): :data:`stoa.transport.tensorfile.DTYPES`."""
_UINT = {1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

_MAGIC, _VERSION = b"PLSD", 1
_ANCHOR_FORMAT = "stoa.pulse.state/1"
_ZSTD_LEVEL = 3
_NONE, _ALL, _RAW, _GAPS1, _GAPS0 = range(5)
_BYTES, _WIDE = 1, 2


class PulseError(ValueError):
    """A PULSE blob is malformed, corrupted, or does not fit the state it is applied to."""


class ShareMismatch(PulseError):
    """:func:`apply_deltas_share_verified` refused: a blob does not decode, or a part of the share
    does not reach its expected hash. ``step`` is 0 for the share passed in (the base), ``i`` for
    the state after the ``i``-th blob; ``group`` names the part (None for a blob that does not decode)."""

    def __init__(self, message: str, step: int, group: str | None):
        super().__init__(message)
        self.step, self.group = step, group


# --- states --------------------------------------------------------------------------------------

def _code(name: str, a: np.ndarray) -> str:
    if not isinstance(a, np.ndarray):
        raise PulseError(f"{name!r}: expected a numpy array, got {type(a).__name__}")
    try:
        return tensorfile.code(a.dtype)
    except tensorfile.TensorFileError as e:
        raise PulseError(f"{name!r}: {e}") from None


def _check_name(name: object) -> str:
    try:
        return tensorfile.check_name(name)
    except tensorfile.TensorFileError as e:
        raise PulseError(str(e)) from None


def _layout(state: Mapping[str, np.ndarray]) -> tuple[list[str], bytes]:
    """Sorted names and the sha256 fingerprint of (name, dtype, shape) for each."""
    names = sorted(state)
    h = hashlib.sha256(b"stoa.pulse.layout/1")
    for n in names:
        _check_name(n)
        a = state[n]
        h.update(_describe(n, _code(n, a), a.shape))
    return names, h.digest()


def _describe(name: str, code: str, shape: tuple[int, ...]) -> bytes:
    nb = name.encode()
    return struct.pack(f"<I{len(nb)}sB{len(code)}sI{len(shape)}Q", len(nb), nb, len(code),
                       code.encode(), len(shape), *shape)


def _feed(h, name: str, a: np.ndarray) -> None:
    h.update(_describe(name, _code(name, a), a.shape))
    h.update(struct.pack("<Q", a.nbytes))
    h.update(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))


def _hasher():
    return hashlib.sha256(b"stoa.pulse.state/1")


def state_hash(state: Mapping[str, np.ndarray]) -> str:
    """Hex sha256 naming a state: over sorted names, each with its dtype, shape and raw bytes."""
    h = _hasher()
    for n in sorted(state):
        _feed(h, n, state[_check_name(n)])
    return h.hexdigest()


def state_hashes(state: Mapping[str, np.ndarray], group: Callable[[str], str]) -> tuple[str, dict[str, str]]:
    """The :func:`state_hash` of ``state`` and, in the same pass over its tensors, of each part
    ``{n: state[n] for n in state if group(n) == g}``: ``(whole, {g: hash})``. Each tensor's
    bytes are read once and hashed twice (the whole and its part)."""
    whole, parts = _hasher(), {}
    for n in sorted(state):
        a, g = state[_check_name(n)], group(n)
        h = parts.get(g)
        if h is None:
            h = parts[g] = _hasher()
        _feed(whole, n, a)
        _feed(h, n, a)
    return whole.hexdigest(), {g: h.hexdigest() for g, h in parts.items()}


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as flat unsigned integers of the same width (a view when possible)."""
    return np.ascontiguousarray(a).reshape(-1).view(_UINT[a.dtype.itemsize])


# --- bounded byte reading / writing ----------------------------------------------------------------

class _Reader:
    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise PulseError(f"truncated blob: {what} needs {n} bytes at offset {self.pos}, "
                             f"{len(self.buf) - self.pos} left")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def uint(self, what: str) -> int:
        """An unsigned LEB128 varint below 2**64."""
        out = 0
        for shift in range(0, 70, 7):
            (byte,) = self.take(1, what)
            out |= (byte & 0x7F) << shift
            if byte < 0x80:
                if out >= 1 << 64:
                    break
                return out
        raise PulseError(f"{what}: malformed varint at offset {self.pos}")


def _uv(x: int) -> bytes:
    out = bytearray()
    while x >= 0x80:
        out.append((x & 0x7F) | 0x80)
        x >>= 7
    out.append(x)
    return bytes(out)


def _put_bytes(out: list[bytes], data: bytes) -> None:
    """A byte string, zstd-compressed when that is smaller: u8 codec | u64 stored length | data."""
    z = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(data) if len(data) > 64 else data
    codec, data = (1, z) if len(z) < len(data) else (0, data)
    out += [bytes([codec]) + _uv(len(data)), data]


def _get_bytes(r: _Reader, expected: int, what: str) -> bytes:
    (codec,) = r.unpack("<B", what)
    data = r.take(r.uint(what), what)
    if codec == 0:
        raw = bytes(data)
    elif codec == 1:
        try:
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=max(expected, 1))
        except zstandard.ZstdError as e:
            raise PulseError(f"corrupted {what}: {e}") from None
    else:
        raise PulseError(f"{what}: unknown codec {codec}")
    if len(raw) != expected:
        raise PulseError(f"{what}: {len(raw)} bytes where {expected} were expected")
    return raw


# --- fixed-width bit fields ------------------------------------------------------------------------

def _word(width: int) -> int:
    nb = (width + 7) // 8
    return 1 if nb == 1 else 2 if nb == 2 else 4 if nb <= 4 else 8


def _pack_fixed(v: np.ndarray, width: int) -> bytes:
    """Each value's low ``width`` bits, most significant first, concatenated."""
    if width == 0 or v.size == 0:
        return b""
    w = _word(width)
    bits = np.unpackbits(v.astype(f">u{w}").view(np.uint8).reshape(-1, w), axis=1)[:, 8 * w - width:]
    return np.packbits(bits.reshape(-1)).tobytes()


def _unpack_fixed(data: memoryview, count: int, width: int) -> np.ndarray:
    if width == 0 or count == 0:
        return np.zeros(count, np.int64)
    w = _word(width)
    padded = np.zeros((count, 8 * w), np.uint8)
    padded[:, 8 * w - width:] = np.unpackbits(np.frombuffer(data, np.uint8), count=count * width).reshape(count, width)
    return np.packbits(padded, axis=1).view(f">u{w}").reshape(-1).astype(np.int64)


# --- bitmasks --------------------------------------------------------------------------------------

def _golomb_bits(g: np.ndarray, m: int) -> int:
    if m == 1:
        return int(g.sum()) + g.size
    b = (m - 1).bit_length()
    u = (1 << b) - m
    return int((g // m).sum()) + g.size * b + int(np.count_nonzero(g % m >= u))


def _best_m(g: np.ndarray) -> int:
    mean = float(g.mean())
    if mean < 0.5:
        return 1
    p = 1.0 / (mean + 1.0)
    m0 = max(1, math.ceil(math.log(2.0 - p) / -math.log1p(-p)))  # optimal for geometric gaps
    cands = sorted({max(1, round(m0 * f)) for f in (0.5, 0.7, 0.85, 1.0, 1.2, 1.4, 2.0)} | {1})
    sample = g[:: max(1, g.size >> 20)]  # a million gaps choose M as well as all of them
    return min(cands, key=lambda m: _golomb_bits(sample, m))


def _gap_sections(pos: np.ndarray) -> tuple[int, bytes, bytes, bytes]:
    """Golomb code of the gaps before each of the sorted positions ``pos``: (M, unary, A, B)."""
    g = np.diff(pos.astype(np.int64), prepend=np.int64(-1)) - 1
    m = _best_m(g)
    q = g // m
    ends = np.cumsum(q + 1) - 1  # each quotient q is q zero bits closed by a one bit
    unary = np.zeros(int(ends[-1]) + 1, np.bool_)
    unary[ends] = True
    if m == 1:
        return m, np.packbits(unary).tobytes(), b"", b""
    b = (m - 1).bit_length()
    u = (1 << b) - m
    r = g - q * m
    ext = r >= u
    c = np.where(ext, r + u, r)
    a = np.where(ext, c >> 1, c)
    return m, np.packbits(unary).tobytes(), _pack_fixed(a, b - 1), np.packbits((c[ext] & 1).astype(np.bool_)).tobytes()


def _put_mask(out: list[bytes], mask: np.ndarray) -> None:
    n, k = mask.size, int(np.count_nonzero(mask))
    if k == 0 or k == n:
        out.append(struct.pack("<B", _NONE if k == 0 else _ALL))
        return
    best = (_RAW, [np.packbits(mask).tobytes()])
    ones = k <= n - k
    pos = np.flatnonzero(mask if ones else ~mask)
    m, unary, a, b = _gap_sections(pos)
    if len(unary) + len(a) + len(b) + 12 < len(best[1][0]):
        best = (_GAPS1 if ones else _GAPS0, [_uv(pos.size) + _uv(m) + _uv(len(unary)) + _uv(len(b)), unary, a, b])
    out.append(struct.pack("<B", best[0]))
    out += best[1]


def _get_mask(r: _Reader, n: int, what: str) -> np.ndarray:
    """A bitmask of ``n`` elements: a bool array, or sorted int64 positions for sparse masks."""
    (method,) = r.unpack("<B", what)
    if method == _NONE:
        return np.zeros(0, np.int64)
    if method == _ALL:
        return np.ones(n, np.bool_)
    if method == _RAW:
        data = r.take((n + 7) // 8, what)
        return np.unpackbits(np.frombuffer(data, np.uint8), count=n).view(np.bool_)
    if method not in (_GAPS1, _GAPS0):
        raise PulseError(f"{what}: unknown mask method {method}")
    k, m, n_unary, n_b = (r.uint(what) for _ in range(4))
    if not 0 < k <= n or not 1 <= m <= n + 1:
        raise PulseError(f"{what}: {k} set of {n} with Golomb parameter {m} is impossible")
    unary = np.unpackbits(np.frombuffer(r.take(n_unary, what + " quotients"), np.uint8))
    ends = np.flatnonzero(unary)
    if ends.size != k:
        raise PulseError(f"{what}: {ends.size} gap codes where {k} were announced")
    q = np.diff(ends, prepend=np.int64(-1)) - 1
    if m == 1:
        g = q
        if n_b:
            raise PulseError(f"{what}: unexpected remainder bits")
    else:
        b = (m - 1).bit_length()
        u = (1 << b) - m
        x = _unpack_fixed(r.take((k * (b - 1) + 7) // 8, what + " remainders"), k, b - 1)
        ext = x >= u
        n_ext = int(np.count_nonzero(ext))
        if n_b != (n_ext + 7) // 8:
            raise PulseError(f"{what}: remainder stream has {n_b} bytes, expected {(n_ext + 7) // 8}")
        lsb = np.unpackbits(np.frombuffer(r.take(n_b, what + " remainders"), np.uint8), count=n_ext)
        x[ext] = 2 * x[ext] + lsb - u
        g = q * m + x
    pos = np.cumsum(g + 1) - 1
    if pos[-1] >= n:
        raise PulseError(f"{what}: position {int(pos[-1])} is past the end ({n})")
    if method == _GAPS1:
        return pos
    mask = np.ones(n, np.bool_)
    mask[pos] = False
    return mask


def _put_mags(out: list[bytes], mag: np.ndarray) -> np.ndarray:
    """Code magnitudes >= 1 as two escape masks (> 1, then > 2); returns mag - 3 of the rest."""
    gt1 = mag > 1
    _put_mask(out, gt1)
    m = mag[gt1]
    _put_mask(out, m > 2)
    return m[m > 2] - 3


def _get_mags(r: _Reader, n: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``_put_mags``: magnitudes (values >= 3 still at 3) and where those are."""
    mag = np.ones(n, np.int16)
    gt1 = np.flatnonzero(_as_bool(_get_mask(r, n, what), n))
    gt2 = _as_bool(_get_mask(r, gt1.size, what), gt1.size)
    mag[gt1] = 2 + gt2
    return mag, gt1[gt2]


def _as_bool(sel: np.ndarray, n: int) -> np.ndarray:
    if sel.dtype == np.bool_:
        return sel
    mask = np.zeros(n, np.bool_)
    mask[sel] = True
    return mask


def _count(sel: np.ndarray) -> int:
    return int(np.count_nonzero(sel)) if sel.dtype == np.bool_ else sel.size


# --- deltas ----------------------------------------------------------------------------------------

def _zigzag(d: np.ndarray) -> np.ndarray:
    s = d.view(np.dtype(f"<i{d.dtype.itemsize}"))
    return ((s << 1) ^ (s >> (8 * d.dtype.itemsize - 1))).view(d.dtype)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (np.zeros_like(z) - (z & one))


def encode_delta(prev_state: Mapping[str, np.ndarray], new_state: Mapping[str, np.ndarray]) -> bytes:
    """The PULSE delta that turns ``prev_state`` into ``new_state`` exactly.

    Both states must have the same names, and each name the same dtype and shape; otherwise
    :class:`PulseError` (publish an anchor instead).
    """
    names, fp = _layout(prev_state)
    if set(new_state) != set(names) or _layout(new_state)[1] != fp:
        diff = sorted(set(names) ^ set(new_state))[:5]
        raise PulseError("states differ in names, dtypes or shapes; a delta needs the same layout"
                         + (f" (e.g. {diff})" if diff else ""))
    out: list[bytes] = []
    n_entries = 0
    for i, name in enumerate(names):
        old, new = _bits(prev_state[name]), _bits(new_state[name])
        mask = old != new
        if not mask.any():
            continue
        n_entries += 1
        kind = _BYTES if old.itemsize == 1 else _WIDE
        out.append(_uv(i) + bytes([kind]))
        _put_mask(out, mask)
        d = new[mask] - old[mask]  # wraps: exact in the unsigned ring
        if kind == _BYTES:
            s = d.view(np.int8)
            mag, neg = np.abs(s.astype(np.int16)), s < 0
            _put_mask(out, neg)
            rest = [_put_mags(out, mag[neg]), _put_mags(out, mag[~neg])]
            _put_bytes(out, np.concatenate(rest).astype(np.uint8).tobytes())
        else:
            z = _zigzag(d)
            _put_bytes(out, np.ascontiguousarray(z.view(np.uint8).reshape(-1, d.itemsize).T).tobytes())
    body = b"".join([fp, _uv(n_entries)] + out)
    return _MAGIC + struct.pack("<B3xI", _VERSION, zlib.crc32(body)) + body


def _decode_delta(state: Mapping[str, np.ndarray], blob: bytes) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Validate ``blob`` against ``state`` and decode it to (name, selector, wrapped diffs)."""
    buf = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob.cast("B")
    if len(buf) < 4 + 8 + 32 + 1 or bytes(buf[:4]) != _MAGIC:
        raise PulseError("not a PULSE delta (bad magic or too short)")
    version, crc = struct.unpack_from("<B3xI", buf, 4)
    if version != _VERSION:
        raise PulseError(f"unsupported PULSE delta version {version}")
    if zlib.crc32(buf[12:]) != crc:
        raise PulseError("PULSE delta is corrupted (crc32 mismatch)")
    names, fp = _layout(state)
    r = _Reader(buf, 12)
    if bytes(r.take(32, "fingerprint")) != fp:
        raise PulseError("delta was made for a state with different names, dtypes or shapes")
    n_entries = r.uint("entry count")
    if n_entries > len(names):
        raise PulseError(f"{n_entries} entries for a state of {len(names)} tensors")
    decoded, last = [], -1
    for _ in range(n_entries):
        i = r.uint("entry header")
        (kind,) = r.unpack("<B", "entry header")
        if not last < i < len(names):
            raise PulseError(f"entry for tensor index {i} out of order or out of range")
        last, name = i, names[i]
        a = state[name]
        n, width = a.size, a.dtype.itemsize
        if kind != (_BYTES if width == 1 else _WIDE):
            raise PulseError(f"{name!r}: entry kind {kind} does not fit dtype {a.dtype}")
        sel = _get_mask(r, n, f"{name!r} change mask")
        k = _count(sel)
        if k == 0:
            raise PulseError(f"{name!r}: entry without changes")
        if kind == _BYTES:
            neg = _as_bool(_get_mask(r, k, f"{name!r} signs"), k)
            k_neg = int(np.count_nonzero(neg))
            mag_neg, big_neg = _get_mags(r, k_neg, f"{name!r} magnitudes")
            mag_pos, big_pos = _get_mags(r, k - k_neg, f"{name!r} magnitudes")
            extra = np.frombuffer(_get_bytes(r, big_neg.size + big_pos.size, f"{name!r} large differences"), np.uint8)
            mag_neg[big_neg] += extra[:big_neg.size]
            mag_pos[big_pos] += extra[big_neg.size:]
            mag = np.empty(k, np.int16)
            mag[neg], mag[~neg] = mag_neg, mag_pos
            d = np.where(neg, -mag, mag).astype(np.uint8)
        else:
            raw = _get_bytes(r, k * width, f"{name!r} values")
            planes = np.frombuffer(raw, np.uint8).reshape(width, k)
            d = _unzigzag(np.ascontiguousarray(planes.T).reshape(-1).view(_UINT[width]))
        decoded.append((name, sel, d))
    if r.pos != len(buf):
        raise PulseError(f"{len(buf) - r.pos} unexpected trailing bytes after the last entry")
    return decoded


def apply_delta_inplace(state: dict[str, np.ndarray], blob: bytes) -> list[str]:
    """Apply a delta by writing into ``state``'s arrays; returns the names that changed, sorted.

    The whole blob is decoded and validated before the first write, so a bad blob leaves
    ``state`` untouched. Changed arrays must be C-contiguous and writeable (a live MLX engine
    shares these buffers with its model).
    """
    return apply_deltas_inplace(state, [blob])


def apply_deltas_inplace(state: dict[str, np.ndarray], blobs: Sequence[bytes]) -> list[str]:
    """Apply ``blobs`` in order by writing into ``state``'s arrays, without checking the result;
    returns the names that changed, sorted.

    Every blob is decoded and validated before the first write, so a bad blob leaves ``state``
    untouched. The result is not hashed: the caller checks it (``WeightSubscriber`` does so in the
    background with ``check="background"``), or uses :func:`apply_deltas_verified`.
    """
    decoded, changes = _decode_for_write(state, blobs)
    for entries in decoded:
        _write(state, entries)
    return sorted(changes)


def _decode_for_write(state: Mapping[str, np.ndarray], blobs: Sequence[bytes]
                      ) -> tuple[list[list[tuple[str, np.ndarray, np.ndarray]]], dict[str, list[tuple[np.ndarray, np.ndarray]]]]:
    """Decode every blob against ``state`` and check that each array it changes can be written in
    place: (the decoded blobs in order, name -> its (selector, diffs) in order). Writes nothing."""
    decoded = [_decode_delta(state, blob) for blob in blobs]
    changes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for entries in decoded:
        for name, sel, d in entries:
            changes.setdefault(name, []).append((sel, d))
    for name in changes:
        a = state[name]
        if not (a.flags.c_contiguous and a.flags.writeable):
            raise PulseError(f"{name!r}: in-place apply needs a C-contiguous, writeable array")
    return decoded, changes


def apply_deltas_verified(state: dict[str, np.ndarray], blobs: Sequence[bytes], expect_hash: str) -> list[str]:
    """Apply ``blobs`` in order by writing into ``state``'s arrays, only if the result's
    :func:`state_hash` is ``expect_hash``; returns the names that changed, sorted.

    Every blob is decoded and the result's hash computed (one changed tensor copied at a time)
    before the first write, so on a bad blob or a hash mismatch (:class:`PulseError`) ``state``
    is untouched. Extra memory: the decoded deltas plus a copy of the largest changed tensor.
    """
    decoded, changes = _decode_for_write(state, blobs)

    class _After(Mapping):  # the state the deltas lead to, built one tensor at a time
        def __getitem__(self, name: str) -> np.ndarray:
            if name not in changes:
                return state[name]
            new = np.array(state[name], copy=True, order="C")
            for sel, d in changes[name]:
                _write({name: new}, [(name, sel, d)])
            return new

        def __iter__(self):
            return iter(state)

        def __len__(self) -> int:
            return len(state)

    got = state_hash(_After())
    if got != expect_hash:
        raise PulseError(f"the deltas lead to state {got[:12]}..., not the expected {expect_hash[:12]}...; "
                         "nothing was written")
    for entries in decoded:
        _write(state, entries)
    return sorted(changes)


def _write(state: Mapping[str, np.ndarray], decoded: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
    for name, sel, d in decoded:
        flat = state[name].reshape(-1).view(_UINT[d.itemsize])
        flat[sel] += d  # wrapping add in the unsigned ring undoes the encoder's subtraction


class _Shape(Mapping):
    """A whole state's layout with only ``share``'s arrays present: the others are zero-byte
    read-only stand-ins of the right dtype and shape (enough to decode a delta against)."""

    def __init__(self, share: Mapping[str, np.ndarray], layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]]):
        self.share, self.layout = share, layout

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.share:
            return self.share[name]
        dt, shape = self.layout[name]
        return np.broadcast_to(np.zeros((), dt), shape)

    def __iter__(self):
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)


def _check_share(share: Mapping[str, np.ndarray], layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> None:
    if set(share) - set(layout):
        raise PulseError(f"share holds tensors the layout lacks: {sorted(set(share) - set(layout))[:5]}")
    for n, a in share.items():
        if (a.dtype, tuple(a.shape)) != (np.dtype(layout[n][0]), tuple(layout[n][1])):
            raise PulseError(f"{n!r}: the share's array does not fit the layout")


def _writeable(share: Mapping[str, np.ndarray], names: Iterable[str]) -> None:
    for n in names:
        if not (share[n].flags.c_contiguous and share[n].flags.writeable):
            raise PulseError(f"{n!r}: in-place apply needs a C-contiguous, writeable array")


def apply_delta_share(share: dict[str, np.ndarray], layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
                      blob: bytes, expect_hash: str | None = None) -> list[str]:
    """Apply a whole-state delta to ``share``, a part of the state (a pipeline stage's tensors),
    by writing into its arrays; returns the names of ``share`` that changed, sorted.

    ``layout``: name -> (dtype, shape) of *every* tensor of the whole state (the delta's
    fingerprint covers them all; a stage knows them from the model's config without holding
    them). The whole blob is decoded and checked (crc32, fingerprint, every entry) before the
    first write; entries for tensors outside the share are skipped. Given ``expect_hash`` (the
    :func:`state_hash` the share must reach), nothing is written unless the result has it.
    """
    _check_share(share, layout)
    mine = [(n, sel, d) for n, sel, d in _decode_delta(_Shape(share, layout), blob) if n in share]
    _writeable(share, (n for n, _, _ in mine))
    if expect_hash is not None:
        after = dict(share)
        for n, sel, d in mine:
            after[n] = np.array(share[n], copy=True, order="C")
            _write(after, [(n, sel, d)])
        got = state_hash(after)
        if got != expect_hash:
            raise PulseError(f"the delta leads the share to {got[:12]}..., not the expected {expect_hash[:12]}...; "
                             "nothing was written")
    _write(share, mine)
    return sorted(n for n, _, _ in mine)


def apply_deltas_share_verified(share: dict[str, np.ndarray], layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
                                blobs: Sequence[bytes], expect: Sequence[Mapping[str, str]],
                                group: Callable[[str], str], base_known: bool = False) -> list[str]:
    """Apply whole-state deltas ``blobs`` in order to ``share`` (as :func:`apply_delta_share`),
    only if every part of the share reaches its expected hash at every step; returns the names
    of ``share`` that changed, sorted.

    The share is split into parts by ``group`` (name -> part); ``expect[0]`` gives each part's
    :func:`state_hash` in ``share`` as passed in, ``expect[i]`` after the ``i``-th blob. A part
    is hashed at each step where a blob changed it; where none did, its expected hash must equal
    the step before. With ``base_known`` the share passed in is known to match ``expect[0]``
    (just verified); otherwise its parts that no blob changes are hashed as they are, and the
    changed ones through their first hash after a change. Every blob is decoded before anything
    is hashed, and nothing is written unless every check passes (:class:`ShareMismatch` says
    which step and part failed). Extra memory: the decoded deltas plus one tensor's copy.
    """
    if len(expect) != len(blobs) + 1:
        raise ValueError(f"expect needs {len(blobs) + 1} entries (the base and one per blob), got {len(expect)}")
    _check_share(share, layout)
    shape = _Shape(share, layout)
    changes: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    decoded = []
    for i, blob in enumerate(blobs, 1):
        try:
            mine = [(n, sel, d) for n, sel, d in _decode_delta(shape, blob) if n in share]
        except PulseError as e:
            raise ShareMismatch(f"blob {i}: {e}", i, None) from None
        decoded.append(mine)
        for n, sel, d in mine:
            changes.setdefault(n, []).append((i, sel, d))
    _writeable(share, changes)
    parts: dict[str, list[str]] = {}
    for n in sorted(share):
        parts.setdefault(group(n), []).append(n)
    for g, names in sorted(parts.items()):
        steps = sorted({i for n in names for i, _, _ in changes.get(n, ())})
        hashed = steps if base_known or steps else [0]
        hashers = {i: _hasher() for i in hashed}
        for n in names:
            cur, mine = share[n], changes.get(n, [])
            if 0 in hashers:
                _feed(hashers[0], n, cur)
            if mine:
                cur = np.array(cur, copy=True, order="C")
            for i in steps:
                for j, sel, d in mine:
                    if j == i:
                        _write({n: cur}, [(n, sel, d)])
                _feed(hashers[i], n, cur)
        got: str | None = None
        for i in range(len(blobs) + 1):
            want = expect[i].get(g)
            if want is None:
                raise ShareMismatch(f"no expected hash for part {g!r} at step {i}", i, g)
            if i in hashers:
                got = hashers[i].hexdigest()
            elif got is None:  # the base, known to match
                got = want
            if got != want:
                at = "as passed in" if i == 0 else f"after blob {i}"
                raise ShareMismatch(f"part {g!r} {at} hashes to {got[:12]}..., not the expected {want[:12]}...; "
                                    "nothing was written", i, g)
    for mine in decoded:
        _write(share, mine)
    return sorted(changes)


def layout_of(state: Mapping[str, np.ndarray]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor of ``state`` (what :func:`apply_delta_share` needs)."""
    return {n: (a.dtype, tuple(a.shape)) for n, a in state.items()}


def apply_delta(prev_state: Mapping[str, np.ndarray], blob: bytes) -> dict[str, np.ndarray]:
    """The state ``blob`` turns ``prev_state`` into, as fresh arrays; ``prev_state`` is not modified."""
    decoded = _decode_delta(prev_state, blob)
    new = {k: np.array(v, copy=True, order="C") for k, v in prev_state.items()}
    _write(new, decoded)
    return new


# --- anchors ---------------------------------------------------------------------------------------

def encode_state(state: Mapping[str, np.ndarray]) -> bytes:
    """A full state as a safetensors file (loadable by safetensors, ``mlx.core.load``, ...)."""
    names = sorted(state, key=lambda n: (-state[n].dtype.itemsize, n))  # keeps every tensor aligned
    crc = 0
    for n in names:
        _code(_check_name(n), state[n])
        crc = zlib.crc32(memoryview(np.ascontiguousarray(state[n]).reshape(-1).view(np.uint8)), crc)
    return tensorfile.encode({n: state[n] for n in names}, {"format": _ANCHOR_FORMAT, "crc32": str(crc)})


def decode_state(blob: bytes) -> dict[str, np.ndarray]:
    """The state in an anchor made by :func:`encode_state` (any valid safetensors file of
    supported dtypes is accepted; our crc32 is checked when present). Arrays are writeable."""
    buf = bytearray(blob)
    try:
        got = tensorfile.read(buf)
    except tensorfile.TensorFileError as e:
        raise PulseError(f"not a valid anchor: {e}") from None
    if "crc32" in got.metadata and str(zlib.crc32(memoryview(buf)[got.data_start:])) != got.metadata["crc32"]:
        raise PulseError("anchor is corrupted (crc32 mismatch)")
    return got.tensors
