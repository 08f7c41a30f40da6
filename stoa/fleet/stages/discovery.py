"""Finding a pipeline's stages through the run's store, and knowing whose they are.

A stage process announces itself at ``<run>/stages/<pipeline>/<i>.json``
(:func:`stoa.transport.layout.stage`) and rewrites the announcement every
:data:`ANNOUNCE_EVERY_S` seconds while it serves; the driver announces itself as stage 0 (no
address: the stages never connect to it). An announcement is a document signed with the
announcer's own ed25519 key, and carries that key and its TLS certificate
(:func:`stoa.fleet.stages.tls.certificate`): :func:`read_announcement` returns it only when the
signature, the key id and the certificate all agree, so whoever can write to the store can
replace an announcement but not speak for another key. Which keys a driver and a stage accept
is theirs to say (:class:`Allowed`); the link itself is mutual TLS pinned to those keys
(:mod:`stoa.fleet.stages.tls`). The driver still checks what the stage then says (its layers,
its share hashes against the signed manifest before every cohort), and the trainer re-derives
every episode.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

from stoa.fleet.stages.tls import certificate, certificate_key
from stoa.transport import layout
from stoa.transport.signing import (
    SignatureError,
    key_id,
    load_private_key,
    load_public_key,
    open_document,
    sign_document,
)
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge

__all__ = ["ANNOUNCE_EVERY_S", "STALE_AFTER_S", "Allowed", "Announcement", "announce", "read_announcement",
           "check_pipeline_id", "parse_advertise"]

ANNOUNCE_EVERY_S = 5.0
STALE_AFTER_S = 30.0
"""An announcement not rewritten for this long belongs to a stage that left."""
_MAX_BYTES = 8192
FORMAT = "stoa.stage.announce/2"
KIND = "stage-announcement"


def check_pipeline_id(name: str) -> str:
    """``name`` if it can name a pipeline (the worker id rule), else ValueError."""
    if not isinstance(name, str) or not layout.WORKER_ID.fullmatch(name):
        raise ValueError(f"a pipeline id is 1-64 characters of [A-Za-z0-9._-], not {str(name)[:80]!r}")
    return name


def parse_advertise(text: str) -> tuple[str, int | None]:
    """``(host, port or None)`` from ``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT``: the address a
    stage announces when the driver reaches it through a forwarded port or a proxy. A bare IPv6
    address (more than one colon) is a host without a port. ValueError on anything else."""
    if not isinstance(text, str) or not 0 < len(text) <= 300 or any(c.isspace() for c in text):
        raise ValueError(f"--advertise is HOST or HOST:PORT, not {str(text)[:80]!r}")
    port: str | None = None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"--advertise {text[:80]!r}: an IPv6 address is written [ADDR] or [ADDR]:PORT")
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host = text
    if not 0 < len(host) <= 255 or "/" in host:
        raise ValueError(f"--advertise {text[:80]!r}: the host must be 1-255 characters, without '/'")
    if port is None:
        return host, None
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"--advertise {text[:80]!r}: the port must be a number from 1 to 65535")
    return host, int(port)


@dataclass(frozen=True)
class Allowed:
    """Which keys one side of a pipeline accepts at the other end: the key ids named by its
    operator (``--stage-keys`` on a driver, ``--driver-key`` on a stage), and every key enrolled in
    the run's signed roster (``stoa enroll``: the run's operator vouches for it)."""

    named: frozenset[str] = frozenset()
    enrolled: Collection[str] = frozenset()

    def refusal(self, kid: str, what: str) -> str | None:
        """Why ``what`` (e.g. "stage 1") with key ``kid`` is not accepted, or None."""
        if kid in self.named or kid in self.enrolled:
            return None
        return (f"{what} has key {kid}, which is neither named here ({sorted(self.named) or 'no key named'}) nor "
                "enrolled in the run's roster: pass its key id (--stage-keys on the driver, --driver-key on a stage) "
                "or enroll it (stoa enroll)")


@dataclass(frozen=True)
class Announcement:
    """Where stage ``index`` of ``stages`` (layers ``part``) of a pipeline listens, and whose it is
    (stage 0: the driver, which listens nowhere: ``host`` empty, ``port`` 0)."""

    index: int
    stages: int
    part: tuple[int, int]
    host: str
    port: int
    key_id: str
    """The announcer's key id (the signature is checked against :attr:`key`, whose id this is)."""
    time: float
    """When the stage last wrote this (its clock)."""
    key: str = ""
    """The announcer's ed25519 public key, 64 hex characters."""
    cert: str = ""
    """Its TLS certificate, PEM (:func:`stoa.fleet.stages.tls.certificate`)."""

    def stale(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) - self.time > STALE_AFTER_S


