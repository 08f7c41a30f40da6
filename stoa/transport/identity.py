"""Worker identity: worker keys, sealed (signed) rollout batches, and the run's roster of workers.

Workers are strangers. Each has its own ed25519 key pair (``stoa keygen --worker``, or one a
worker makes on first start and keeps in its cache folder) and signs every batch it uploads; the
trainer decides whose batches it takes from the run's **roster**, a document signed with the
run's key that lists enrolled worker keys and banned ones.

Sealed batch
------------
What a worker puts at ``<run>/rollouts/<worker_id>/s<seq>-v<version>.episodes``::

    b"STSB" | 0x01 | header length (4 bytes, big-endian, at most 16 KiB) | header | payload

``payload`` is the episode batch (:func:`stoa.types.encode_episodes`). ``header`` is a
:func:`stoa.transport.signing.sign_document` envelope of kind ``"rollout-batch"``, signed with
the worker's key, whose body is::

    {"format": "stoa.batch-seal/1", "run": RUN, "worker_id": ID, "seq": SEQ, "version": VERSION,
     "sha256": <hex sha256 of payload>, "bytes": len(payload), "public_key": <64 hex>}

So one signature binds the bytes to the worker's key, its claimed worker id, the run, the
sequence number and the policy version: a batch copied under another name, another run or
another number no longer matches its header, and a header moved onto other bytes no longer
matches the hash. :func:`open_sealed` checks the signature against the key the header carries
(self-consistency); *whether that key may upload as that worker id* is the roster's business.

Roster (``<run>/workers.json``, kind ``"workers"``, signed by the run's key)
--------------------------------------------------------------------------
``{"format": "stoa.workers/1", "run", "revision", "time", "enrolled": {KEY_ID: {...}}, "banned":
{KEY_ID: {...}}}``. An enrolled entry binds one public key to one worker id. A run configured
``[trust] mode = "enrolled"`` takes batches only from enrolled keys, each under its own id; a run
configured ``"open"`` takes any key and binds a worker id to the first key that uses it (trust on
first use), recording the binding in the roster. A banned key is refused in both modes. The
trainer and ``stoa enroll`` / ``stoa ban`` update the roster by read-modify-write (each bumps
``revision``); the trainer re-applies its own bans whenever it writes, so a concurrent edit can
delay, never undo, a ban.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stoa.transport import layout
from stoa.transport.signing import (
    SignatureError,
    generate_private_key,
    key_id,
    load_private_key,
    load_public_key,
    open_document,
    read_signed,
    save_keypair,
    sign_document,
)
from stoa.transport.store import ObjectStore, validate_key

__all__ = [
    "Ban",
    "BatchSeal",
    "Roster",
    "SealError",
    "WorkerEntry",
    "ban_worker",
    "enroll_worker",
    "is_sealed",
    "load_or_create_worker_key",
    "open_sealed",
    "public_hex",
    "read_roster",
    "roster_key",
    "seal_batch",
    "update_roster",
    "write_roster",
]

_MAGIC = b"STSB\x01"
_HEADER = struct.Struct(">I")
_MAX_HEADER = 16 << 10
_SEAL_FORMAT = "stoa.batch-seal/1"
_SEAL_KIND = "rollout-batch"
_ROSTER_FORMAT = "stoa.workers/1"
_ROSTER_KIND = "workers"
_MAX_ROSTER = 4096
_MAX_ROSTER_BYTES = 4 << 20
_MAX_NOTE = 256
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_WORKER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MAX_NUM = 10**12 - 1


class SealError(SignatureError):
    """A sealed batch does not verify: not sealed, a malformed header, a bad signature, or a
    payload that does not match the header's hash. The message says which."""


def public_hex(key: Any) -> str:
    """The 64-hex-character raw public key of a private or public key (or anything that loads as one)."""
    pub = load_public_key(key)
    from cryptography.hazmat.primitives import serialization

    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def load_or_create_worker_key(path: str | os.PathLike[str]) -> Any:
    """The worker key at ``path`` (``<name>.key``), made (mode 0600, with ``<name>.pub``) if absent."""
    p = Path(path).expanduser()
    if not p.exists():
        try:
            save_keypair(generate_private_key(), p.parent, p.name.removesuffix(".key"))
        except FileExistsError:  # another process made it meanwhile
            pass
    return load_private_key(p)


