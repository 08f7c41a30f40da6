"""The trainer's roster (stoa.fleet.trust.roster, through the gate): admission by mode, binding by
accepted work, bans (compact, uncapped, kept across restarts), a stale roster put back, a flood of
throwaway keys."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import replace

from stoa.fleet.trust.gate import TrustGate
from stoa.fleet.trust.section import TrustConfig
from stoa.transport.identity import ban_worker, enroll_worker, public_hex, read_roster, roster_key
from stoa.transport.signing import generate_private_key, key_id

from trust_helpers import RUN, episodes, seal_of, sealed_batch


def test_the_gate_admits_by_mode_roster_and_first_use(tmp_path):
    from stoa.transport.store import LocalStore

    store, run_key = LocalStore(tmp_path), generate_private_key()
    alice, bob, eve = generate_private_key(), generate_private_key(), generate_private_key()
    enroll_worker(store, RUN, run_key, alice, "alice")
    closed = TrustGate(TrustConfig(mode="enrolled"), store, RUN, run_key)
    closed.refresh(force=True)
    assert closed.admission().refusal(seal_of(alice, "alice")) is None
    assert "not enrolled" in closed.admission().refusal(seal_of(bob, "bob"))
    assert "impersonation" in closed.admission().refusal(seal_of(eve, "alice"))
    assert "bound to worker id 'alice'" in closed.admission().refusal(seal_of(alice, "mallory"))
    assert "--id alice" in closed.admission().refusal(seal_of(alice, "mallory"))  # the way out, in the refusal itself
    opened = TrustGate(TrustConfig(mode="open"), store, RUN, run_key)
    opened.refresh(force=True)
    assert opened.admission().refusal(seal_of(bob, "bob")) is None  # reviewed ...
    assert opened.admission().refusal(seal_of(eve, "bob")) is None  # ... and so is a second key under the same id,
    assert opened.review([sealed_batch(bob, "bob", episodes("bob"))], 0) == [None]  # until one is accepted:
    assert "impersonation" in opened.admission().refusal(seal_of(eve, "bob"))  # then nobody else can be bob
    opened.refresh(force=True)  # the binding is written to the signed roster
    roster = read_roster(store, RUN, run_key.public_key())
    assert roster.enrolled[key_id(bob.public_key())].source == "first-use"
    ban_worker(store, RUN, run_key, "bob", "by hand")  # `stoa ban` while the run is live
    opened.refresh(force=True)
    assert "banned" in opened.admission().refusal(seal_of(bob, "bob"))


def test_an_id_is_bound_only_by_accepted_work_so_junk_squats_nothing(tmp_path):
    """A sealed junk batch under a victim's id used to bind that id to the attacker for good,
    although the batch was refused: the roster bound ids when the seal was read."""
    from stoa.transport.store import LocalStore

    store, run_key = LocalStore(tmp_path), generate_private_key()
    squatter, owner = generate_private_key(), generate_private_key()
    gate = TrustGate(TrustConfig(), store, RUN, run_key)
    gate.refresh(force=True)
    assert gate.admission().refusal(seal_of(squatter, "alice")) is None
    junk = sealed_batch(squatter, "alice", episodes("alice"))
    gate.refused(None, junk.key_id, "alice", "invalid", "junk")  # what the intake does with a batch failing its checks
    honest = episodes("alice", group="own", seed=3)
    copied = sealed_batch(squatter, "alice", honest, 1)
    mine = sealed_batch(owner, "alice", copy.deepcopy(honest), 1)
    gate.review([mine], 0)  # the owner's work is accepted and binds the id ...
    (verdict,) = gate.review([copied], 0)  # (the trainer's intake refuses it earlier: not the squatter's assigned work)
    assert verdict.category == "refused" and "by its accepted work first" in verdict.reason
    gate.refresh(force=True)
    roster = read_roster(store, RUN, run_key.public_key())
    assert roster.key_for("alice") == key_id(owner.public_key()) and key_id(squatter.public_key()) not in roster.enrolled
    assert "impersonation" in gate.admission().refusal(seal_of(squatter, "alice"))  # ... and the squatter is shut out of it


def test_a_stale_roster_put_back_while_the_trainer_is_down_undoes_no_ban_or_binding(tmp_path):
    """A correctly signed but older workers.json put back during a restart used to un-ban a key
    banned after the trainer's newest checkpoint: the restarted trainer read the store as is. Bans
    now live in the trainer's ban log and in ban documents; bindings in the kept roster copy."""
    from stoa.transport.store import LocalStore

    store, run_key, kept = LocalStore(tmp_path / "store"), generate_private_key(), tmp_path / "run" / "roster"
    cheat = generate_private_key()
    kid = key_id(cheat.public_key())
    first = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=kept)
    first.refresh(force=True)
    assert first.admission().refusal(seal_of(cheat, "cheat")) is None
    assert first.review([sealed_batch(cheat, "cheat", episodes("cheat"))], 0) == [None]  # bound by accepted work
    first.refresh(force=True)
    stale = store.get(roster_key(RUN))  # a signed roster from before the ban
    owner = generate_private_key()
    assert first.review([sealed_batch(owner, "owner", episodes("owner", seed=4))], 0) == [None]
    first.ban(kid, "forged log-probs")
    first.refresh(force=True)
    bound_rev = read_roster(store, RUN, run_key.public_key()).revision
    store.put(roster_key(RUN), stale)  # put back while the trainer is down
    store.delete(f"{RUN}/bans/{kid}.json")
    restarted = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=kept)  # no checkpoint state
    restarted.refresh(force=True)
    assert "banned" in restarted.admission().refusal(seal_of(cheat, "cheat"))
    assert "impersonation" in restarted.admission().refusal(seal_of(generate_private_key(), "owner"))
    now = read_roster(store, RUN, run_key.public_key())
    assert now.key_for("owner") == key_id(owner.public_key()) and now.revision > bound_rev  # revisions never go back


