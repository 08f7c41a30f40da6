"""Worker identity: worker keys, sealed (signed) rollout batches, and the run's roster of workers.

Workers are strangers. Each has its own ed25519 key pair (``stoa keygen --worker``, or one a
worker makes on first start and keeps in its cache folder) and signs every batch it uploads; the
trainer decides whose batches it takes from the run's **roster**, a document signed with the
run's key that lists enrolled worker keys, and from the run's **ban documents**, one per banned key.

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
``{"format": "stoa.workers/2", "run", "revision", "time", "enrolled": {KEY_ID: {...}}}``. An
enrolled entry binds one public key to one worker id. A run configured ``[trust] mode =
"enrolled"`` takes batches only from enrolled keys, each under its own id; a run configured
``"open"`` takes any key and binds a worker id to the first key whose batch under it is accepted,
recording the binding in the roster. The trainer and ``stoa enroll`` update the roster by
read-modify-write (each bumps ``revision``). It holds at most 4,096 keys and no bans, so it stays
small and readable however many keys are banned.

Bans (``<run>/bans/<KEY_ID>.json``, kind ``"ban"``, signed by the run's key)
--------------------------------------------------------------------------
One small document per banned key, written once and never dropped: ``{"format": "stoa.ban/1",
"run", "key_id", "worker_id", "code", "detail", "time", "version"}``. ``code`` says why in one
word (``audit``, ``sampling``, ``strikes``, ``by-hand``, ...); ``detail`` is at most 240
printable ASCII characters (nothing a worker wrote reaches it unbounded). A ban costs one small
write whatever the number of bans; a worker reads only its own (:func:`read_ban`); the trainer
keeps every ban it made in its run folder too, so a restart (from any checkpoint) forgets none.
A banned key is refused in both modes. (Rosters of format ``stoa.workers/1`` listed bans inline;
they are read, and the trainer moves their bans into ban documents.)

Assignment salts (``<run>/salts/<KEY_ID>.json``, kind ``"assignment-salt"``)
--------------------------------------------------------------------------
``{"format": "stoa.salt/1", "run", "key_id", "salt"}``: the per-key secret that
:mod:`stoa.fleet.trust.assign` mixes into a key's assigned work. It is a keyed hash of the key id
under the run's private key (:func:`assignment_salt`), so nobody can compute it before the run
publishes it, which it does only for a key with standing (enrolled, or with accepted work).
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
from stoa.transport.manifest import MAX_VERSION
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
from stoa.transport.store import ObjectStore, StoreError, validate_key

__all__ = [
    "Ban",
    "BatchSeal",
    "Roster",
    "SealError",
    "WorkerEntry",
    "assignment_salt",
    "ban_worker",
    "enroll_worker",
    "is_sealed",
    "list_bans",
    "load_or_create_worker_key",
    "open_sealed",
    "printable",
    "public_hex",
    "read_ban",
    "read_roster",
    "read_salt",
    "roster_key",
    "seal_batch",
    "update_roster",
    "write_ban",
    "write_roster",
    "write_salt",
]

_MAGIC = b"STSB\x01"
_HEADER = struct.Struct(">I")
_MAX_HEADER = 16 << 10
_SEAL_FORMAT = "stoa.batch-seal/1"
_SEAL_KIND = "rollout-batch"
_ROSTER_FORMAT = "stoa.workers/2"
_LEGACY_ROSTER_FORMAT = "stoa.workers/1"  # bans inline; read, never written
_ROSTER_KIND = "workers"
_BAN_FORMAT, _BAN_KIND = "stoa.ban/1", "ban"
_SALT_FORMAT, _SALT_KIND = "stoa.salt/1", "assignment-salt"
_MAX_DETAIL = 240
_CODE_RE = re.compile(r"[a-z][a-z0-9-]{0,23}")
_MAX_ROSTER = 4096
_MAX_ROSTER_BYTES = 4 << 20
_MAX_NOTE = 256


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
    if not isinstance(claimed, str) or not layout.HEX64.fullmatch(claimed):
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
    if not (layout.is_seq(body["seq"]) and 0 <= body["version"] <= MAX_VERSION):
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


def printable(text: Any, limit: int = _MAX_DETAIL) -> str:
    """``text`` as at most ``limit`` printable ASCII characters: any other character (control,
    format, non-ASCII) becomes ``?``, and each run of white space one space."""
    out = "".join(c if " " <= c <= "~" else "?" for c in str(text)[: 4 * limit])
    out = " ".join(out.split())
    return out if len(out) <= limit else out[: limit - 3] + "..."


@dataclass(frozen=True)
class Ban:
    """A banned worker key (see the module docstring): why in one word, and a bounded detail."""

    worker_id: str
    code: str
    """``audit``, ``sampling``, ``strikes``, ``by-hand``, ... (lower case, at most 24 characters)."""
    detail: str = ""
    """At most 240 printable ASCII characters."""
    time: float = 0.0
    version: int = -1
    """The trainer's policy version when it banned the key (-1: banned by hand)."""

    @classmethod
    def of(cls, worker_id: str, code: str, detail: str, time: float = 0.0, version: int = -1) -> Ban:
        """A ban with its fields made safe: an id that is not a worker id becomes ``""``, the code
        a known shape, the detail :func:`printable`."""
        wid = worker_id if isinstance(worker_id, str) and layout.WORKER_ID.fullmatch(worker_id) else ""
        code = code if isinstance(code, str) and _CODE_RE.fullmatch(code) else "banned"
        v = version if isinstance(version, int) and not isinstance(version, bool) else -1
        return cls(wid, code, printable(detail), float(time) if _finite(time) else 0.0, v)

    @property
    def reason(self) -> str:
        """``code: detail`` (the detail alone when it already starts so; the code alone without one)."""
        if not self.detail or self.detail.startswith(f"{self.code}:"):
            return self.detail or self.code
        return f"{self.code}: {self.detail}"

    def ok(self) -> bool:
        """Whether every field has the shape :meth:`of` gives it."""
        return (isinstance(self.worker_id, str) and (self.worker_id == "" or bool(layout.WORKER_ID.fullmatch(self.worker_id)))
                and isinstance(self.code, str) and bool(_CODE_RE.fullmatch(self.code))
                and isinstance(self.detail, str) and self.detail == printable(self.detail) and _finite(self.time)
                and isinstance(self.version, int) and not isinstance(self.version, bool))


