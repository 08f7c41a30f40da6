"""The signed weight-version chain: how the trainer publishes weights and workers follow them.

Layout under a run (``<run>`` is any valid key prefix)::

    <run>/current.json                                  signed pointer to the newest version
    <run>/weights/<version:012d>/manifest.json          signed manifest of one version
    <run>/weights/<version:012d>/anchor.safetensors     full state (pulse.encode_state), if any
    <run>/weights/<version:012d>/delta.pulse            pulse.encode_delta(parent, state), if any

Each version has an anchor, a delta from its ``parent`` version, or both (a scheduled anchor
keeps its delta so workers already on the chain need not download the full state). Anchors are
written every ``anchor_every`` versions, when the layout changes, and whenever the delta would
not be much smaller than the state. A manifest names its parent, the sha256 and size of each
payload and the :func:`stoa.transport.pulse.state_hash` of the state it describes.

**Commit order.** The publisher writes payloads, then the manifest, then the pointer. Readers
start at the pointer and only walk down parent links, so a crash at any moment leaves only
complete versions visible; objects above the pointer are uncommitted and are overwritten by the
next publish.

**Signatures.** Manifests and the pointer are JSON envelopes holding the body text and an
ed25519 signature over ``b"stoa.signed/1\\0" + kind + b"\\0" + body``. The trainer holds the
private key; workers are given the run's public key and refuse anything unsigned, signed by
another key, for another run, or whose payload hashes do not match (:class:`SignatureError`).

**Sync.** :meth:`WeightSubscriber.sync` moves a worker from the version it holds to the pointer's
by deltas or by jumping to a newer anchor, whichever moves fewer bytes; a new worker starts from
the newest anchor. A corrupted or truncated payload (size or sha256 differs from the signed
manifest) is re-fetched once, reported in ``SyncResult.problems``, and routed around (another
anchor, or deltas instead of a broken anchor); the final state is checked against the signed
state hash. A garbled pointer is rewritten by the next publisher to start on the run.

**Retention.** :meth:`WeightPublisher.gc` keeps the versions from the ``keep_anchors``-th newest
anchor on the chain up to the pointer and deletes older versions and orphans (uncommitted
leftovers below the pointer). A joiner needs only the newest anchor and the deltas after it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from stoa.transport import pulse
from stoa.transport.store import KeyNotFound, ObjectStore, StoreError, validate_key

__all__ = [
    "ChainError",
    "IntegrityError",
    "PublishResult",
    "SignatureError",
    "SyncResult",
    "WeightPublisher",
    "WeightSubscriber",
    "generate_private_key",
    "open_document",
    "sign_document",
    "key_id",
    "load_private_key",
    "load_public_key",
    "save_keypair",
]

log = logging.getLogger(__name__)

State = dict[str, np.ndarray]
_SIGNED = "stoa.signed/1"
_MANIFEST = "stoa.weights.manifest/1"
_POINTER = "stoa.weights.pointer/1"
_MAX_VERSION = 10**12 - 1
_MAX_MANIFEST_BYTES = 1 << 20


class ChainError(RuntimeError):
    """The version chain cannot be read or written as asked; the message says why."""


class SignatureError(ChainError):
    """An object is unsigned, signed by another key, or its signed content is inconsistent."""


class IntegrityError(ChainError):
    """Payloads or states do not match their signed hashes and no intact route is left."""


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------


def generate_private_key() -> Ed25519PrivateKey:
    """A new ed25519 private key for signing a run's manifests."""
    return Ed25519PrivateKey.generate()


