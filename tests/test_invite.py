"""Invites (stoa.fleet.worker.invite): every field is checked before anything is written, so an invite
cannot make `stoa worker --invite` write outside its cache (docs/volunteer.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stoa.fleet.worker.invite import INVITE_FORMAT, Invite, default_cache_dir, read_invite, write_invite
from stoa.transport.signing import generate_private_key


def _body(**over) -> dict:
    run_pub = generate_private_key().public_key().public_bytes_raw().hex()
    body = {"format": INVITE_FORMAT, "store": "s3://bucket/prefix?endpoint=http://127.0.0.1:1", "run": "myrun",
            "public_key": run_pub, "worker_id": "alice-mac", "worker_key": generate_private_key().private_bytes_raw().hex()}
    body.update(over)
    return {k: v for k, v in body.items() if v is not None}


def _write(tmp_path, body: dict):
    path = tmp_path / f"invite-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(body))
    return path


def test_an_invite_is_checked_field_by_field(tmp_path):
    good = read_invite(_write(tmp_path, _body()))
    assert good.worker_id == "alice-mac" and good.run == "myrun"
    again = tmp_path / "again.json"
    write_invite(again, good)
    assert read_invite(again) == good
    hostname = "/etc/hostname"  # a key given as a path was read as a key file
    for over, needle in [({"worker_id": "../../../escaped"}, "worker id"), ({"worker_id": ".hidden"}, "worker id"),
                         ({"worker_id": "a/b"}, "worker id"), ({"worker_id": None}, "worker id"),
                         ({"run": "../.."}, "run name"), ({"run": "a/../../b"}, "run name"), ({"run": ".."}, "run name"),
                         ({"public_key": hostname}, "public_key"), ({"worker_key": hostname}, "worker_key"),
                         ({"store": "s3://b/p\n--evil"}, "store"), ({"extra": 1}, "fields no invite has"),
                         ({"worker_key": None}, "without a worker_key")]:
        with pytest.raises(ValueError, match=needle):
            read_invite(_write(tmp_path, _body(**over)))
    with pytest.raises(ValueError, match="worker id"):
        default_cache_dir("myrun", "../../../escaped")
    with pytest.raises(ValueError):
        default_cache_dir("..", "alice")
    assert isinstance(Invite("s", "r", "k"), Invite)


def test_a_worker_started_from_a_hostile_invite_writes_nothing_and_says_why(tmp_path):
    """An invite naming worker_id "../../../escaped" made `stoa worker --invite` build its cache
    folder from it and write files outside its cache before the writer's id check."""
    home = tmp_path / "home"
    home.mkdir()
    invite = _write(tmp_path, _body(store=str(tmp_path / "store"), worker_id="../../../escaped"))
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / "cache"), XDG_CONFIG_HOME=str(home / "config"))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    r = subprocess.run([sys.executable, "-m", "stoa", "worker", "--invite", str(invite)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and "worker id" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written, anywhere
    r = subprocess.run([sys.executable, "-m", "stoa", "worker", "--store", str(tmp_path / "store"), "--run", "r",
                        "--public-key", _body()["public_key"], "--id", "../x"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2 and "worker id" in r.stderr and sorted(str(p) for p in tmp_path.rglob("*")) == before
