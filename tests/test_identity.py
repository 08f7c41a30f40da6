"""Worker identity (stoa.transport.identity): sealed batches, the signed roster, and the command
line that edits it; the reader's seal checks against names and a caller's roster."""

from __future__ import annotations

import json

import pytest

from stoa.transport.exchange import RolloutReader, RolloutWriter, rollout_key
from stoa.transport.identity import (
    Ban,
    SealError,
    ban_worker,
    enroll_worker,
    open_sealed,
    read_ban,
    read_roster,
    read_salt,
    roster_key,
    seal_batch,
)
from stoa.transport.signing import SignatureError, generate_private_key, key_id
from stoa.types import Verdict, encode_episodes

from trust_helpers import RUN, episodes


def test_a_seal_binds_bytes_key_worker_run_seq_and_version():
    key = generate_private_key()
    payload = encode_episodes(episodes("w"))
    blob = seal_batch(payload, run=RUN, worker_id="w", seq=3, version=7, private_key=key)
    seal, got = open_sealed(blob)
    assert got == payload and (seal.run, seal.worker_id, seal.seq, seal.version) == (RUN, "w", 3, 7)
    assert seal.key_id == key_id(key.public_key())
    other = encode_episodes(episodes("w", seed=1))
    header = blob[: len(blob) - len(payload)]
    for bad, needle in [(payload, "not a sealed batch"), (header + other, "altered"), (blob[:20], "truncated"),
                        (blob.replace(b'\\"seq\\":3', b'\\"seq\\":4'), "bad ed25519 signature"),
                        (blob[:9] + b"{}" + blob[11:], "public key")]:
        with pytest.raises(SealError, match=needle):
            open_sealed(bad)


def test_the_reader_checks_seals_against_names_and_the_roster(store):
    me, other = generate_private_key(), generate_private_key()
    w = RolloutWriter(store, RUN, "w", private_key=me)
    good = w.upload(episodes("w"), 0)
    blob = store.get(good)
    store.put(rollout_key(RUN, "x", 0, 0), blob)  # a genuine batch copied under another worker's name
    store.put(rollout_key(RUN, "w", 5, 0), encode_episodes(episodes("w", seed=2)))  # unsigned
    RolloutWriter(store, RUN, "z", private_key=other).upload(episodes("z"), 0)  # a key the policy refuses
    allowed = {w.key_id}

    class Enrolled:  # the intake's rule (an enrolled roster), as the reader's caller gives it
        def screen(self, s):
            if s is None:
                return Verdict("unsigned", "unsigned batch")
            return None if s.key_id in allowed else Verdict("refused", f"key {s.key_id} unknown")

    reader = RolloutReader(store, RUN)
    (batch,) = reader.poll(admission=Enrolled())
    assert batch.key == good and batch.key_id == w.key_id and len(batch.sha256) == 64
    why = {r.key.split("/")[-2]: (r.category, r.reason) for r in reader.last_report.rejected}
    assert why["x"][0] == "signature" and "copied or renamed" in why["x"][1]
    assert why["w"][0] == "unsigned" and why["z"][0] == "refused" and "unknown" in why["z"][1]
    reasons = [json.loads(store.get(k))["reason"] for k in store.list(f"{RUN}/quarantine/") if k.endswith(".json")]
    assert len(reasons) == 3


def test_enroll_and_ban_edit_the_signed_roster(tmp_path):
    from stoa.transport.store import LocalStore

    store, run_key = LocalStore(tmp_path), generate_private_key()
    a, b = generate_private_key(), generate_private_key()
    assert read_roster(store, RUN, run_key.public_key()).enrolled == {}
    enroll_worker(store, RUN, run_key, a, "alice")
    r = enroll_worker(store, RUN, run_key, b.public_key(), "bob", note="lab mac")
    assert r.revision == 2 and r.key_for("bob") == key_id(b.public_key()) and r.enrolled[r.key_for("bob")].note == "lab mac"
    with pytest.raises(ValueError, match="already bound"):
        enroll_worker(store, RUN, run_key, generate_private_key(), "alice")
    assert read_salt(store, RUN, key_id(a.public_key()), run_key.public_key()) is not None  # its worker's work
    ban_worker(store, RUN, run_key, "alice", "forged rewards")
    ban = read_ban(store, RUN, key_id(a.public_key()), run_key.public_key())
    assert (ban.code, ban.detail, ban.worker_id) == ("by-hand", "forged rewards", "alice")
    assert read_roster(store, RUN, run_key.public_key()).revision == 3  # the trainer re-reads the bans
    with pytest.raises(ValueError, match="banned"):
        enroll_worker(store, RUN, run_key, a, "alice2")
    blob = store.get(roster_key(RUN))
    store.put(roster_key(RUN), blob.replace(b"lab mac", b"lab pc!"))
    with pytest.raises(SignatureError):
        read_roster(store, RUN, run_key.public_key())
    where = f"{RUN}/bans/{key_id(a.public_key())}.json"
    store.put(where, store.get(where).replace(b"forged rewards", b"just kidding!!"))
    with pytest.raises(SignatureError):
        read_ban(store, RUN, key_id(a.public_key()), run_key.public_key())


def test_keygen_enroll_and_ban_from_the_command_line(tmp_path):
    import subprocess
    import sys

    from stoa.transport.signing import load_private_key
    from stoa.transport.store import LocalStore

    def stoa(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "stoa", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    keys, store = tmp_path / "keys", tmp_path / "store"
    stoa("keygen", str(keys))
    assert "stoa worker --key" in stoa("keygen", str(keys), "--worker", "--name", "alice")
    common = ["--store", str(store), "--run", RUN, "--key", str(keys / "run.key")]
    stoa("enroll", str(keys / "alice.pub"), *common, "--worker-id", "alice")
    assert "banned alice" in stoa("ban", "alice", *common, "--reason", "forged rewards")
    roster = read_roster(LocalStore(store), RUN, load_private_key(keys / "run.key").public_key())
    kid = key_id(load_private_key(keys / "alice.key").public_key())
    ban = read_ban(LocalStore(store), RUN, kid, load_private_key(keys / "run.key").public_key())
    assert roster.enrolled[kid].worker_id == "alice" and ban.reason == "by-hand: forged rewards"
    assert Ban.of("alice", "sampling", "sampling: 3 of 32 episodes").reason == "sampling: 3 of 32 episodes"