def _raw_public(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short fingerprint of a public key (16 hex characters of its sha256)."""
    return hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


def _read_key_source(src: Any) -> bytes:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src)
    if isinstance(src, str) and len(src) == 64 and all(c in "0123456789abcdefABCDEF" for c in src):
        return bytes.fromhex(src)
    if isinstance(src, (str, os.PathLike)):
        return Path(src).expanduser().read_bytes()
    raise TypeError(f"expected key bytes, a hex string or a file path, got {type(src).__name__}")


def load_private_key(src: Ed25519PrivateKey | bytes | str | os.PathLike[str]) -> Ed25519PrivateKey:
    """An ed25519 private key from a key object, 32 raw bytes, 64 hex chars, PEM (PKCS#8) bytes, or a file of either."""
    if isinstance(src, Ed25519PrivateKey):
        return src
    data = _read_key_source(src)
    if len(data) == 32:
        return Ed25519PrivateKey.from_private_bytes(data)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"not an ed25519 private key (raw 32 bytes or unencrypted PEM): {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"expected an ed25519 private key, got {type(key).__name__}")
    return key


def load_public_key(src: Ed25519PublicKey | Ed25519PrivateKey | bytes | str | os.PathLike[str]) -> Ed25519PublicKey:
    """An ed25519 public key from a key object, 32 raw bytes, 64 hex chars, PEM bytes, or a file of either."""
    if isinstance(src, Ed25519PublicKey):
        return src
    if isinstance(src, Ed25519PrivateKey):
        return src.public_key()
    data = _read_key_source(src)
    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"not an ed25519 public key (raw 32 bytes or PEM): {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"expected an ed25519 public key, got {type(key).__name__}")
    return key


def save_keypair(private_key: Ed25519PrivateKey, directory: str | os.PathLike[str], name: str = "run",
                 overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``<name>.key`` (PKCS#8 PEM, mode 0600) and ``<name>.pub`` (PEM); return their paths."""
    d = Path(directory).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    priv, pub = d / f"{name}.key", d / f"{name}.pub"
    if not overwrite and (priv.exists() or pub.exists()):
        raise FileExistsError(f"{priv} or {pub} exists; refusing to overwrite a key")
    pem = private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub.write_bytes(private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


# ---------------------------------------------------------------------------------------------
# Signed envelopes
# ---------------------------------------------------------------------------------------------


def _message(kind: str, body: bytes) -> bytes:
    return _SIGNED.encode() + b"\0" + kind.encode() + b"\0" + body


def _seal(kind: str, body: dict, key: Ed25519PrivateKey) -> bytes:
    text = json.dumps(body, sort_keys=True, allow_nan=False, separators=(",", ":"))
    sig = key.sign(_message(kind, text.encode()))
    env = {"format": _SIGNED, "kind": kind, "key_id": key_id(key.public_key()), "body": text,
           "signature": base64.b64encode(sig).decode()}
    return json.dumps(env, indent=1).encode()


class _Garbled(IntegrityError):
    """Bytes that are not a parseable envelope (truncated or corrupted in storage)."""


def _open(blob: bytes, kind: str, pub: Ed25519PublicKey, where: str) -> dict:
    try:
        env = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _Garbled(f"{where}: not valid JSON ({e}); truncated or corrupted") from None
    if not isinstance(env, dict) or not isinstance(env.get("body"), str):
        raise _Garbled(f"{where}: not a signed envelope")
    if env.get("format") != _SIGNED or not env.get("signature"):
        raise SignatureError(f"{where}: unsigned (no {_SIGNED} signature); refusing it")
    if env.get("kind") != kind:
        raise SignatureError(f"{where}: a signed {env.get('kind')!r}, expected a {kind!r}")
    if env.get("key_id") != key_id(pub):
        raise SignatureError(f"{where}: signed by key {env.get('key_id')!r}, not this run's key {key_id(pub)}")
    try:
        sig = base64.b64decode(env["signature"], validate=True)
        pub.verify(sig, _message(kind, env["body"].encode()))
    except (InvalidSignature, ValueError, TypeError):
        raise SignatureError(f"{where}: bad ed25519 signature; refusing it") from None
    body = json.loads(env["body"])
    if not isinstance(body, dict):
        raise SignatureError(f"{where}: signed body is not an object")
    return body


def sign_document(kind: str, body: dict, private_key: Any) -> bytes:
    """A JSON document signed with the run's key (for run configs, model-file manifests, ...)."""
    return _seal(kind, body, load_private_key(private_key))


def open_document(blob: bytes, kind: str, public_key: Any, where: str = "document") -> dict:
    """Verify a :func:`sign_document` envelope of ``kind`` and return its body.

    Raises:
        SignatureError: unsigned, signed by another key, another kind, or a bad signature.
        IntegrityError: not a parseable envelope (truncated or corrupted).
    """
    return _open(blob, kind, load_public_key(public_key), where)


# ---------------------------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------------------------


def _check_version(v: Any, what: str = "version") -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _MAX_VERSION:
        raise ValueError(f"{what} must be an int in [0, 10^12), got {v!r}")
    return v


class _Keys:
    def __init__(self, run: str):
        self.run = validate_key(run.strip("/"))
        self.pointer = f"{self.run}/current.json"
        self.weights = f"{self.run}/weights/"

    def version_dir(self, v: int) -> str:
        return f"{self.weights}{v:012d}/"

    def manifest(self, v: int) -> str:
        return self.version_dir(v) + "manifest.json"

    def payload(self, v: int, kind: str) -> str:
        return self.version_dir(v) + ("anchor.safetensors" if kind == "anchor" else "delta.pulse")

    def version_of(self, key: str) -> int | None:
        head, _, _ = key[len(self.weights):].partition("/")
        return int(head) if len(head) == 12 and head.isdigit() else None


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _check_state(state: Any) -> None:
    if not isinstance(state, dict) or not state:
        raise TypeError("a weight state is a non-empty dict[str, numpy.ndarray]")
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, np.ndarray):
            raise TypeError(f"state entry {k!r}: expected str -> numpy.ndarray, got {type(v).__name__}")


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).reshape(-1).view(np.uint8), np.ascontiguousarray(b).reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------------------------
# Publisher
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishResult:
    """What one :meth:`WeightPublisher.publish` did.

    Attributes:
        version: the published version.
        kind: ``"anchor"`` if a full state was written (possibly with a delta beside it), else ``"delta"``.
        bytes_written: all bytes put to the store (payloads, manifest, pointer).
        full_state_bytes: bytes of the state's arrays (what a full checkpoint moves), for comparison.
        delta_bytes: size of the delta payload, or None if none was written.
        anchor_bytes: size of the anchor payload, or None if none was written.
        seconds: wall time of the publish.
        state_hash: :func:`pulse.state_hash` of the published state.
    """

    version: int
    kind: str
    bytes_written: int
    full_state_bytes: int
    delta_bytes: int | None
    anchor_bytes: int | None
    seconds: float
    state_hash: str


class WeightPublisher:
    """The trainer's side: publishes weight states as signed versions.

    Args:
        store: the run's object store.
        run: the run's key prefix.
        private_key: the run's ed25519 private key (object, raw bytes, PEM, or a file path).
        anchor_every: write a full anchor at least every this many versions (>= 1).
        anchor_if_delta_over: write an anchor instead of a delta when the delta is larger than
            this fraction of the state's bytes (in (0, 1]).
        keep_anchors: after each anchor, :meth:`gc` keeps this many newest anchors and what
            follows them; None keeps everything.

    A publisher that starts on a run that already has versions resumes from the pointer: it
    syncs the head state from the store (verifying it) to diff the next version against.
    The publisher keeps a private copy of the last published state.
    """

    def __init__(self, store: ObjectStore, run: str, private_key: Any, anchor_every: int = 50,
                 anchor_if_delta_over: float = 0.5, keep_anchors: int | None = 2):
        if not isinstance(anchor_every, int) or anchor_every < 1:
            raise ValueError(f"anchor_every must be an int >= 1, got {anchor_every!r}")
        if not 0 < anchor_if_delta_over <= 1:
            raise ValueError(f"anchor_if_delta_over must lie in (0, 1], got {anchor_if_delta_over}")
        if keep_anchors is not None and keep_anchors < 1:
            raise ValueError("keep_anchors must be >= 1 or None")
        self.store, self._keys = store, _Keys(run)
        self.run = self._keys.run
        self._key = load_private_key(private_key)
        self.public_key = self._key.public_key()
        self.anchor_every, self.anchor_if_delta_over, self.keep_anchors = anchor_every, anchor_if_delta_over, keep_anchors
        self._prev: tuple[int, State, dict] | None = None  # (version, state copy, manifest)
        self._floor: int | None = None  # committed head; new versions must exceed it
        self._resumed = False

    def head(self) -> int | None:
        """The committed version the pointer names (None before the first publish)."""
        return WeightSubscriber(self.store, self.run, self.public_key).head()

    def _resume(self) -> None:
        sub = WeightSubscriber(self.store, self.run, self.public_key)
        try:
            self._floor = sub.head()
        except _Garbled as e:
            self._floor = self._repair_pointer(sub, e)
        if self._floor is not None:
            try:
                res = sub.sync(None)
                self._prev = (res.version, res.state, sub.manifest(res.version))
                log.info("publisher for %s resumed at version %d", self.run, res.version)
            except IntegrityError as e:
                log.warning("cannot rebuild head version %d (%s); the next version will be a fresh anchor",
                            self._floor, e)
        self._resumed = True

    def _repair_pointer(self, sub: WeightSubscriber, why: Exception) -> int | None:
        """Point at the newest intact manifest: every manifest we signed names a complete version."""
        versions = sorted({v for k in self.store.list(self._keys.weights) if (v := self._keys.version_of(k)) is not None})
        for v in reversed(versions):
            try:
                blob = self.store.get(self._keys.manifest(v))
                sub.manifest(v)
            except (KeyNotFound, _Garbled):
                continue
            self.store.put(self._keys.pointer, _seal("pointer", {
                "format": _POINTER, "run": self.run, "version": v, "manifest_sha256": _sha(blob),
                "created": time.time()}, self._key))
            log.warning("%s; rewrote the pointer to version %d", why, v)
            return v
        raise IntegrityError(f"{why}; and no intact manifest to repair it from") from None

    def publish(self, version: int, state: State, metadata: dict | None = None) -> PublishResult:
        """Publish ``state`` as ``version`` (greater than every committed version).

        Writes the payload(s), then the signed manifest, then the pointer. ``metadata`` (small
        JSON, e.g. the optimizer step or the resolved config's hash) is signed into the manifest.
        """
        t0 = time.perf_counter()
        _check_version(version)
        _check_state(state)
        if not self._resumed:
            self._resume()
        if self._floor is not None and version <= self._floor:
            raise ChainError(f"version {version} is not newer than the committed head {self._floor}; "
                             f"publish {self._floor + 1} or later")
        meta = dict(metadata or {})
        try:
            meta_text = json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata must be JSON-serializable: {e}") from None
        if len(meta_text) > _MAX_MANIFEST_BYTES // 4:
            raise ValueError("metadata is too large for a manifest (keep it under 256 KiB)")

        full_bytes = sum(a.nbytes for a in state.values())
        delta = None
        if self._prev is not None:
            try:
                delta = pulse.encode_delta(self._prev[1], state)
            except pulse.PulseError as e:
                log.info("version %d: no delta (%s); writing an anchor", version, e)
        depth = self._prev[2]["depth"] + 1 if self._prev is not None and delta is not None else 0
        too_big = delta is not None and len(delta) > self.anchor_if_delta_over * full_bytes
        want_anchor = delta is None or too_big or depth >= self.anchor_every
        if too_big:
            delta = None  # the anchor alone is about as cheap
        anchor = pulse.encode_state(state) if want_anchor else None
        if anchor is not None:
            depth = 0
        h = pulse.state_hash(state)
        body = {
            "format": _MANIFEST, "run": self.run, "version": version,
            "parent": self._prev[0] if delta is not None else None,
            "parent_state_hash": self._prev[2]["state_hash"] if delta is not None else None,
            "state_hash": h, "depth": depth,
            "anchor_version": version if anchor is not None else self._prev[2]["anchor_version"],
            "anchor": {"bytes": len(anchor), "sha256": _sha(anchor)} if anchor is not None else None,
            "delta": {"bytes": len(delta), "sha256": _sha(delta)} if delta is not None else None,
            "full_state_bytes": full_bytes, "tensors": len(state), "metadata": meta, "created": time.time(),
        }
        written = 0
        for kind, blob in (("anchor", anchor), ("delta", delta)):
            if blob is not None:
                self.store.put(self._keys.payload(version, kind), blob)
                written += len(blob)
        manifest = _seal("manifest", body, self._key)
        self.store.put(self._keys.manifest(version), manifest)
        pointer = _seal("pointer", {"format": _POINTER, "run": self.run, "version": version,
                                    "manifest_sha256": _sha(manifest), "created": time.time()}, self._key)
        self.store.put(self._keys.pointer, pointer)
        written += len(manifest) + len(pointer)
        self._prev = (version, {k: np.array(v, copy=True, order="C") for k, v in state.items()}, body)
        self._floor = version
        if anchor is not None and self.keep_anchors is not None:
            try:
                self.gc(self.keep_anchors)
            except (StoreError, ChainError) as e:  # the version is committed; retention can wait
                log.warning("retention after version %d failed: %s", version, e)
        return PublishResult(version, "anchor" if anchor is not None else "delta", written, full_bytes,
                             None if delta is None else len(delta), None if anchor is None else len(anchor),
                             time.perf_counter() - t0, h)

    def gc(self, keep_anchors: int = 2) -> list[str]:
        """Delete versions no joiner can still need; return the deleted keys.

        Keeps, along the chain from the pointer down, every version from the
        ``keep_anchors``-th newest anchor up; deletes older versions and orphans below the
        pointer (a crash's uncommitted leftovers). Never touches versions above the pointer
        (a publish in progress). Manifests go before their payloads, so readers never find a
        manifest whose payload is gone for good.
        """
        if keep_anchors < 1:
            raise ValueError("keep_anchors must be >= 1")
        sub = WeightSubscriber(self.store, self.run, self.public_key)
        head = sub.head()
        if head is None:
            return []
        keep, anchors, v = set(), 0, head
        while v is not None:
            try:
                m = sub.manifest(v)
            except (KeyNotFound, _Garbled):
                break
            keep.add(v)
            if m["anchor"] is not None:
                anchors += 1
                if anchors >= keep_anchors:
                    break
            v = m["parent"]
        if anchors < keep_anchors:
            return []  # too few anchors yet (or a broken walk): everything may still be needed
        doomed: dict[int, list[str]] = {}
        for key in self.store.list(self._keys.weights):
            ver = self._keys.version_of(key)
            if ver is not None and ver <= head and ver not in keep:
                doomed.setdefault(ver, []).append(key)
        deleted = []
        for ver in sorted(doomed):
            for key in sorted(doomed[ver], key=lambda k: not k.endswith("manifest.json")):
                self.store.delete(key)
                deleted.append(key)
        return deleted


# ---------------------------------------------------------------------------------------------
# Subscriber
# ---------------------------------------------------------------------------------------------


@dataclass
class SyncResult:
    """The outcome of :meth:`WeightSubscriber.sync`.

    Attributes:
        version: the version now held (the pointer's at the time of the sync).
        state: the state of ``version``. With ``apply_inplace=True`` and a compatible state,
            this is the very dict (and arrays) that was passed in, updated in place.
        bytes_read: every byte fetched from the store (pointer, manifests, payloads).
        applied: what was applied, in order: ``(version, "anchor" | "delta")``.
        changed_names: names whose arrays may differ from the state passed in (every name
            when none was passed).
        inplace: whether ``state`` is the caller's dict (updated in place, or untouched when it
            already held the head).
        problems: corrupted or missing objects that were detected and routed around.
    """

    version: int
    state: State
    bytes_read: int
    applied: list[tuple[int, str]] = field(default_factory=list)
    changed_names: list[str] = field(default_factory=list)
    inplace: bool = False
    problems: list[str] = field(default_factory=list)


class _Corrupt(Exception):
    def __init__(self, route: tuple[int, str], msg: str):
        super().__init__(msg)
        self.route = route


class WeightSubscriber:
    """A worker's side: follows a run's signed chain.

    Args:
        store: the run's object store.
        run: the run's key prefix.
        public_key: the run's ed25519 public key (object, raw bytes, hex, PEM, or a file path).
    """

    def __init__(self, store: ObjectStore, run: str, public_key: Any):
        self.store, self._keys = store, _Keys(run)
        self.run = self._keys.run
        self.public_key = load_public_key(public_key)
        self._manifests: OrderedDict[int, dict] = OrderedDict()  # committed manifests are immutable
        self._read = 0

    def _get(self, key: str) -> bytes:
        b = self.store.get(key)
        self._read += len(b)
        return b

    def _pointer(self) -> dict | None:
        for attempt in range(2):
            try:
                blob = self._get(self._keys.pointer)
            except KeyNotFound:
                return None
            try:
                body = _open(blob, "pointer", self.public_key, self._keys.pointer)
                break
            except _Garbled as e:
                if attempt:
                    raise _Garbled(f"{e}; cannot tell which version is committed") from None
        if body.get("format") != _POINTER or body.get("run") != self.run:
            raise SignatureError(f"{self._keys.pointer}: signed pointer is for run {body.get('run')!r}, not {self.run!r}")
        _check_version(body.get("version"), "pointer version")
        return body

    def head(self) -> int | None:
        """The newest committed version, or None if nothing was published yet."""
        p = self._pointer()
        return None if p is None else p["version"]

    def manifest(self, version: int, expect_sha256: str | None = None) -> dict:
        """The verified manifest body of ``version`` (raises KeyNotFound if it is gone)."""
        if version in self._manifests:
            self._manifests.move_to_end(version)
            return self._manifests[version]
        key = self._keys.manifest(version)
        for attempt in range(2):
            blob = self._get(key)
            if len(blob) > _MAX_MANIFEST_BYTES:
                raise _Garbled(f"{key}: {len(blob)} bytes, over the {_MAX_MANIFEST_BYTES}-byte manifest limit")
            if expect_sha256 is None or _sha(blob) == expect_sha256:
                break
            if attempt:
                try:  # a forgery is reported as such; anything else as a mismatch
                    _open(blob, "manifest", self.public_key, key)
                except _Garbled as e:
                    raise IntegrityError(f"{e} (it is the head version's manifest)") from None
                raise IntegrityError(f"{key}: is not the manifest the signed pointer names (sha256 differs)")
        m = _open(blob, "manifest", self.public_key, key)
        self._check_manifest(m, version, key)
        self._manifests[version] = m
        if len(self._manifests) > 4096:
            self._manifests.popitem(last=False)
        return m

    def _check_manifest(self, m: dict, version: int, key: str) -> None:
        # Signed by the right key, but still checked: the signature is no excuse for a crash.
        if m.get("format") != _MANIFEST or m.get("run") != self.run or m.get("version") != version:
            raise SignatureError(f"{key}: signed manifest is for run {m.get('run')!r} version {m.get('version')!r}, "
                                 f"expected {self.run!r} version {version}")
        for kind in ("anchor", "delta"):
            p = m.get(kind)
            if p is not None and not (isinstance(p, dict) and isinstance(p.get("bytes"), int)
                                      and isinstance(p.get("sha256"), str)):
                raise SignatureError(f"{key}: malformed {kind} entry")
        if m.get("anchor") is None and m.get("delta") is None:
            raise SignatureError(f"{key}: version has neither an anchor nor a delta")
        if m.get("delta") is not None:
            _check_version(m.get("parent"), "parent")
            if m["parent"] >= version:
                raise SignatureError(f"{key}: parent {m['parent']} is not older than the version")

    def _manifest_or_none(self, v: int, problems: list[str]) -> dict | None:
        try:
            return self.manifest(v)
        except KeyNotFound:
            return None
        except _Garbled as e:
            problems.append(str(e))
            log.warning("%s", e)
            return None

    def _plan(self, head: int, have: int | None, banned: set, problems: list[str]) -> tuple[int | None, list[int]]:
        """Cheapest route to ``head``: (anchor version or None for "from have", delta versions ascending)."""
        best: tuple[int, int | None, list[int]] | None = None  # (bytes, anchor, deltas)
        suffix: list[int] = []
        cost, v = 0, head
        while True:
            if have is not None and v == have and (v, "have") not in banned:
                if best is None or cost < best[0]:
                    best = (cost, None, suffix[::-1])
                break
            m = self._manifest_or_none(v, problems)
            if m is None:
                break
            if m["anchor"] is not None and (v, "anchor") not in banned:
                c = cost + m["anchor"]["bytes"]
                if best is None or c < best[0]:
                    best = (c, v, suffix[::-1])
                if have is None:
                    break  # an older anchor only adds deltas
            if m["delta"] is None or (v, "delta") in banned:
                break
            cost += m["delta"]["bytes"]
            if best is not None and cost >= best[0]:
                break
            suffix.append(v)
            v = m["parent"]
            if have is not None and v < have:
                break  # the held version is not on this chain
        if best is None:
            raise IntegrityError(f"no intact route to version {head} of run {self.run!r}"
                                 + (f" (problems: {'; '.join(problems)})" if problems else ""))
        return best[1], best[2]

    def _payload(self, v: int, kind: str, problems: list[str]) -> bytes:
        entry = self.manifest(v)[kind]
        key = self._keys.payload(v, kind)
        for attempt in range(2):
            blob = self._get(key)
            if len(blob) == entry["bytes"] and _sha(blob) == entry["sha256"]:
                return blob
            msg = (f"{key}: {len(blob)} bytes with sha256 {_sha(blob)[:12]}..., the signed manifest says "
                   f"{entry['bytes']} bytes with {entry['sha256'][:12]}... (corrupted or truncated)")
            if attempt == 0:
                problems.append(msg + "; fetching again")
            log.warning("%s", msg)
        raise _Corrupt((v, kind), msg + "; routing around it")

    def sync(self, have: tuple[int, State] | None = None, apply_inplace: bool = False) -> SyncResult:
        """Bring ``have`` (``(version, state)``, or None for a new worker) to the newest version.

        Takes whichever route moves fewer bytes: the deltas after ``have``, or a newer anchor
        plus the deltas after it. Every object is verified (signature, size, sha256) before
        use and the final state against the manifest's signed state hash. With
        ``apply_inplace=True`` deltas are written into ``have``'s arrays (a live engine sees
        them without reloading), and an anchor route copies into them when the layout matches.

        Raises:
            SignatureError: an object is unsigned or wrongly signed.
            IntegrityError: nothing intact leads to the head (all problems listed).
            ChainError: nothing was published yet, or ``have`` is newer than the head.
        """
        if have is not None:
            _check_version(have[0], "held version")
            _check_state(have[1])
        self._read = 0
        problems: list[str] = []
        banned: set[tuple[int, str]] = set()
        for _ in range(8):  # each retry bans one broken route or follows a moved pointer
            p = self._pointer()
            if p is None:
                raise ChainError(f"run {self.run!r} has no published weights yet ({self._keys.pointer} is missing)")
            head = p["version"]
            if have is not None and have[0] > head:
                raise ChainError(f"you hold version {have[0]}, newer than the store's head {head}")
            try:
                target = self.manifest(head, expect_sha256=p["manifest_sha256"])
            except KeyNotFound:
                continue  # pointer moved while we read; read it again
            if have is not None and have[0] == head:
                return SyncResult(head, have[1], self._read, [], [], True, problems)
            try:
                anchor, deltas = self._plan(head, None if have is None else have[0], banned, problems)
                return self._execute(head, target, anchor, deltas, have, apply_inplace, problems)
            except _Corrupt as e:
                banned.add(e.route)
                problems.append(str(e))
            except KeyNotFound as e:
                problems.append(f"{e} (deleted by retention while syncing); planning again")
                self._manifests.clear()
        raise IntegrityError(f"could not sync run {self.run!r}: {'; '.join(problems)}")

    def _execute(self, head: int, target: dict, anchor: int | None, deltas: list[int],
                 have: tuple[int, State] | None, inplace: bool, problems: list[str]) -> SyncResult:
        blobs = [(v, self._payload(v, "delta", problems)) for v in deltas]  # verify all before any write
        applied: list[tuple[int, str]] = []
        if anchor is None:
            assert have is not None
            route: tuple[int, str] = (have[0], "have")
            state = have[1] if inplace else {k: np.array(a, copy=True, order="C") for k, a in have[1].items()}
            changed: set[str] = set()
        else:
            route = (anchor, "anchor")
            try:
                state = pulse.decode_state(self._payload(anchor, "anchor", problems))
            except pulse.PulseError as e:
                raise _Corrupt(route, f"anchor {anchor} does not decode although its hash matched: {e}") from None
            applied.append((anchor, "anchor"))
            changed = set(state)
        for v, blob in blobs:
            try:
                changed.update(pulse.apply_delta_inplace(state, blob))
            except pulse.PulseError as e:
                raise _Corrupt(route, f"delta {v} does not apply: {e}") from None
            applied.append((v, "delta"))
        if pulse.state_hash(state) != target["state_hash"]:
            raise _Corrupt(route, f"state after {applied} does not match the signed state hash of version {head}"
                           + (" (the state passed in was not the version it claimed)" if anchor is None else ""))
        used_inplace = inplace and anchor is None
        if anchor is not None and have is not None:
            old = have[1]
            changed = {n for n in state if n not in old or not _same_bytes(old[n], state[n])} | (set(old) - set(state))
            if inplace and set(old) == set(state) and all(
                    old[n].shape == state[n].shape and old[n].dtype == state[n].dtype and old[n].flags.writeable
                    for n in state):
                for n in changed:
                    np.copyto(old[n], state[n])
                state, used_inplace = old, True
        return SyncResult(head, state, self._read, applied, sorted(changed), used_inplace, problems)