class _Counting:
    """A store that counts the bytes put into it (to see what one ban costs)."""

    def __init__(self, store):
        self.store, self.put_bytes = store, 0

    def put(self, key, data):
        self.put_bytes += len(data)
        return self.store.put(key, data)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_bans_are_compact_and_one_small_write_each_whatever_their_number(tmp_path):
    """Each ban used to quote a stranger's 64-character group id and 80-character env id (2.2 KB a
    ban) into the signed roster, which was rewritten whole at every ban: past ~1,950 bans the
    roster was over its 4 MiB read cap (enroll failed, a restart read an empty roster), and the
    trust report over the 1 MiB status reads after ~256. Now a ban is its own small document."""
    import numpy as np

    from stoa.fleet.trust.admission import batch_problem
    from stoa.fleet.trust.records import read_trust_report
    from stoa.transport.store import LocalStore
    from stoa.types import Episode, Segment

    store, run_key = _Counting(LocalStore(tmp_path / "store")), generate_private_key()
    alice = generate_private_key()
    enroll_worker(store, RUN, run_key, alice, "alice")
    gate = TrustGate(TrustConfig(ban_after=2), store, RUN, run_key, roster_copy=tmp_path / "run" / "roster")
    gate.refresh(force=True)
    hostile = [Episode(np.arange(3), [Segment("model", np.arange(2), -np.ones(2))], 0.5, env_id="\x1b[2J<img>" * 20,
                       group_id="G" * 300, sample_index=0)]
    why = batch_problem(hostile, temperature=1.0, top_p=1.0, group_size=2, reward_range=(0.0, 1.0),
                        env_id="stoa/Synthetic-v0", metric_types={})
    roster_size = len(store.get(roster_key(RUN)))
    costs = []
    for i in range(300):  # what the intake does with two junk batches of a throwaway key
        before = store.put_bytes
        kid = f"{i:016x}"
        gate.refused(None, kid, f"x{i}", "invalid", why)
        gate.refused(None, kid, f"x{i}", "invalid", why)
        costs.append(store.put_bytes - before)
        assert gate.members.is_banned(kid)
    assert max(costs) < 1024 and max(costs[-10:]) <= max(costs[:10]) + 64, (costs[:3], costs[-3:])  # flat
    assert len(store.get(roster_key(RUN))) == roster_size  # the roster holds no ban
    doc = store.get(f"{RUN}/bans/{299:016x}.json")
    assert len(doc) < 1024 and b"\x1b" not in doc and b"G" * 30 not in doc  # bounded; shown escaped (test_status)
    assert json.loads(json.loads(doc)["body"])["code"] == "strikes"
    gate.write_report(1, force=True)
    assert len(store.get(f"{RUN}/trust.json")) < 1 << 20
    report = read_trust_report(store, RUN, run_key.public_key(), max_bytes=1 << 20)  # what stoa status reads
    assert report.banned_keys == 300 and all(len(w.banned) <= 260 for w in report.workers.values())
    enroll_worker(store, RUN, run_key, generate_private_key(), "bob")  # the roster stays readable and editable
    restarted = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=tmp_path / "run" / "roster")
    restarted.refresh(force=True)
    assert restarted.admission().refusal(seal_of(alice, "alice")) is None  # alice's binding read back, her key admitted
    assert "impersonation" in restarted.admission().refusal(seal_of(generate_private_key(), "alice"))


