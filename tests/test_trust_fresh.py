"""A fresh key (no accepted salted batch since it gained standing) holds one binding at a time, and
a bound number it leaves undelivered costs it its standing: its worker makes probation work again,
with no strike. Junk planted at its bound number costs it nothing (its worker carries the bound
work to the next free number) and buys a grinder no look. A real trainer intake on a local store;
the worker's side is its :class:`Duty`, its writer and :meth:`Worker._upload_pending`."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.fleet.config import RunConfig
from stoa.fleet.intake import Intake
from stoa.fleet.trust.assign import assignment
from stoa.fleet.trust.binding import read_document, write_ticket
from stoa.fleet.trust.duty import Duty, Order
from stoa.fleet.trust.ledger import Ledger
from stoa.fleet.worker import Worker
from stoa.fleet.worker.worker import _Batch
from stoa.transport import layout
from stoa.transport.exchange import RolloutWriter, rollout_key
from stoa.transport.identity import enroll_worker, read_salt
from stoa.transport.sequence import RememberingWriter, SequenceFile
from stoa.transport.signing import generate_private_key
from stoa.types import Episode, Segment

from helpers import TINY_FLEET

RUN = "fresh"
ENV = TINY_FLEET["env"]
MAX_LAG = 3


class _Scorer:
    def logprobs(self, episodes, temperature=1.0, *, model_only=False):
        return [np.zeros(len(e.tokens()), np.float32) for e in episodes]


def _make_env():
    import stoa.envs

    return stoa.envs.make(ENV["id"], **ENV["kwargs"])


class _Fleet:
    """A trainer's intake at :attr:`version` (no step is taken: what is accepted stays pooled)."""

    def __init__(self, tmp_path, monkeypatch, mode: str = "open"):
        monkeypatch.setattr("stoa.fleet.trust.duty._SALT_EVERY_S", 0.0)  # the worker looks for its salt every call
        from stoa.transport.store import LocalStore

        self.tmp, self.store, self.key, self.version = tmp_path, LocalStore(tmp_path / "store"), generate_private_key(), 0
        self.cfg = RunConfig.from_dict({"name": RUN, "seed": 3, "env": ENV,
                                        "rollout": {"group_size": 2, "groups_per_cohort": 2},
                                        "trainer": {"groups_per_step": 4096, "max_lag": MAX_LAG},
                                        "trust": {"mode": mode, "replay": False, "audit": {"enabled": False},
                                                  "reward_range": [0.0, 1.0]}})
        self.events: list[dict] = []
        ledger = Ledger(tmp_path / "ledger.jsonl", lambda: {"rl_step": 0, "version": self.version})
        self.intake = Intake(self.cfg, self.store, self.key, vocab_size=700, metric_types={}, ledger=ledger,
                             float_scorer=_Scorer(), int8=None, make_env=_make_env,
                             event=lambda **row: self.events.append(row))

    def worker(self, name: str, enroll: bool = False) -> tuple[RolloutWriter, Duty]:
        wkey = generate_private_key()
        if enroll:
            enroll_worker(self.store, RUN, self.key, wkey.public_key(), name)
            self.poll()
        duty = Duty(self.store, RUN, wkey, self.key.public_key(), run_seed=self.cfg.seed, n_items=self.intake.n_items,
                    groups=2, max_lag=MAX_LAG)
        duty.tickets.retry_s = 0.0
        return RememberingWriter(self.store, RUN, name, wkey, SequenceFile(self.tmp / name / "sequence.json")), duty

    def poll(self, n: int = 1) -> None:
        for _ in range(n):
            self.intake.take(self.version)

    def order(self, writer: RolloutWriter, duty: Duty) -> Order:
        """What the worker's next number owes, as :meth:`Worker._cohort` asks (the trainer polls
        while the worker waits for a binding)."""
        for _ in range(8):
            order = duty.next(writer.skip_taken(), self.version)
            if order.work is not None:
                return order
            if order.skip_to is not None:  # a binding gone stale: the number is left, as the worker does
                writer.next_seq = order.skip_to
                continue
            self.poll()
        raise AssertionError(f"number {writer.next_seq} was never bound: the worker waits for good")

    def batch(self, writer: RolloutWriter, order: Order, **at) -> list[Episode]:
        """The episodes of ``order``'s work (each number its own answers: no group is a copy)."""
        version = order.version if order.version is not None else self.version
        rng = np.random.default_rng(1000 + at.get("seq", order.seq))
        work = at.get("work", order.work)
        return [Episode(rng.integers(0, 700, 5), [Segment("model", rng.integers(0, 700, 4), -rng.random(4))],
                        reward=float(s), policy_version=version, worker_id=writer.worker_id, env_id=ENV["id"],
                        group_id=g, sample_index=s, item_index=i)
                for g, i in zip(work.group_ids, work.items) for s in range(2)]

    def make(self, writer: RolloutWriter, duty: Duty) -> tuple[str, Order]:
        """One cohort: the order, its work uploaded under its number, and a poll."""
        order = self.order(writer, duty)
        key = writer.upload(self.batch(writer, order), order.version if order.version is not None else self.version,
                            seq=order.seq)
        self.poll()
        return key, order

    def pooled(self) -> set[str]:
        return {b.key for b in self.intake.pool.batches()}

    def record(self, duty: Duty):
        return self.intake.gate.records[duty.key_id]

    def document(self):
        return read_document(self.store, RUN, self.key.public_key())


