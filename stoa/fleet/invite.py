"""Invites and worker identity: what a volunteer needs to join, and who the worker is across restarts.

An invite (``stoa invite`` writes it, ``stoa worker --invite FILE`` reads it) is a small JSON file::

    {"format": "stoa.invite/1", "store": "s3://bucket/prefix?endpoint=...", "run": "myrun",
     "public_key": "<64 hex: the run's ed25519 public key>",
     "worker_id": "alice-mac" (optional), "worker_key": "<64 hex: a worker's private key>" (optional)}

It carries no store credentials (those stay in the volunteer's environment). With a worker key
(made and enrolled by the operator) it is a secret: whoever holds it uploads as that worker.

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

from stoa.transport.signing import key_id, load_private_key, load_public_key

__all__ = ["Invite", "default_cache_dir", "default_key_path", "default_worker_id", "read_invite", "write_invite"]

INVITE_FORMAT = "stoa.invite/1"
_MAX_INVITE_BYTES = 64 << 10


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
    """Read and check an invite file; raises ``ValueError`` (or ``OSError``) naming what is wrong."""
    p = Path(path).expanduser()
    if p.stat().st_size > _MAX_INVITE_BYTES:
        raise ValueError(f"{p} is not an invite (over {_MAX_INVITE_BYTES} bytes)")
    try:
        body = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not an invite (not JSON: {e})") from None
    if not isinstance(body, dict) or body.get("format") != INVITE_FORMAT:
        raise ValueError(f"{p} is not a {INVITE_FORMAT} invite")
    for k in ("store", "run", "public_key"):
        if not isinstance(body.get(k), str) or not body[k]:
            raise ValueError(f"{p}: the invite has no {k!r}")
    load_public_key(body["public_key"])  # raises ValueError on a bad key
    wkey, wid = body.get("worker_key"), body.get("worker_id")
    if wkey is not None:
        load_private_key(wkey)
        if not isinstance(wid, str) or not wid:
            raise ValueError(f"{p}: an invite with a worker key names its worker_id")
    return Invite(body["store"], body["run"], body["public_key"], wid if wkey is not None else None, wkey)


def default_key_path() -> Path:
    """``$XDG_CONFIG_HOME/stoa/worker.key`` (``~/.config/stoa/worker.key``): this machine's worker key."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "stoa" / "worker.key"


def default_worker_id(private_key: Any) -> str:
    """``w-<key id>``: the same id on every start with the same key."""
    return f"w-{key_id(load_private_key(private_key).public_key())}"


def default_cache_dir(run: str, worker_id: str) -> Path:
    """``$XDG_CACHE_HOME/stoa/<run>/<worker id>`` (``~/.cache/...``): model files and kept weights."""
    safe_run = run.strip("/").replace("/", "_")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stoa" / safe_run / worker_id