def test_bans_past_the_rosters_cap_survive_a_restart_from_an_earlier_checkpoint(tmp_path, monkeypatch):
    """At the roster's cap the ban list raised and the ban was kept only in memory: a restart from
    an earlier checkpoint let the banned key back, and the worker was never told. Now bans have no
    cap, the trainer logs each in its run folder, and the key's ban document tells its worker.
    (The cap is lowered to 64 here, so the test stays fast; it is 4,096.)"""
    import stoa.transport.identity as identity
    from stoa.transport.store import LocalStore

    monkeypatch.setattr(identity, "_MAX_ROSTER", 64)
    store, run_key, kept = LocalStore(tmp_path / "store"), generate_private_key(), tmp_path / "run" / "roster"
    gate = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=kept)
    gate.refresh(force=True)
    early = json.loads(json.dumps(gate.state()))  # a checkpoint from before the bans
    for i in range(100):
        gate.ban(f"{i:016x}", "junk")
    cheat = generate_private_key()
    kid = key_id(cheat.public_key())
    gate.ban(kid, "forged log-probs")  # raised ValueError("the ban list is full") out of the trainer before
    assert gate.members.is_banned(kid) and "banned" in gate.admission().refusal(seal_of(cheat, "cheat"))
    restarted = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=kept)
    restarted.restore(early)
    assert restarted.members.is_banned(kid) and "banned" in restarted.admission().refusal(seal_of(cheat, "cheat"))
    assert all(restarted.members.is_banned(f"{i:016x}") for i in range(100))
    assert restarted.metrics()["trust/banned_workers"] == 101
    from stoa.transport.identity import read_ban

    told = read_ban(store, RUN, kid, run_key.public_key())  # what the worker reads: it stops (status 3)
    assert told is not None and "forged log-probs" in told.reason
    for k in store.list(f"{RUN}/bans/"):  # someone with write access deletes every ban document
        store.delete(k)
    again = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=kept)
    again.refresh(force=True)
    assert again.members.is_banned(kid)  # the trainer's own log keeps it


def test_a_flood_of_throwaway_keys_neither_fills_the_roster_nor_locks_a_newcomer_out(tmp_path, monkeypatch):
    """4,096 throwaway keys used to fill an open roster on first use and refuse every later
    volunteer. Now a key binds only by accepted work, fresh keys are reviewed a few per poll (at
    random), records of keys that never did accepted work are forgotten, and a full roster makes
    room from idle bindings or takes the newcomer's work unbound."""
    import stoa.fleet.trust.records as records_mod
    from stoa.transport.identity import _MAX_ROSTER, WorkerEntry
    from stoa.transport.store import LocalStore

    monkeypatch.setattr(records_mod, "MAX_RECORDS", 300)
    store, run_key = LocalStore(tmp_path), generate_private_key()
    gate = TrustGate(TrustConfig(newcomers_per_poll=4), store, RUN, run_key)
    gate.refresh(force=True)
    veteran = generate_private_key()
    assert gate.review([sealed_batch(veteran, "vet", episodes("vet", seed=1))], 0) == [None]
    flood = [generate_private_key() for _ in range(400)]
    newcomer = generate_private_key()
    waiting = [sealed_batch(k, f"x{i}", episodes(f"x{i}", group=f"g{i}", seed=i), 0) for i, k in enumerate(flood)]
    waiting.append(sealed_batch(newcomer, "new", episodes("new", group="n", seed=999)))
    polls = 0
    while True:  # each poll: the veteran's batch always, four fresh keys' at random; junk is struck
        polls += 1
        vet = sealed_batch(veteran, "vet", episodes("vet", group=f"v{polls}", seed=10_000 + polls), polls)
        fresh = min(4, len(waiting))  # the newcomer drawn last meets only itself in the final poll
        now, waiting = gate.members.pace_newcomers([vet, *waiting])
        assert vet in now and len(now) == 1 + fresh and len({b.key_id for b in now}) == 1 + fresh
        junk = [b for b in now if b.worker_id.startswith("x")]
        for b in junk:
            gate.refused(None, b.key_id, b.worker_id, "replay", "junk")
        verdicts = gate.review([b for b in now if b not in junk], polls)
        assert all(v is None for v in verdicts)
        if any(b.worker_id == "new" for b in now):
            break
    assert polls <= len(flood) // 4 + 1  # never locked out: its turn comes before the flood is through
    assert gate.members.established(key_id(newcomer.public_key()))
    gate.refresh(force=True)
    assert set(read_roster(store, RUN, run_key.public_key()).enrolled) == {key_id(veteran.public_key()),
                                                                           key_id(newcomer.public_key())}
    assert len(gate.records) <= 300  # strangers' records forgotten, the workers' kept
    assert gate.records[key_id(veteran.public_key())].accepted_batches == polls + 1

    # A full roster: an idle binding makes room; with none idle, the work is taken, the id left unbound.
    keys = [generate_private_key().public_key() for _ in range(_MAX_ROSTER - 2)]
    old = {key_id(k): WorkerEntry(public_hex(k), f"old{i}", 0.0, "first-use") for i, k in enumerate(keys)}
    gate.roster = replace(gate.roster, enrolled={**gate.roster.enrolled, **old})
    late = generate_private_key()
    assert gate.review([sealed_batch(late, "late", episodes("late", group="l", seed=5))], 99) == [None]
    assert key_id(late.public_key()) in gate.roster.enrolled and len(gate.roster.enrolled) == _MAX_ROSTER
    gate.refresh(force=True)
    assert len(read_roster(store, RUN, run_key.public_key()).enrolled) == _MAX_ROSTER
    for k in old:
        gate.records.touch(k, "old").last_accepted = time.time()
    later = generate_private_key()
    assert gate.review([sealed_batch(later, "later", episodes("later", group="m", seed=6))], 99) == [None]
    assert key_id(later.public_key()) not in gate.roster.enrolled and gate.members.established(key_id(later.public_key()))