@dataclass(frozen=True)
class Roster:
    """The run's signed list of enrolled worker keys (see the module docstring)."""

    run: str
    enrolled: dict[str, WorkerEntry] = field(default_factory=dict)
    """key id -> entry."""
    revision: int = 0
    time: float = 0.0
    legacy_bans: dict[str, Ban] = field(default_factory=dict)
    """Bans listed inline by a ``stoa.workers/1`` roster (read, never written; the trainer moves
    them into ban documents)."""

    def key_for(self, worker_id: str) -> str | None:
        """The key id enrolled (or bound) under ``worker_id``, if any."""
        for kid, e in self.enrolled.items():
            if e.worker_id == worker_id:
                return kid
        return None

    def to_body(self) -> dict[str, Any]:
        return {"format": _ROSTER_FORMAT, "run": self.run, "revision": self.revision, "time": self.time,
                "enrolled": {k: vars(e).copy() for k, e in sorted(self.enrolled.items())}}

    @classmethod
    def parse(cls, body: Any, *, run: str, where: str) -> Roster:
        """Check a verified roster body for ``run``; raises :class:`SignatureError`."""
        fmt = body.get("format") if isinstance(body, dict) else None
        if fmt not in (_ROSTER_FORMAT, _LEGACY_ROSTER_FORMAT) or body.get("run") != run:
            raise SignatureError(f"{where}: not a {_ROSTER_FORMAT} document for run {run!r}")
        enrolled, banned = body.get("enrolled"), body.get("banned", {}) if fmt == _LEGACY_ROSTER_FORMAT else {}
        rev, t = body.get("revision"), body.get("time")
        if not isinstance(enrolled, dict) or not isinstance(banned, dict) or len(enrolled) > _MAX_ROSTER \
                or len(banned) > _MAX_ROSTER:
            raise SignatureError(f"{where}: enrolled (and banned) must be maps of at most {_MAX_ROSTER} keys")
        if isinstance(rev, bool) or not isinstance(rev, int) or rev < 0 or not _finite(t):
            raise SignatureError(f"{where}: bad revision or time")
        out_e, out_b = {}, {}
        for kid, e in enrolled.items():
            try:
                entry = WorkerEntry(**e)
                ok = (layout.KEY_ID.fullmatch(kid) and layout.HEX64.fullmatch(entry.public_key)
                      and key_id(load_public_key(bytes.fromhex(entry.public_key))) == kid
                      and layout.WORKER_ID.fullmatch(entry.worker_id) and _finite(entry.time)
                      and entry.source in ("enrolled", "first-use") and isinstance(entry.note, str))
            except Exception:
                ok = False
            if not ok:
                raise SignatureError(f"{where}: malformed enrolled entry {kid[:20]!r}")
            out_e[kid] = entry
        for kid, b in banned.items():  # stoa.workers/1: {worker_id, reason, time, version}
            try:
                ok = bool(layout.KEY_ID.fullmatch(kid)) and isinstance(b.get("reason"), str)
                out_b[kid] = Ban.of(b.get("worker_id", ""), "legacy", b["reason"], b.get("time", 0.0), b.get("version", -1))
            except Exception:
                ok = False
            if not ok:
                raise SignatureError(f"{where}: malformed ban {kid[:20]!r}")
        return cls(run, out_e, rev, float(t), out_b)

    def with_entry(self, kid: str, entry: WorkerEntry) -> Roster:
        if kid not in self.enrolled and len(self.enrolled) >= _MAX_ROSTER:
            raise ValueError(f"the roster is full ({_MAX_ROSTER} keys)")
        return replace(self, enrolled={**self.enrolled, kid: entry})

    def without(self, kids: set[str]) -> Roster:
        """The roster less the enrolled entries of ``kids``."""
        return replace(self, enrolled={k: e for k, e in self.enrolled.items() if k not in kids})


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
    """Enroll a worker key under ``worker_id`` (what ``stoa enroll`` does), and publish the key's
    assignment salt (so its worker can compute its assigned work at once).

    Raises:
        ValueError: ``worker_id`` is already bound to another key, or the key is banned.
    """
    if not layout.WORKER_ID.fullmatch(worker_id):
        raise ValueError(f"worker id {worker_id!r} must be 1-64 characters of [A-Za-z0-9._-]")
    key = load_private_key(private_key)
    pub = public_hex(worker_public_key)
    kid = key_id(load_public_key(bytes.fromhex(pub)))
    run = run.strip("/")
    ban = read_ban(store, run, kid, key.public_key())

    def change(r: Roster) -> Roster:
        if ban is not None or kid in r.legacy_bans:
            raise ValueError(f"key {kid} is banned ({(ban or r.legacy_bans[kid]).reason[:120]})")
        other = r.key_for(worker_id)
        if other is not None and other != kid:
            raise ValueError(f"worker id {worker_id!r} is already bound to key {other}")
        return r.with_entry(kid, WorkerEntry(pub, worker_id, time.time(), "enrolled", note[:_MAX_NOTE]))

    new = update_roster(store, run, key, change)
    write_salt(store, run, kid, key)
    return new


