"""The trainer's roster (stoa.fleet.trust.roster, through the gate): admission by mode, binding by
accepted work, a full ban list, a stale roster put back, a flood of throwaway keys."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

from stoa.fleet.trust import TrustConfig, TrustGate
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
    assert closed.admit(seal_of(alice, "alice")) is None
    assert "not enrolled" in closed.admit(seal_of(bob, "bob"))
    assert "impersonation" in closed.admit(seal_of(eve, "alice"))
    assert "bound to worker id 'alice'" in closed.admit(seal_of(alice, "mallory"))
    assert "--id alice" in closed.admit(seal_of(alice, "mallory"))  # the way out, in the refusal itself
    opened = TrustGate(TrustConfig(mode="open"), store, RUN, run_key)
    opened.refresh(force=True)
    assert opened.admit(seal_of(bob, "bob")) is None  # reviewed ...
    assert opened.admit(seal_of(eve, "bob")) is None  # ... and so is a second key under the same id,
    assert opened.review([sealed_batch(bob, "bob", episodes("bob"))], 0) == [None]  # until one is accepted:
    assert "impersonation" in opened.admit(seal_of(eve, "bob"))  # then nobody else can be bob
    opened.refresh(force=True)  # the binding is written to the signed roster
    roster = read_roster(store, RUN, run_key.public_key())
    assert roster.enrolled[key_id(bob.public_key())].source == "first-use"
    ban_worker(store, RUN, run_key, "bob", "by hand")  # `stoa ban` while the run is live
    opened.refresh(force=True)
    assert "banned" in opened.admit(seal_of(bob, "bob"))


def test_an_id_is_bound_only_by_accepted_work_so_junk_squats_nothing(tmp_path):
    """A sealed junk batch under a victim's id used to bind that id to the attacker for good,
    although the batch was refused: the roster bound ids when the seal was read."""
    from stoa.transport.store import LocalStore

    store, run_key = LocalStore(tmp_path), generate_private_key()
    squatter, owner = generate_private_key(), generate_private_key()
    gate = TrustGate(TrustConfig(), store, RUN, run_key)
    gate.refresh(force=True)
    assert gate.admit(seal_of(squatter, "alice")) is None
    junk = sealed_batch(squatter, "alice", episodes("alice"))
    gate.reject(junk.key_id, "alice", "invalid", "junk")  # what the intake does with a batch failing its checks
    honest = episodes("alice", group="own", seed=3)
    copied = sealed_batch(squatter, "alice", honest, 1)
    mine = sealed_batch(owner, "alice", copy.deepcopy(honest), 1)
    gate.review([mine], 0)  # the owner's work is accepted and binds the id ...
    (verdict,) = gate.review([copied], 0)  # (the trainer's intake refuses it earlier: not the squatter's assigned work)
    assert verdict.category == "refused" and "by its accepted work first" in verdict.reason
    gate.refresh(force=True)
    roster = read_roster(store, RUN, run_key.public_key())
    assert roster.key_for("alice") == key_id(owner.public_key()) and key_id(squatter.public_key()) not in roster.enrolled
    assert "impersonation" in gate.admit(seal_of(squatter, "alice"))  # ... and the squatter is shut out of it


def test_a_full_ban_list_never_crashes_the_trainer(tmp_path):
    from stoa.transport.identity import _MAX_ROSTER, Ban
    from stoa.transport.store import LocalStore

    gate = TrustGate(TrustConfig(), LocalStore(tmp_path), RUN, generate_private_key())
    for i in range(_MAX_ROSTER):
        gate.roster = gate.roster.with_ban(f"{i:016x}", Ban("x", "old", 0.0, 0))
    cheat = generate_private_key()
    kid = key_id(cheat.public_key())
    gate.ban(kid, "forged log-probs")  # raised ValueError("the ban list is full") out of the trainer before
    assert gate.is_banned(kid) and "banned" in gate.admit(seal_of(cheat, "cheat"))


def test_a_stale_roster_put_back_while_the_trainer_is_down_undoes_no_ban(tmp_path):
    """A correctly signed but older workers.json put back during a restart used to un-ban a key
    banned after the trainer's newest checkpoint: the restarted trainer read the store as is."""
    from stoa.transport.store import LocalStore

    store, run_key, kept = LocalStore(tmp_path / "store"), generate_private_key(), tmp_path / "run" / "roster"
    cheat = generate_private_key()
    kid = key_id(cheat.public_key())
    first = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=kept)
    first.refresh(force=True)
    assert first.admit(seal_of(cheat, "cheat")) is None
    assert first.review([sealed_batch(cheat, "cheat", episodes("cheat"))], 0) == [None]  # bound by accepted work
    first.refresh(force=True)
    stale = store.get(roster_key(RUN))  # a signed roster from before the ban
    first.ban(kid, "forged log-probs")
    banned_rev = read_roster(store, RUN, run_key.public_key()).revision
    store.put(roster_key(RUN), stale)  # put back while the trainer is down
    restarted = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=kept)  # no checkpoint state
    restarted.refresh(force=True)
    assert "banned" in restarted.admit(seal_of(cheat, "cheat"))
    now = read_roster(store, RUN, run_key.public_key())
    assert kid in now.banned and now.revision > banned_rev  # rewritten, and revisions never go back


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
        now, waiting = gate.pace_newcomers([vet, *waiting])
        assert vet in now and len(now) == 5 and len({b.key_id for b in now}) == 5
        junk = [b for b in now if b.worker_id.startswith("x")]
        for b in junk:
            gate.reject(b.key_id, b.worker_id, "replay", "junk")
        verdicts = gate.review([b for b in now if b not in junk], polls)
        assert all(v is None for v in verdicts)
        if any(b.worker_id == "new" for b in now):
            break
    assert polls <= len(flood) // 4 + 1  # never locked out: its turn comes before the flood is through
    assert gate.established(key_id(newcomer.public_key()))
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
    assert key_id(later.public_key()) not in gate.roster.enrolled and gate.established(key_id(later.public_key()))