def announce(store: ObjectStore, run: str, pipeline: str, a: Announcement, private_key: Any) -> None:
    """Write ``a`` signed with ``private_key``, whose key, id and certificate it is made to carry."""
    key = load_private_key(private_key)
    pub = key.public_key()
    raw = pub.public_bytes_raw().hex()
    body = {"format": FORMAT, **asdict(a), "part": list(a.part), "key_id": key_id(pub), "key": raw,
            "cert": certificate(key).decode("ascii")}
    store.put(layout.stage(run, check_pipeline_id(pipeline), a.index), sign_document(KIND, body, key))


def _int(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _host(v: object) -> bool:
    """An announced host: at most 255 printable ASCII characters, no white space (what a log line
    can show as it is, and what ``--advertise`` accepts)."""
    return isinstance(v, str) and len(v) <= 255 and all("!" <= c <= "~" for c in v)


def _signer(raw: bytes, where: str) -> Any:
    """The public key an announcement's body says signed it (checked by the signature after)."""
    try:
        env = json.loads(raw)
        body = json.loads(env["body"])
        return load_public_key(bytes.fromhex(body["key"]))
    except Exception:  # noqa: BLE001 - a stranger's bytes: any failure is "not an announcement"
        raise ValueError(f"{where} is not a signed stage announcement: {raw[:200]!r}") from None


def read_announcement(store: ObjectStore, run: str, pipeline: str, index: int) -> Announcement | None:
    """Stage ``index``'s announcement, or None when there is none. Its signature is checked
    against the key it carries, and that key's id and certificate against its fields: an
    announcement is its key's word (which keys to accept is :class:`Allowed`'s business).

    Raises:
        ValueError: the object is too large, not a signed announcement of stage ``index``, or its
            key, id, signature and certificate do not agree.
        StoreError: the store failed.
    """
    key = layout.stage(run, check_pipeline_id(pipeline), index)
    try:
        raw = store.get(key, max_bytes=_MAX_BYTES)
    except KeyNotFound:
        return None
    except ObjectTooLarge:
        raise ValueError(f"{key} is over {_MAX_BYTES} bytes") from None
    pub = _signer(raw, key)
    try:
        d = open_document(raw, KIND, pub, key)
    except SignatureError as e:
        raise ValueError(str(e)) from None
    fields = {"format", "index", "stages", "part", "host", "port", "key_id", "time", "key", "cert"}
    first = index == 0  # the driver: no address
    if not (isinstance(d, dict) and set(d) == fields and d["format"] == FORMAT and d["index"] == index
            and _int(d["stages"], 2, 4096) and index < d["stages"]
            and isinstance(d["part"], list) and len(d["part"]) == 2 and all(_int(x, 0, 1 << 20) for x in d["part"])
            and d["part"][0] < d["part"][1] and _host(d["host"]) and (first or len(d["host"]) > 0) and _int(d["port"], 0 if first else 1, 65535)
            and d["key_id"] == key_id(pub) and isinstance(d["cert"], str) and len(d["cert"]) <= 2048
            and isinstance(d["time"], (int, float)) and not isinstance(d["time"], bool)):
        raise ValueError(f"{key} is not a stage announcement of stage {index}: {raw[:200]!r}")
    try:
        same = certificate_key(d["cert"].encode("ascii")).public_bytes_raw() == pub.public_bytes_raw()
    except (ValueError, UnicodeEncodeError):
        same = False
    if not same:
        raise ValueError(f"{key}: its certificate is not of the key that signed it")
    return Announcement(d["index"], d["stages"], (d["part"][0], d["part"][1]), d["host"], d["port"], d["key_id"],
                        float(d["time"]), d["key"], d["cert"])