# ---------------------------------------------------------------------------------------------
# Sealed batches
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchSeal:
    """The verified header of a sealed batch (see the module docstring)."""

    run: str
    worker_id: str
    seq: int
    version: int
    sha256: str
    """Hex sha256 of the payload (the episode batch bytes)."""
    size: int
    public_key: str
    """The signer's raw public key, 64 hex characters."""
    key_id: str
    """:func:`stoa.transport.signing.key_id` of that key (16 hex characters)."""


def seal_batch(payload: bytes, *, run: str, worker_id: str, seq: int, version: int, private_key: Any) -> bytes:
    """``payload`` with a header signed by the worker's ``private_key`` (see the module docstring)."""
    key = load_private_key(private_key)
    body = {"format": _SEAL_FORMAT, "run": run, "worker_id": worker_id, "seq": int(seq), "version": int(version),
            "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload), "public_key": public_hex(key)}
    header = sign_document(_SEAL_KIND, body, key)
    return _MAGIC + _HEADER.pack(len(header)) + header + payload


def is_sealed(blob: bytes) -> bool:
    """Whether ``blob`` starts like a sealed batch (not whether it verifies)."""
    return blob[: len(_MAGIC)] == _MAGIC


def open_sealed(blob: bytes, where: str = "batch") -> tuple[BatchSeal, bytes]:
    """Verify a sealed batch; return its header and payload.

    Checks the framing, the header's signature against the public key it names, its fields'
    types, and the payload's size and sha256. Raises :class:`SealError` (never anything else for
    untrusted bytes); who the key belongs to is not checked here.
    """
    if not is_sealed(blob):
        raise SealError(f"{where}: not a sealed batch (no worker signature)")
    start = len(_MAGIC) + _HEADER.size
    if len(blob) < start:
        raise SealError(f"{where}: truncated seal")
    (n,) = _HEADER.unpack_from(blob, len(_MAGIC))
    if n > _MAX_HEADER or len(blob) < start + n:
        raise SealError(f"{where}: seal header of {n} bytes is over {_MAX_HEADER} or truncated")
    header, payload = blob[start:start + n], blob[start + n:]
    try:  # the claimed key, read before verifying; open_document then checks the signature with it
        claimed = json.loads(json.loads(header)["body"])["public_key"]
    except Exception:
        raise SealError(f"{where}: seal header does not name a public key") from None
    if not isinstance(claimed, str) or not _HEX64.fullmatch(claimed):
        raise SealError(f"{where}: seal header's public key is not 64 lower-case hex characters")
    try:
        pub = load_public_key(bytes.fromhex(claimed))
        body = open_document(header, _SEAL_KIND, pub, where)
    except SignatureError as e:
        raise SealError(str(e)) from None
    except ValueError as e:  # not a valid curve point
        raise SealError(f"{where}: seal header's public key does not load: {e}") from None
    types = {"format": str, "run": str, "worker_id": str, "seq": int, "version": int, "sha256": str, "bytes": int,
             "public_key": str}
    if set(body) != set(types) or any(not isinstance(body[k], t) or isinstance(body[k], bool) for k, t in types.items()):
        raise SealError(f"{where}: seal body has the wrong fields (expected {sorted(types)})")
    if body["format"] != _SEAL_FORMAT:
        raise SealError(f"{where}: seal format {body['format'][:40]!r} is not {_SEAL_FORMAT!r}")
    if not (0 <= body["seq"] <= _MAX_NUM and 0 <= body["version"] <= _MAX_NUM):
        raise SealError(f"{where}: seal seq/version out of range")
    if body["bytes"] != len(payload) or hashlib.sha256(payload).hexdigest() != body["sha256"]:
        raise SealError(f"{where}: payload does not match the seal's sha256 (altered after signing)")
    seal = BatchSeal(body["run"][:1024], body["worker_id"][:128], body["seq"], body["version"], body["sha256"],
                     body["bytes"], claimed, key_id(pub))
    return seal, payload


# ---------------------------------------------------------------------------------------------
# Roster
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerEntry:
    """An enrolled worker key."""

    public_key: str
    """Raw public key, 64 hex characters."""
    worker_id: str
    """The one worker id this key uploads as."""
    time: float = 0.0
    """When it was enrolled (the enroller's clock)."""
    source: str = "enrolled"
    """``"enrolled"`` (``stoa enroll``) or ``"first-use"`` (bound by the trainer in an open run)."""
    note: str = ""


@dataclass(frozen=True)
class Ban:
    """A banned worker key."""

    worker_id: str
    reason: str
    time: float = 0.0
    version: int = -1
    """The trainer's policy version when it banned the key (-1: banned by hand)."""


@dataclass(frozen=True)
class Roster:
    """The run's signed list of enrolled and banned worker keys (see the module docstring)."""

    run: str
    enrolled: dict[str, WorkerEntry] = field(default_factory=dict)
    """key id -> entry."""
    banned: dict[str, Ban] = field(default_factory=dict)
    """key id -> ban."""
    revision: int = 0
    time: float = 0.0

    def key_for(self, worker_id: str) -> str | None:
        """The key id enrolled (or bound) under ``worker_id``, if any."""
        for kid, e in self.enrolled.items():
            if e.worker_id == worker_id:
                return kid
        return None

    def to_body(self) -> dict[str, Any]:
        return {"format": _ROSTER_FORMAT, "run": self.run, "revision": self.revision, "time": self.time,
                "enrolled": {k: vars(e).copy() for k, e in sorted(self.enrolled.items())},
                "banned": {k: vars(b).copy() for k, b in sorted(self.banned.items())}}

    @classmethod
    def parse(cls, body: Any, *, run: str, where: str) -> Roster:
        """Check a verified roster body for ``run``; raises :class:`SignatureError`."""
        if not isinstance(body, dict) or body.get("format") != _ROSTER_FORMAT or body.get("run") != run:
            raise SignatureError(f"{where}: not a {_ROSTER_FORMAT} document for run {run!r}")
        enrolled, banned = body.get("enrolled"), body.get("banned")
        rev, t = body.get("revision"), body.get("time")
        if not isinstance(enrolled, dict) or not isinstance(banned, dict) or len(enrolled) + len(banned) > 2 * _MAX_ROSTER:
            raise SignatureError(f"{where}: enrolled and banned must be maps of at most {_MAX_ROSTER} keys")
        if isinstance(rev, bool) or not isinstance(rev, int) or rev < 0 or not _finite(t):
            raise SignatureError(f"{where}: bad revision or time")
        out_e, out_b = {}, {}
        for kid, e in enrolled.items():
            try:
                entry = WorkerEntry(**e)
                ok = (_HEX16.fullmatch(kid) and _HEX64.fullmatch(entry.public_key)
                      and key_id(load_public_key(bytes.fromhex(entry.public_key))) == kid
                      and _WORKER_RE.fullmatch(entry.worker_id) and _finite(entry.time)
                      and entry.source in ("enrolled", "first-use") and isinstance(entry.note, str))
            except Exception:
                ok = False
            if not ok:
                raise SignatureError(f"{where}: malformed enrolled entry {kid[:20]!r}")
            out_e[kid] = entry
        for kid, b in banned.items():
            try:
                ban = Ban(**b)
                ok = (_HEX16.fullmatch(kid) and isinstance(ban.worker_id, str) and isinstance(ban.reason, str)
                      and _finite(ban.time) and isinstance(ban.version, int) and not isinstance(ban.version, bool))
            except Exception:
                ok = False
            if not ok:
                raise SignatureError(f"{where}: malformed ban {kid[:20]!r}")
            out_b[kid] = ban
        return cls(run, out_e, out_b, rev, float(t))

    def with_entry(self, kid: str, entry: WorkerEntry) -> Roster:
        if kid not in self.enrolled and len(self.enrolled) >= _MAX_ROSTER:
            raise ValueError(f"the roster is full ({_MAX_ROSTER} keys)")
        return replace(self, enrolled={**self.enrolled, kid: entry})

    def without(self, kids: set[str]) -> Roster:
        """The roster less the enrolled entries of ``kids`` (their bans, if any, stay)."""
        return replace(self, enrolled={k: e for k, e in self.enrolled.items() if k not in kids})

    def with_ban(self, kid: str, ban: Ban) -> Roster:
        if kid not in self.banned and len(self.banned) >= _MAX_ROSTER:
            raise ValueError(f"the ban list is full ({_MAX_ROSTER} keys)")
        return replace(self, banned={**self.banned, kid: ban})


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def roster_key(run: str) -> str:
    """``<run>/workers.json``."""
    return validate_key(layout.roster(run.strip("/")))


def read_roster(store: ObjectStore, run: str, public_key: Any) -> Roster:
    """The verified roster (an empty one when none was written yet).

    Raises:
        SignatureError: the document exists but does not verify under the run's key.
        stoa.transport.store.StoreError: the store failed.
    """
    run = run.strip("/")
    body = read_signed(store, roster_key(run), _ROSTER_KIND, public_key, expect={"run": run},
                       max_bytes=_MAX_ROSTER_BYTES)
    return Roster(run) if body is None else Roster.parse(body, run=run, where=roster_key(run))


def write_roster(store: ObjectStore, run: str, roster: Roster, private_key: Any) -> None:
    """Sign ``roster`` with the run's key and put it at ``<run>/workers.json``."""
    store.put(roster_key(run), sign_document(_ROSTER_KIND, roster.to_body(), private_key))


def update_roster(store: ObjectStore, run: str, private_key: Any, change: Callable[[Roster], Roster]) -> Roster:
    """Read the roster, apply ``change``, write it with the next revision; returns what was written."""
    key = load_private_key(private_key)
    new = change(read_roster(store, run, key.public_key()))
    new = replace(new, revision=new.revision + 1, time=time.time())
    write_roster(store, run, new, key)
    return new


def enroll_worker(store: ObjectStore, run: str, private_key: Any, worker_public_key: Any, worker_id: str,
                  note: str = "") -> Roster:
    """Enroll a worker key under ``worker_id`` (what ``stoa enroll`` does).

    Raises:
        ValueError: ``worker_id`` is already bound to another key, or the key is banned.
    """
    if not _WORKER_RE.fullmatch(worker_id):
        raise ValueError(f"worker id {worker_id!r} must be 1-64 characters of [A-Za-z0-9._-]")
    pub = public_hex(worker_public_key)
    kid = key_id(load_public_key(bytes.fromhex(pub)))

    def change(r: Roster) -> Roster:
        if kid in r.banned:
            raise ValueError(f"key {kid} is banned ({r.banned[kid].reason[:120]})")
        other = r.key_for(worker_id)
        if other is not None and other != kid:
            raise ValueError(f"worker id {worker_id!r} is already bound to key {other}")
        return r.with_entry(kid, WorkerEntry(pub, worker_id, time.time(), "enrolled", note[:_MAX_NOTE]))

    return update_roster(store, run, private_key, change)


def ban_worker(store: ObjectStore, run: str, private_key: Any, who: str, reason: str, version: int = -1) -> Roster:
    """Ban a worker key, named by key id or by the worker id it is enrolled under (``stoa ban``).

    Raises:
        KeyError: ``who`` names no enrolled key (a key id is banned even when not enrolled).
    """
    def change(r: Roster) -> Roster:
        kid = who if _HEX16.fullmatch(who) else r.key_for(who)
        if kid is None:
            raise KeyError(f"no key is enrolled as {who!r}; ban it by key id")
        wid = r.enrolled[kid].worker_id if kid in r.enrolled else ""
        return r.with_ban(kid, Ban(wid, reason[:_MAX_NOTE], time.time(), version))

    return update_roster(store, run, private_key, change)