def test_a_fresh_key_gets_one_binding_at_a_time_then_up_to_eight(tmp_path, monkeypatch):
    """An enrolled key has its salt at once but no accepted salted batch: its tickets for numbers
    0-5 bind only number 0, poll after poll, and the document names it fresh; once the trainer has
    accepted its batch 0, the waiting tickets are bound together."""
    fleet = _Fleet(tmp_path, monkeypatch, mode="enrolled")
    writer, duty = fleet.worker("w", enroll=True)
    assert duty.next(0, 0).work is None  # tickets 0 and 1
    for seq in range(2, 6):
        write_ticket(fleet.store, RUN, seq, duty.tickets.private_key)
    fleet.poll(4)
    binder = fleet.intake.gate.binder
    assert binder.bound[duty.key_id] == {0: 0}
    assert duty.key_id in fleet.document().fresh
    first, order = fleet.make(writer, duty)
    assert order.seq == 0 and order.carry and first in fleet.pooled()
    fleet.poll()
    assert set(binder.bound[duty.key_id]) == {0, 1, 2, 3, 4, 5}
    assert duty.key_id not in fleet.document().fresh
    second, order = fleet.make(writer, duty)
    assert order.seq == 1 and not order.carry and second in fleet.pooled()
    assert [e for e in fleet.events if e["event"] == "ticket_refused"] == []


@pytest.mark.parametrize("how", ["its binding expires", "it makes probation work past it"])
def test_a_fresh_key_that_abandons_its_bound_number_loses_its_standing_and_its_worker_redoes_probation(
        tmp_path, monkeypatch, how):
    """A key passes probation, reads what its first salted number is bound to and does not deliver
    it (the grinder's look): it loses its standing, with no strike. Its worker reads that in the
    signed bindings document and makes probation work again; once that is accepted it has its
    standing back, and its bound work is accepted (so each declined look costs a probation)."""
    fleet = _Fleet(tmp_path, monkeypatch)
    writer, duty = fleet.worker("g")
    _, order = fleet.make(writer, duty)  # number 0: probation work, accepted; its salt is published
    assert order.work.probation and read_salt(fleet.store, RUN, duty.key_id, fleet.key.public_key())
    order = fleet.order(writer, duty)  # number 1, bound
    assert order.seq == 1 and not order.work.probation and order.version == 0
    if how == "its binding expires":
        for v in range(1, MAX_LAG + 2):  # the trainer moves on: number 1's version falls out of its window
            fleet.version = v
            fleet.poll()
    else:
        past = assignment(fleet.cfg.seed, duty.key_id, 2, fleet.intake.n_items, 2)  # probation work at number 2
        writer.next_seq = 2
        writer.upload(fleet.batch(writer, Order(2, past), seq=2), fleet.version, seq=2)
        fleet.poll()
    rec = fleet.record(duty)
    assert rec.standing_lost == 1 and rec.probation_owed == 1 and rec.lost_at == 1
    assert rec.strikes == 0 and rec.rejected_batches == 0 and not rec.banned, rec
    fleet.poll()  # the document announces it
    assert fleet.document().lost == {duty.key_id: 1}
    order = fleet.order(writer, duty)
    assert order.work.probation and order.version is None and duty.on_probation()  # probation work again
    key, order = fleet.make(writer, duty)
    assert order.work.probation and fleet.record(duty).probation_owed == 0
    fleet.poll()
    assert fleet.document().lost == {}
    key, order = fleet.make(writer, duty)  # bound work again, accepted
    assert not order.work.probation and key in fleet.pooled() and not duty.on_probation()
    rec = fleet.record(duty)
    assert not rec.fresh and rec.strikes == 0 and rec.standing_lost == 1
    refused = [e for e in fleet.events if e["event"] == "ticket_refused"]
    assert all("no standing" in e["reason"] for e in refused)  # at most the tickets written before it read the word


def _plant(fleet: _Fleet, worker: str, first: int, count: int) -> None:
    for n in range(first, first + count):
        fleet.store.put(rollout_key(RUN, worker, n, 0), b"junk")