def ban_worker(store: ObjectStore, run: str, private_key: Any, who: str, reason: str, version: int = -1) -> Ban:
    """Ban a worker key, named by key id or by the worker id it is enrolled under (``stoa ban``):
    its ban document, then a new roster revision (which tells a live trainer to read the bans).

    Raises:
        KeyError: ``who`` names no enrolled key (a key id is banned even when not enrolled).
    """
    key = load_private_key(private_key)
    run = run.strip("/")
    roster = read_roster(store, run, key.public_key())
    kid = who if layout.KEY_ID.fullmatch(who) else roster.key_for(who)
    if kid is None:
        raise KeyError(f"no key is enrolled as {who!r}; ban it by key id")
    wid = roster.enrolled[kid].worker_id if kid in roster.enrolled else ""
    ban = Ban.of(wid, "by-hand", reason, time.time(), version)
    write_ban(store, run, kid, ban, key)
    update_roster(store, run, key, lambda r: r)
    return ban


# ---------------------------------------------------------------------------------------------
# Bans and assignment salts: one small signed document per key
# ---------------------------------------------------------------------------------------------


def write_ban(store: ObjectStore, run: str, kid: str, ban: Ban, private_key: Any) -> None:
    """Put ``kid``'s ban document (``<run>/bans/<kid>.json``), signed with the run's key."""
    if not layout.KEY_ID.fullmatch(kid) or not ban.ok():
        raise ValueError(f"not a ban to write: key {kid[:20]!r}, {ban!r:.200}")
    body = {"format": _BAN_FORMAT, "run": run.strip("/"), "key_id": kid, **vars(ban)}
    store.put(validate_key(layout.ban(run.strip("/"), kid)), sign_document(_BAN_KIND, body, private_key))


