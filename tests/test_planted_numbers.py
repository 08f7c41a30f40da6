"""Junk planted under an honest worker's id never wedges it: a real trainer intake (its binder,
reader and gate) on a real local store, and the worker's own pieces (its remembering writer and
cache, its tickets). 1,000 objects planted at the worker's next numbers, before its first ticket,
between its tickets, or before a restart of both sides (the worker's cache then remembers a
number 1,000 past anything bound): its writer skips them, the trainer binds the number it skipped
to, and its batches are accepted, with no strike and no gap. And its throttle
(``rollout.max_outstanding``) counts only its own uploads: 3 or 100 objects in ``quarantine/`` or
``rollouts/``, which the trainer may never settle, hold it back not at all."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stoa.fleet.config import RunConfig
from stoa.fleet.worker import Worker
from stoa.fleet.intake import Intake
from stoa.fleet.trust.assign import assignment
from stoa.fleet.trust.binding import MAX_AHEAD, Binder, Tickets, write_ticket
from stoa.fleet.trust.ledger import Ledger
from stoa.transport import layout
from stoa.transport.exchange import rollout_key
from stoa.transport.identity import enroll_worker, read_salt
from stoa.transport.sequence import RememberingWriter, SequenceFile, catch_up, write_floors
from stoa.transport.signing import generate_private_key, key_id
from stoa.transport.store import LocalStore
from stoa.types import Episode, Segment

from helpers import TINY_FLEET


class _AnyKey:
    """Every key has standing (the binder's own tests)."""

    def __contains__(self, kid: object) -> bool:
        return True


ANY_KEY = _AnyKey()

RUN = "planted"
ENV = TINY_FLEET["env"]
PLANTED = 1000


class _Scorer:
    def logprobs(self, episodes, temperature=1.0, *, model_only=False):
        return [np.zeros(len(e.tokens()), np.float32) for e in episodes]


def _make_env():
    import stoa.envs

    return stoa.envs.make(ENV["id"], **ENV["kwargs"])


class _Fleet:
    """A trainer's intake and one honest, enrolled worker (id ``w``) with its cache folder."""

    def __init__(self, tmp_path):
        self.tmp, self.store, self.key = tmp_path, LocalStore(tmp_path / "store"), generate_private_key()
        self.cfg = RunConfig.from_dict({"name": RUN, "seed": 3, "env": ENV,
                                        "rollout": {"group_size": 2, "groups_per_cohort": 2},
                                        "trainer": {"groups_per_step": 4096, "max_lag": 3},  # no step: all pooled
                                        "trust": {"replay": False, "audit": {"enabled": False},
                                                  "reward_range": [0.0, 1.0]}})
        self.events: list[dict] = []
        self.intake = self.trainer()
        self.wkey = generate_private_key()
        self.kid = key_id(self.wkey.public_key())
        enroll_worker(self.store, RUN, self.key, self.wkey.public_key(), "w")
        self.intake.take(0)  # reads the roster: the key has standing, and its salt is out
        self.worker()

    def trainer(self) -> Intake:
        ledger = Ledger(self.tmp / "ledger.jsonl", lambda: {"rl_step": 0, "version": 0})
        return Intake(self.cfg, self.store, self.key, vocab_size=700, metric_types={}, ledger=ledger,
                      float_scorer=_Scorer(), int8=None, make_env=_make_env,
                      event=lambda **row: self.events.append(row))

    def worker(self) -> None:
        """(Re)start the worker: its writer numbers from the store and its cache, as the Worker does."""
        self.writer = RememberingWriter(self.store, RUN, "w", self.wkey, SequenceFile(self.tmp / "cache/sequence.json"))
        self.tickets = Tickets(self.store, RUN, self.wkey, self.key.public_key())
        self.tickets.retry_s = 0.0  # tickets again at every try (the worker waits 30 s): retrying never helps
        self.me = Worker(self.store, RUN, self.key.public_key(), "w", self.tmp / "cache", private_key=self.wkey)

    def throttle(self, max_outstanding: int = 2) -> None:
        """Wait as Worker._ready does while ``max_outstanding`` of its batches wait for the trainer
        (the trainer polls meanwhile); fails if the wait would never end."""
        for _ in range(8):
            if self.me._outstanding(self.writer) < max_outstanding:
                return
            self.intake.take(0)
        raise AssertionError(f"{self.me._outstanding(self.writer)} batches outstanding for good: the worker waits")

    def plant(self, first: int) -> None:
        for n in range(first, first + PLANTED):
            self.store.put(rollout_key(RUN, "w", n, 0), b"junk")

    def batch(self) -> str:
        """One cohort, as Worker.run makes it: skip what others hold, ticket, wait for the binding
        (the trainer polls meanwhile), make the bound work, upload it under its number."""
        seq = self.writer.skip_taken()
        # A fresh key's next number is bound once the trainer has read its first bound batch, which
        # may wait behind the junk (the reader takes 64 objects of a worker id a poll).
        for _ in range(PLANTED // 64 + 8):
            bound = self.tickets.bound(seq)
            if bound is not None:
                break
            assert self.tickets.passed_over(seq) is None
            self.intake.take(0)
        else:
            raise AssertionError(f"number {seq} was never bound: the worker waits for good")
        salt = read_salt(self.store, RUN, self.kid, self.key.public_key())
        work = assignment(self.cfg.seed, self.kid, seq, self.intake.n_items, 2, salt, bound.beacon)
        rng = np.random.default_rng(seq)  # distinct answers: no group is a copy of another
        episodes = [Episode(rng.integers(0, 700, 5), [Segment("model", rng.integers(0, 700, 4), -rng.random(4))],
                            reward=float(s), policy_version=bound.version, worker_id="w", env_id=ENV["id"],
                            group_id=g, sample_index=s, item_index=i)
                    for g, i in zip(work.group_ids, work.items) for s in range(2)]
        key = self.writer.upload(episodes, bound.version, seq=seq)
        self.intake.take(0)
        return key


@pytest.mark.parametrize("when", ["before its first ticket", "between its tickets", "before a restart"])
def test_a_thousand_planted_numbers_never_wedge_an_honest_worker(tmp_path, when):
    fleet = _Fleet(tmp_path)
    made = []
    if when == "before its first ticket":
        fleet.plant(0)
        fleet.worker()  # starts on a store that already holds them
    else:
        made += [fleet.batch(), fleet.batch()]  # numbers 0 and 1; 2 is ticketed (bound) ahead
        fleet.plant(fleet.writer.next_seq)
    if when == "before a restart":
        for _ in range(PLANTED // 64 + 2):
            fleet.intake.take(0)  # the trainer reads (quarantines) every planted object...
        write_floors(fleet.store, RUN, fleet.intake.reader.next_numbers(), fleet.key)  # ...and says so (every 5 s)
        assert catch_up(fleet.writer, fleet.store, RUN, fleet.key.public_key())  # the worker heeds it: cached
        state = json.loads(json.dumps(fleet.intake.state()))  # then both stop
        fleet.intake = fleet.trainer()
        fleet.intake.restore(state)
        fleet.intake.prune(state)
        for k in fleet.store.list(layout.quarantine(RUN, "w")):  # the store forgets them: the reader does not
            fleet.store.delete(k)
        fleet.worker()
        assert fleet.writer.next_seq == 2 + PLANTED  # its cache remembers it, far past anything bound
    made += [fleet.batch() for _ in range(3)]
    assert max(int(k.rpartition("/s")[2][:12]) for k in made) >= PLANTED + 2
    for _ in range(PLANTED // 64 + 2):
        fleet.intake.take(0)  # the trainer reads the rest of the junk
    pooled = {b.key for b in fleet.intake.pool.batches()}
    assert set(made) <= pooled  # every batch the worker made was accepted
    rec = fleet.intake.gate.records[fleet.kid]
    assert rec.strikes == 0 and rec.rejected_batches == 0 and not rec.banned, rec
    assert rec.withheld == 0 and rec.taken_by_others >= PLANTED - 1
    assert [e for e in fleet.events if e["event"] == "ticket_refused"] == []
    assert {e["category"] for e in fleet.events if e["event"] == "rejected"} == {"unsigned"}  # the junk, unsealed


def test_planted_numbers_do_not_stretch_a_keys_lookahead_over_free_numbers(tmp_path):
    """The lookahead counts free numbers: objects under the key's worker id (anyone's) do not
    count, and a number nobody holds does, so neither a cheating key nor a planter gets a ticket
    bound further than MAX_AHEAD free numbers past the key's highest bound one."""
    store, run_key, w = LocalStore(tmp_path), generate_private_key(), generate_private_key()
    kid = key_id(w.public_key())
    binder = Binder(store, RUN, run_key)
    held = set(range(0, 500)) | {700}  # e.g. junk at 0..499 and one far object at 700

    def ask(k, after, below):
        assert k == kid
        return {n for n in held if after < n < below}

    write_ticket(store, RUN, 500 + MAX_AHEAD - 1, w)  # 63 free numbers (500..562) in between: bound
    assert binder.poll(1, ANY_KEY, ask) == [] and binder.top[kid] == 500 + MAX_AHEAD - 1
    fresh = Binder(store, RUN, run_key)
    write_ticket(store, RUN, 500 + MAX_AHEAD, w)  # 64 free numbers in between: refused
    write_ticket(store, RUN, 701, w)  # a lone far object buys one number, not the range below it
    refused = fresh.poll(1, ANY_KEY, ask)
    assert sorted(k for _, k, _ in refused) == [layout.ticket(RUN, kid, 500 + MAX_AHEAD), layout.ticket(RUN, kid, 701)]
    assert all("free numbers past" in why for _, _, why in refused) and fresh.bound == {}
    assert Binder(store, RUN, run_key).poll(1, ANY_KEY) == []  # nothing left; no held: the plain bound


def _plant_at(fleet: _Fleet, where: str, first: int, count: int) -> None:
    for n in range(first, first + count):
        key = rollout_key(RUN, "w", n, 0)
        if where == "quarantine":  # written there directly: the trainer never reads, so never settles, it
            key = layout.quarantine(RUN, "w") + key.rpartition("/")[2]
        fleet.store.put(key, b"junk")


@pytest.mark.parametrize("count", [3, 100])
@pytest.mark.parametrize("where", ["quarantine", "rollouts"])
@pytest.mark.parametrize("when", ["before its first upload", "between its uploads", "before a restart"])
def test_planted_numbers_never_hold_back_an_honest_workers_throttle(tmp_path, monkeypatch, where, count, when):
    """The worker's throttle (rollout.max_outstanding = 2) counts only its own uploads the trainer
    has not settled: objects others wrote under its id, which its writer skips and the trainer may
    never settle (those put straight into quarantine/), hold nothing back. Before, it counted
    numbers used less numbers taken, so 3 objects in quarantine/ stalled it for good."""
    # The trainer lists a key's folder for far tickets at most every 10 s and the worker tickets
    # again after 30 s, so a second far planting costs one wait; this test does not wait.
    monkeypatch.setattr("stoa.fleet.trust.gate._HELD_LIST_EVERY_S", 0.0)
    fleet = _Fleet(tmp_path)
    made = []
    if when == "before its first upload":
        _plant_at(fleet, where, 0, count)
        fleet.worker()
    else:
        for _ in range(2):
            fleet.throttle()
            made.append(fleet.batch())
        _plant_at(fleet, where, fleet.writer.next_seq, count)
    if when == "before a restart":
        state = json.loads(json.dumps(fleet.intake.state()))
        fleet.intake = fleet.trainer()
        fleet.intake.restore(state)
        fleet.intake.prune(state)
        fleet.worker()
    for i in range(4):  # at most 8 live bindings a key, and versions never move here: 6 batches in all
        fleet.throttle()
        made.append(fleet.batch())
        if i == 1:
            _plant_at(fleet, where, fleet.writer.next_seq + 1, count)  # more, one past its next number
    pooled = {b.key for b in fleet.intake.pool.batches()}
    assert set(made) <= pooled  # every batch the worker made was accepted
    rec = fleet.intake.gate.records[fleet.kid]
    assert rec.strikes == 0 and rec.rejected_batches == 0 and not rec.banned, rec
    assert [e for e in fleet.events if e["event"] == "ticket_refused"] == []
