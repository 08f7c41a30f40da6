"""Invites and worker identity: what a volunteer needs to join, and who the worker is across restarts.

An invite (``stoa invite`` writes it, ``stoa worker --invite FILE`` reads it) is a small JSON file::

    {"format": "stoa.invite/1", "store": "s3://bucket/prefix?endpoint=...", "run": "myrun",
     "public_key": "<64 hex: the run's ed25519 public key>",
     "worker_id": "alice-mac" (optional), "worker_key": "<64 hex: a worker's private key>" (optional)}

It carries no store credentials (those stay in the volunteer's environment). With a worker key
(made and enrolled by the operator) it is a secret: whoever holds it uploads as that worker.
:func:`read_invite` checks every field before anything is done with it: the store URL (one line,
at most 2,048 characters), the run name (a store prefix without ``.`` or ``..`` parts), the keys
(64 hex characters), and the worker id by the rule every writer uses (1-64 of ``[A-Za-z0-9._-]``,
not starting with ``.``, ``_`` or ``-``), so no invite can name a path outside the worker's cache.

Identity: a worker is its key. Without ``--key`` (and without a key in the invite) the key is
``$XDG_CONFIG_HOME/stoa/worker.key`` (``~/.config/stoa/worker.key``), made on first start; the
default worker id is ``w-<key id>`` and the default cache ``$XDG_CACHE_HOME/stoa/<run>/<id>``.
So a restarted worker keeps its key, id, sequence numbers (continued after its own newest
sealed batch) and its kept weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.transport import layout
from stoa.transport.signing import key_id, load_private_key, load_public_key
from stoa.transport.store import validate_key

__all__ = ["Invite", "check_run", "check_worker_id", "default_cache_dir", "default_key_path", "default_worker_id",
           "read_invite", "write_invite"]

INVITE_FORMAT = "stoa.invite/1"
_MAX_INVITE_BYTES = 64 << 10
_FIELDS = {"format", "store", "run", "public_key", "worker_id", "worker_key"}


def check_worker_id(worker_id: Any) -> str:
    """``worker_id`` if it is one (1-64 of ``[A-Za-z0-9._-]``, not starting with ``.``, ``_`` or
    ``-``: never a path); raises ValueError."""
    if not isinstance(worker_id, str) or not layout.WORKER_ID.fullmatch(worker_id):
        raise ValueError(f"worker id {str(worker_id)[:80]!r} must be 1-64 characters of [A-Za-z0-9._-], "
                         "not starting with . _ or -")
    return worker_id


def check_run(run: Any) -> str:
    """``run`` if it is a run name: a store prefix of ``/``-separated parts, none ``.`` or ``..``
    (:func:`stoa.transport.store.validate_key`); raises ValueError."""
    if not isinstance(run, str) or not run.strip("/"):
        raise ValueError("the run name is empty")
    validate_key(run.strip("/"))
    return run


@dataclass(frozen=True)
class Invite:
    """What ``stoa worker --invite`` needs to join a run."""

    store: str
    """The store URL workers use (a path, ``file://``, ``s3://bucket/prefix?endpoint=...``)."""
    run: str
    """The run name (its prefix in the store)."""
    public_key: str
    """The run's ed25519 public key, 64 hex characters."""
    worker_id: str | None = None
    """The id the enrolled key uploads as (with ``worker_key``)."""
    worker_key: str | None = None
    """A worker private key (64 hex) the operator enrolled for this volunteer, or None."""

    def to_json(self) -> str:
        body = {"format": INVITE_FORMAT, "store": self.store, "run": self.run, "public_key": self.public_key}
        if self.worker_key is not None:
            body.update(worker_id=self.worker_id, worker_key=self.worker_key)
        return json.dumps(body, indent=1) + "\n"


def write_invite(path: str | os.PathLike[str], invite: Invite) -> Path:
    """Write ``invite`` (mode 0600 when it holds a worker key); refuses to overwrite a file."""
    p = Path(path).expanduser()
    mode = 0o600 if invite.worker_key else 0o644
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(invite.to_json())
    return p


def read_invite(path: str | os.PathLike[str]) -> Invite:
    """Read and check an invite file, field by field; raises ``ValueError`` (or ``OSError``)
    naming what is wrong. Nothing is written and nothing is opened from it before it passes."""
    p = Path(path).expanduser()
    if p.stat().st_size > _MAX_INVITE_BYTES:
        raise ValueError(f"{p} is not an invite (over {_MAX_INVITE_BYTES} bytes)")
    try:
        body = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not an invite (not JSON: {e})") from None
    if not isinstance(body, dict) or body.get("format") != INVITE_FORMAT:
        raise ValueError(f"{p} is not a {INVITE_FORMAT} invite")
    unknown = sorted(str(k)[:40] for k in body if k not in _FIELDS)
    if unknown:
        raise ValueError(f"{p}: the invite has fields no invite has: {', '.join(unknown)}")
    for k in ("store", "run", "public_key"):
        if not isinstance(body.get(k), str) or not body[k]:
            raise ValueError(f"{p}: the invite has no {k!r}")
    store = body["store"]
    if len(store) > 2048 or any(ord(c) < 32 or ord(c) == 127 for c in store):
        raise ValueError(f"{p}: the invite's store is not one line of at most 2,048 characters")
    try:
        check_run(body["run"])
    except ValueError as e:
        raise ValueError(f"{p}: the invite's run name is not one: {e}") from None
    if not layout.HEX64.fullmatch(body["public_key"]):
        raise ValueError(f"{p}: the invite's public_key is not 64 lower-case hex characters")
    load_public_key(body["public_key"])  # raises ValueError on a bad key
    wkey, wid = body.get("worker_key"), body.get("worker_id")
    if wkey is None and wid is not None:
        raise ValueError(f"{p}: the invite names a worker_id without a worker_key")
    if wkey is not None:
        if not isinstance(wkey, str) or not layout.HEX64.fullmatch(wkey):
            raise ValueError(f"{p}: the invite's worker_key is not 64 lower-case hex characters")
        load_private_key(wkey)
        try:
            check_worker_id(wid)
        except ValueError as e:
            raise ValueError(f"{p}: the invite's {e}") from None
    return Invite(store, body["run"], body["public_key"], wid if wkey is not None else None, wkey)


def default_key_path() -> Path:
    """``$XDG_CONFIG_HOME/stoa/worker.key`` (``~/.config/stoa/worker.key``): this machine's worker key."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "stoa" / "worker.key"


def default_worker_id(private_key: Any) -> str:
    """``w-<key id>``: the same id on every start with the same key."""
    return f"w-{key_id(load_private_key(private_key).public_key())}"


def default_cache_dir(run: str, worker_id: str) -> Path:
    """``$XDG_CACHE_HOME/stoa/<run>/<worker id>`` (``~/.cache/...``): model files and kept weights.
    Raises ValueError for a run or worker id that is not one (it would name another folder)."""
    safe_run = check_run(run).strip("/").replace("/", "_")
    check_worker_id(worker_id)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stoa" / safe_run / worker_id