def _ban_of(body: dict[str, Any], where: str) -> Ban:
    try:
        ban = Ban(body["worker_id"], body["code"], body["detail"], body["time"], body["version"])
    except (KeyError, TypeError):
        raise SignatureError(f"{where}: not a {_BAN_FORMAT} document") from None
    if body.get("format") != _BAN_FORMAT or not ban.ok():
        raise SignatureError(f"{where}: malformed ban document")
    return ban


def read_ban(store: ObjectStore, run: str, kid: str, public_key: Any) -> Ban | None:
    """``kid``'s ban, or None when it is not banned. Raises :class:`SignatureError` (a ban document
    that does not verify) or ``StoreError``."""
    if not layout.KEY_ID.fullmatch(kid):
        return None
    run = run.strip("/")
    where = layout.ban(run, kid)
    body = read_signed(store, validate_key(where), _BAN_KIND, public_key, expect={"run": run, "key_id": kid},
                       max_bytes=16 << 10)
    return None if body is None else _ban_of(body, where)


def list_bans(store: ObjectStore, run: str, public_key: Any, known: Any = ()) -> tuple[dict[str, Ban], list[str]]:
    """``(bans, problems)``: the ban documents in the store whose key id is not in ``known``, and
    what did not verify (never raised: a planted object is reported and skipped)."""
    run = run.strip("/")
    prefix = layout.bans(run)
    out: dict[str, Ban] = {}
    problems: list[str] = []
    for k in store.list(prefix):
        kid = k[len(prefix):].removesuffix(".json")
        if kid in known or not k.endswith(".json") or not layout.KEY_ID.fullmatch(kid):
            continue
        try:
            ban = read_ban(store, run, kid, public_key)
        except (SignatureError, StoreError) as e:
            problems.append(str(e)[:300])
            continue
        if ban is not None:
            out[kid] = ban
    return out, problems


def assignment_salt(private_key: Any, run: str, kid: str) -> str:
    """The secret ``kid`` mixes into its assigned work (32 hex): a keyed hash of the key id under
    the run's private key, so only the run's key can make it, and it is the same on every call."""
    raw = load_private_key(private_key).private_bytes_raw()
    mac_key = hashlib.sha256(b"stoa-assignment-salt-key\x1f" + raw).digest()
    return hashlib.blake2b(f"stoa-assignment-salt\x1f{run.strip('/')}\x1f{kid}".encode(), key=mac_key,
                           digest_size=16).hexdigest()


def write_salt(store: ObjectStore, run: str, kid: str, private_key: Any) -> str:
    """Publish ``kid``'s assignment salt (``<run>/salts/<kid>.json``); returns it."""
    if not layout.KEY_ID.fullmatch(kid):
        raise ValueError(f"not a key id: {kid[:20]!r}")
    run = run.strip("/")
    salt = assignment_salt(private_key, run, kid)
    body = {"format": _SALT_FORMAT, "run": run, "key_id": kid, "salt": salt}
    store.put(validate_key(layout.salt(run, kid)), sign_document(_SALT_KIND, body, private_key))
    return salt


def read_salt(store: ObjectStore, run: str, kid: str, public_key: Any) -> str | None:
    """``kid``'s published assignment salt, or None while there is none. Raises
    :class:`SignatureError` (a document that does not verify) or ``StoreError``."""
    run = run.strip("/")
    where = layout.salt(run, kid)
    body = read_signed(store, validate_key(where), _SALT_KIND, public_key, expect={"run": run, "key_id": kid},
                       max_bytes=16 << 10)
    if body is None:
        return None
    salt = body.get("salt")
    if body.get("format") != _SALT_FORMAT or not isinstance(salt, str) or not layout.HEX32.fullmatch(salt):
        raise SignatureError(f"{where}: malformed assignment salt")
    return salt