@pytest.mark.parametrize("count", [1, 70])
@pytest.mark.parametrize("when", ["before its upload", "read by the trainer before its upload"])
def test_junk_planted_at_an_honest_fresh_keys_bound_number_costs_it_nothing(tmp_path, monkeypatch, when, count):
    """Junk at a fresh key's bound number (and the numbers after it): the worker's writer finds the
    number taken, and since the order is a fresh key's bound work it uploads it under the next free
    number; the trainer takes it as the bound number's work. No standing lost, no strike, no gap."""
    fleet = _Fleet(tmp_path, monkeypatch)
    writer, duty = fleet.worker("w")
    fleet.make(writer, duty)  # probation
    order = fleet.order(writer, duty)
    assert order.carry and order.seq == 1
    _plant(fleet, "w", order.seq, count)
    if when == "read by the trainer before its upload":
        fleet.poll(3)  # quarantined: its copy under quarantine/ still holds the number
    me = Worker(fleet.store, RUN, fleet.key.public_key(), "w", tmp_path / "cache", private_key=duty.tickets.private_key)
    me.writer = writer
    me._pending = _Batch(fleet.batch(writer, order), order.version, order.seq, order.carry)
    me._upload_pending()  # as the worker uploads: carried past the junk
    assert me._pending is None and me.batches == 1 and writer.next_seq == 2 + count
    fleet.poll(3)
    rec = fleet.record(duty)
    assert rec.standing_lost == 0 and rec.strikes == 0 and not rec.fresh and rec.withheld == 0, rec
    assert len(fleet.pooled()) == 1
    key, order = fleet.make(writer, duty)  # and on: its next number is bound and taken
    assert order.seq == 2 + count and key in fleet.pooled()
    assert [e for e in fleet.events if e["event"] == "ticket_refused"] == []


def test_junk_that_hides_an_honest_fresh_keys_batch_costs_one_probation_not_its_standing_for_good(tmp_path,
                                                                                                monkeypatch):
    """The residual: a planter that can also delete (its junk at the bound number is read by the
    trainer first, then the quarantined copy is deleted, so the worker's batch lands at the number
    the trainer has settled and is never read). The binding expires, the key loses its standing
    once, redoes probation, and its bound work is then accepted: a probation's cost, no strike."""
    fleet = _Fleet(tmp_path, monkeypatch)
    writer, duty = fleet.worker("w")
    fleet.make(writer, duty)
    order = fleet.order(writer, duty)
    _plant(fleet, "w", order.seq, 1)
    fleet.poll()
    for k in fleet.store.list(layout.quarantine(RUN, "w")):
        fleet.store.delete(k)
    writer.upload(fleet.batch(writer, order), order.version, seq=order.seq)  # lands where the junk was read
    for v in range(1, MAX_LAG + 3):
        fleet.version = v
        fleet.poll()
    assert fleet.record(duty).standing_lost == 1
    for _ in range(2):
        key, order = fleet.make(writer, duty)  # probation, then bound work again
    assert not order.work.probation and key in fleet.pooled()
    rec = fleet.record(duty)
    assert rec.strikes == 0 and not rec.banned and rec.standing_lost == 1


def test_a_grinder_that_plants_its_own_junk_at_its_bound_number_gets_no_other_look(tmp_path, monkeypatch):
    """A fresh key plants junk at the number it does not like and tickets the next: the next is
    never bound while the first is open, and a batch at it is held to the first number's work
    (other work, such as what the first number's beacon gives for the next number, is refused and
    costs its standing). What it can deliver past its junk is the work it already saw."""
    fleet = _Fleet(tmp_path, monkeypatch)
    writer, duty = fleet.worker("g")
    fleet.make(writer, duty)
    order = fleet.order(writer, duty)
    n = order.seq
    _plant(fleet, "g", n, 1)
    write_ticket(fleet.store, RUN, n + 2, duty.tickets.private_key)
    fleet.poll(4)
    assert set(fleet.intake.gate.binder.bound[duty.key_id]) == {n}  # nothing more to look at
    salt = read_salt(fleet.store, RUN, duty.key_id, fleet.key.public_key())
    other = assignment(fleet.cfg.seed, duty.key_id, n + 1, fleet.intake.n_items, 2, salt,
                       duty.tickets.bindings[n].beacon)
    assert other.items != order.work.items or other.group_ids != order.work.group_ids
    writer.next_seq = n + 1
    writer.upload(fleet.batch(writer, order, work=other, seq=n + 1), order.version, seq=n + 1)
    fleet.poll()
    rec = fleet.record(duty)
    assert rec.rejected.get("assignment") == 1 and rec.standing_lost == 1 and fleet.pooled() == set()


def test_an_enrolled_key_that_leaves_its_first_binding_before_any_batch_keeps_its_worker_id(tmp_path, monkeypatch):
    """An enrolled key's first bound number expires before the trainer has seen any batch of it:
    it loses its standing, and its record (made then) carries its worker id from the roster, so the
    trust report still names it."""
    fleet = _Fleet(tmp_path, monkeypatch, mode="enrolled")
    writer, duty = fleet.worker("w", enroll=True)
    assert duty.next(0, 0).work is None  # tickets 0 and 1
    fleet.poll()
    for v in range(1, MAX_LAG + 2):
        fleet.version = v
        fleet.poll()
    rec = fleet.record(duty)
    assert rec.worker_id == "w" and rec.standing_lost == 1 and rec.strikes == 0
    key, order = fleet.make(writer, duty)  # probation at once: the worker read the word
    assert order.work.probation and fleet.record(duty).worker_id == "w"
