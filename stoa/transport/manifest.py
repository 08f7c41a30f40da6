"""The signed documents of the weight chain and where they live: typed, validated once.

Layout under a run (``<run>`` is any valid key prefix; :class:`Layout` builds and parses these)::

    <run>/current.json                                  signed pointer (:class:`Pointer`)
    <run>/weights/<version:012d>/manifest.json          signed manifest (:class:`Manifest`)
    <run>/weights/<version:012d>/anchor.safetensors     full state, if any (:class:`Payload`)
    <run>/weights/<version:012d>/delta.pulse            delta from the parent, if any

Both documents are :mod:`stoa.transport.signing` envelopes of kind ``"manifest"`` /
``"pointer"``. Their bodies are parsed exactly once, by :meth:`Manifest.parse` and
:meth:`Pointer.parse`, which refuse unknown or missing fields, values of the wrong type or range,
and contradictions (a delta without a parent, a parent not older than the version, an anchor at
a depth other than 0) with :class:`~stoa.transport.signing.SignatureError`: a validly signed
body is still checked, since a signature is no excuse for a crash. Code holding a ``Manifest`` or
``Pointer`` needs no further checks.

A manifest of format ``/3`` also carries :class:`Shares` (per-share state hashes and the anchor's
header hash, for pipeline stages); ``/2`` manifests, without them, are still read.

The pointer pins the sha256 of the head manifest's object and each manifest pins its parent's,
so the chain from a verified pointer down is hash-linked (see :mod:`stoa.transport.chain`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from stoa.transport import layout, shares, tensorfile
from stoa.transport.signing import SignatureError
from stoa.transport.store import validate_key

__all__ = ["MAX_MANIFEST_BYTES", "MAX_POINTER_BYTES", "MAX_VERSION", "Layout", "Manifest", "Payload", "Pointer",
           "Shares", "check_version"]

MANIFEST_FORMAT = "stoa.weights.manifest/3"
"""What the publisher writes with per-share hashes (:class:`Shares`)."""
MANIFEST_FORMAT_WHOLE = "stoa.weights.manifest/2"
"""The format without shares: still read, and written by a publisher with ``shares=False``."""
POINTER_FORMAT = "stoa.weights.pointer/1"
MAX_VERSION = 10**12 - 1
"""Versions lie in ``[0, MAX_VERSION]`` (twelve decimal digits in keys)."""
MAX_MANIFEST_BYTES = 1 << 20
"""Largest manifest object a reader accepts (bigger ones are refused unread)."""
MAX_POINTER_BYTES = 64 << 10
"""Largest pointer object a reader accepts."""
_ENTRY_RE = re.compile(r"(\d{12})/(manifest\.json|anchor\.safetensors|delta\.pulse)")


def check_version(v: Any, what: str = "version") -> int:
    """``v`` if it is a valid version number, else ``ValueError`` naming ``what``."""
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_VERSION:
        raise ValueError(f"{what} must be an int in [0, 10^12), got {v!r}")
    return v


def _int(v: Any, what: str, where: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise SignatureError(f"{where}: {what} must be an int in [{lo}, {hi}], got {str(v)[:40]!r}")
    return v


def _opt_version(v: Any, what: str, where: str) -> int | None:
    return None if v is None else _int(v, what, where, 0, MAX_VERSION)


def _sha_field(v: Any, what: str, where: str) -> str:
    if not isinstance(v, str) or not layout.HEX64.fullmatch(v):
        raise SignatureError(f"{where}: {what} must be 64 lowercase hex characters")
    return v


def _time(v: Any, where: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise SignatureError(f"{where}: created must be a finite number")
    return float(v)


def _exact_keys(body: dict, keys: frozenset[str], where: str) -> None:
    if set(body) != keys:
        odd = sorted(set(body) ^ keys)[:5]
        raise SignatureError(f"{where}: signed body has missing or unknown fields {odd}")


@dataclass(frozen=True)
class Payload:
    """One payload object of a version, as its manifest signs it."""

    bytes: int
    """Exact size of the object."""
    sha256: str
    """Hex sha256 of the object."""

    @classmethod
    def parse(cls, v: Any, what: str, where: str) -> Payload | None:
        """``None`` for a missing payload; raises :class:`SignatureError` if malformed."""
        if v is None:
            return None
        if not isinstance(v, dict) or set(v) != {"bytes", "sha256"}:
            raise SignatureError(f"{where}: malformed {what} entry")
        return cls(_int(v["bytes"], f"{what} bytes", where, 1), _sha_field(v["sha256"], f"{what} sha256", where))


@dataclass(frozen=True)
class Shares:
    """Per-share hashes of a version (``"shares"`` in a ``stoa.weights.manifest/3`` body): what lets
    a pipeline stage verify only its layers (rule: :mod:`stoa.transport.shares`)."""

    rule: str
    """The split rule, :data:`stoa.transport.shares.SHARE_RULE`."""
    hashes: dict[str, str]
    """share -> :func:`stoa.transport.pulse.state_hash` of that share's tensors, for every share
    the state has (``embed``, ``head``, ``layer.<i>``). Do not mutate."""
    anchor_header: Payload | None
    """For a version with an anchor, its first bytes up to the end of the safetensors header
    (8-byte length + JSON): size and sha256, so a range read of the header can be checked and the
    tensors' byte spans trusted. None when the version has no anchor."""

    @classmethod
    def parse(cls, v: Any, *, tensors: int, anchor: Payload | None, where: str) -> Shares:
        if not isinstance(v, dict) or set(v) != {"rule", "hashes", "anchor_header"}:
            raise SignatureError(f"{where}: shares must be an object of exactly rule, hashes and anchor_header")
        if v["rule"] != shares.SHARE_RULE:
            raise SignatureError(f"{where}: unknown share rule {str(v['rule'])[:60]!r} (known: {shares.SHARE_RULE})")
        h = v["hashes"]
        if not isinstance(h, dict) or not 1 <= len(h) <= min(tensors, shares.MAX_SHARES):
            raise SignatureError(f"{where}: shares.hashes must name 1 to min(tensors, {shares.MAX_SHARES}) shares")
        for k, sha in h.items():
            if not shares.check_share_key(k):
                raise SignatureError(f"{where}: {str(k)[:40]!r} is not a share name (embed, head or layer.<i>)")
            _sha_field(sha, f"share {k} hash", where)
        hdr = Payload.parse(v["anchor_header"], "anchor_header", where)
        if (hdr is None) != (anchor is None):
            raise SignatureError(f"{where}: shares.anchor_header goes with an anchor, and only with one")
        if hdr is not None and not 10 <= hdr.bytes <= min(anchor.bytes, 8 + tensorfile.MAX_HEADER):  # type: ignore[union-attr]
            raise SignatureError(f"{where}: an anchor header of {hdr.bytes} bytes does not fit the anchor")
        return cls(v["rule"], dict(h), hdr)

    def to_body(self) -> dict[str, Any]:
        hdr = self.anchor_header
        return {"rule": self.rule, "hashes": dict(self.hashes),
                "anchor_header": None if hdr is None else {"bytes": hdr.bytes, "sha256": hdr.sha256}}


