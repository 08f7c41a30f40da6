"""Finding a pipeline's stages through the run's store.

A stage process announces itself at ``<run>/stages/<pipeline>/<i>.json``
(:func:`stoa.transport.layout.stage`) and rewrites the announcement every
:data:`ANNOUNCE_EVERY_S` seconds while it serves. The driver reads the announcement of each stage
it needs and connects to the address in it. An announcement is a claim, not a credential: the
driver checks what the stage then says over the connection (its layers, and its share hashes
against the signed manifest before every cohort), and the trainer re-derives every episode.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from stoa.transport import layout
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge

__all__ = ["ANNOUNCE_EVERY_S", "STALE_AFTER_S", "Announcement", "announce", "read_announcement", "check_pipeline_id",
           "parse_advertise"]

ANNOUNCE_EVERY_S = 5.0
STALE_AFTER_S = 30.0
"""An announcement not rewritten for this long belongs to a stage that left."""
_MAX_BYTES = 4096
FORMAT = "stoa.stage.announce/1"


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
class Announcement:
    """Where stage ``index`` of ``stages`` (layers ``part``) of a pipeline listens."""

    index: int
    stages: int
    part: tuple[int, int]
    host: str
    port: int
    key_id: str
    """The stage's own key id (a label for logs and for the operator; nothing is signed with it yet)."""
    time: float
    """When the stage last wrote this (its clock)."""

    def stale(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) - self.time > STALE_AFTER_S


def announce(store: ObjectStore, run: str, pipeline: str, a: Announcement) -> None:
    body = {"format": FORMAT, **asdict(a), "part": list(a.part)}
    store.put(layout.stage(run, check_pipeline_id(pipeline), a.index), json.dumps(body, sort_keys=True).encode())


def _int(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def read_announcement(store: ObjectStore, run: str, pipeline: str, index: int) -> Announcement | None:
    """Stage ``index``'s announcement, or None when there is none.

    Raises:
        ValueError: the object is too large, not JSON, or not an announcement of stage ``index``.
        StoreError: the store failed.
    """
    key = layout.stage(run, check_pipeline_id(pipeline), index)
    try:
        raw = store.get(key, max_bytes=_MAX_BYTES)
    except KeyNotFound:
        return None
    except ObjectTooLarge:
        raise ValueError(f"{key} is over {_MAX_BYTES} bytes") from None
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{key} is not JSON: {e}") from None
    fields = {"format", "index", "stages", "part", "host", "port", "key_id", "time"}
    if not (isinstance(d, dict) and set(d) == fields and d["format"] == FORMAT and d["index"] == index
            and _int(d["stages"], 2, 4096) and index < d["stages"]
            and isinstance(d["part"], list) and len(d["part"]) == 2 and all(_int(x, 0, 1 << 20) for x in d["part"])
            and d["part"][0] < d["part"][1] and isinstance(d["host"], str) and 0 < len(d["host"]) <= 255
            and _int(d["port"], 1, 65535) and isinstance(d["key_id"], str) and len(d["key_id"]) <= 64
            and isinstance(d["time"], (int, float)) and not isinstance(d["time"], bool)):
        raise ValueError(f"{key} is not a stage announcement of stage {index}: {raw[:200]!r}")
    return Announcement(d["index"], d["stages"], (d["part"][0], d["part"][1]), d["host"], d["port"], d["key_id"],
                        float(d["time"]))