@dataclass(frozen=True)
class Manifest:
    """The signed description of one version (the body of ``weights/<version>/manifest.json``).

    Built only by :meth:`parse` (from a verified body) or by the publisher; every field is
    checked once, so code that holds a ``Manifest`` needs no further checks.
    """

    run: str
    """The run's key prefix."""
    version: int
    """This version, in ``[0, 10^12)``."""
    parent: int | None
    """The version published before this one on its chain (older), or None for a chain's root."""
    parent_manifest_sha256: str | None
    """sha256 of the parent's manifest object: binds the version to its parent chain."""
    state_hash: str
    """:func:`stoa.transport.pulse.state_hash` of this version's state."""
    depth: int
    """Deltas since the last anchor (0 for an anchor)."""
    anchor_version: int
    """The newest anchor this version descends from (itself for an anchor)."""
    anchor: Payload | None
    """The full state, if this version has one."""
    delta: Payload | None
    """The delta from ``parent``, if this version has one."""
    full_state_bytes: int
    """Bytes of the state's arrays."""
    tensors: int
    """Number of tensors in the state."""
    metadata: dict[str, Any]
    """The publisher's small JSON metadata (e.g. the optimizer step). Do not mutate."""
    created: float
    """Unix time of the publish (the publisher's clock)."""
    shares: Shares | None = None
    """Per-share hashes (format ``/3``); None in a ``/2`` manifest, which only whole-model
    subscribers can follow."""

    _FIELDS = frozenset({"format", "run", "version", "parent", "parent_manifest_sha256", "state_hash", "depth",
                         "anchor_version", "anchor", "delta", "full_state_bytes", "tensors", "metadata", "created"})

    @classmethod
    def parse(cls, body: Any, *, run: str, version: int, where: str) -> Manifest:
        """Check a verified manifest body for ``run`` and ``version``; raises :class:`SignatureError`."""
        fmt = body.get("format") if isinstance(body, dict) else None
        if fmt not in (MANIFEST_FORMAT, MANIFEST_FORMAT_WHOLE):
            raise SignatureError(f"{where}: not a {MANIFEST_FORMAT} (or {MANIFEST_FORMAT_WHOLE}) manifest")
        if body.get("run") != run or body.get("version") != version:
            raise SignatureError(f"{where}: signed manifest is for run {str(body.get('run'))[:80]!r} version "
                                 f"{str(body.get('version'))[:20]}, expected {run!r} version {version}")
        _exact_keys(body, cls._FIELDS | {"shares"} if fmt == MANIFEST_FORMAT else cls._FIELDS, where)
        m = cls(run, version, _opt_version(body["parent"], "parent", where),
                None if body["parent_manifest_sha256"] is None else
                _sha_field(body["parent_manifest_sha256"], "parent_manifest_sha256", where),
                _sha_field(body["state_hash"], "state_hash", where), _int(body["depth"], "depth", where),
                _int(body["anchor_version"], "anchor_version", where, 0, version),
                Payload.parse(body["anchor"], "anchor", where), Payload.parse(body["delta"], "delta", where),
                _int(body["full_state_bytes"], "full_state_bytes", where), _int(body["tensors"], "tensors", where, 1),
                body["metadata"], _time(body["created"], where))
        if fmt == MANIFEST_FORMAT:
            m = dataclasses.replace(m, shares=Shares.parse(body["shares"], tensors=m.tensors, anchor=m.anchor,
                                                           where=where))
        if not isinstance(m.metadata, dict):
            raise SignatureError(f"{where}: metadata must be an object")
        if m.anchor is None and m.delta is None:
            raise SignatureError(f"{where}: version has neither an anchor nor a delta")
        if (m.parent is None) != (m.parent_manifest_sha256 is None) or (m.delta is not None and m.parent is None):
            raise SignatureError(f"{where}: parent and parent_manifest_sha256 go together, and a delta needs both")
        if m.parent is not None and m.parent >= version:
            raise SignatureError(f"{where}: parent {m.parent} is not older than the version")
        if (m.anchor is not None) != (m.depth == 0 and m.anchor_version == version):
            raise SignatureError(f"{where}: depth {m.depth} / anchor_version {m.anchor_version} contradict the payloads")
        return m

    def to_body(self) -> dict[str, Any]:
        """The JSON body the publisher signs."""
        pay = lambda p: None if p is None else {"bytes": p.bytes, "sha256": p.sha256}  # noqa: E731
        body = {"format": MANIFEST_FORMAT_WHOLE, "run": self.run, "version": self.version, "parent": self.parent,
                "parent_manifest_sha256": self.parent_manifest_sha256, "state_hash": self.state_hash,
                "depth": self.depth, "anchor_version": self.anchor_version, "anchor": pay(self.anchor),
                "delta": pay(self.delta), "full_state_bytes": self.full_state_bytes, "tensors": self.tensors,
                "metadata": self.metadata, "created": self.created}
        if self.shares is not None:
            body.update(format=MANIFEST_FORMAT, shares=self.shares.to_body())
        return body


@dataclass(frozen=True)
class Pointer:
    """The signed pointer ``<run>/current.json``: the newest committed version."""

    run: str
    """The run's key prefix."""
    version: int
    """The head version."""
    manifest_sha256: str
    """sha256 of the head's manifest object."""
    created: float
    """Unix time of the publish."""

    _FIELDS = frozenset({"format", "run", "version", "manifest_sha256", "created"})

    @classmethod
    def parse(cls, body: Any, *, run: str, where: str) -> Pointer:
        """Check a verified pointer body for ``run``; raises :class:`SignatureError`."""
        if not isinstance(body, dict) or body.get("format") != POINTER_FORMAT:
            raise SignatureError(f"{where}: not a {POINTER_FORMAT} pointer")
        if body.get("run") != run:
            raise SignatureError(f"{where}: signed pointer is for run {str(body.get('run'))[:80]!r}, not {run!r}")
        _exact_keys(body, cls._FIELDS, where)
        return cls(run, _int(body["version"], "pointer version", where, 0, MAX_VERSION),
                   _sha_field(body["manifest_sha256"], "manifest_sha256", where), _time(body["created"], where))

    def to_body(self) -> dict[str, Any]:
        """The JSON body the publisher signs."""
        return {"format": POINTER_FORMAT, "run": self.run, "version": self.version,
                "manifest_sha256": self.manifest_sha256, "created": self.created}


class Layout:
    """Where a run's chain objects live (see the module docstring)."""

    def __init__(self, run: str):
        self.run = validate_key(run.strip("/"))
        self.pointer = layout.pointer(self.run)
        self.weights = layout.weights(self.run)

    def manifest(self, v: int) -> str:
        return f"{self.weights}{v:012d}/manifest.json"

    def payload(self, v: int, kind: str) -> str:
        return f"{self.weights}{v:012d}/" + ("anchor.safetensors" if kind == "anchor" else "delta.pulse")

    def version_of(self, key: str) -> int | None:
        """The version of a listed key of this layout, None for anything else (foreign keys)."""
        m = _ENTRY_RE.fullmatch(key[len(self.weights):]) if key.startswith(self.weights) else None
        return int(m.group(1)) if m else None
