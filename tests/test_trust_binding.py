"""Batch bindings on a real local store: tickets signed by workers' keys, the trainer's binder, the
signed bindings document, quarantine of bad tickets, caps per key, and restarts."""

from __future__ import annotations

import json

import pytest

from stoa.fleet.trust.binding import (MAX_AHEAD, MAX_BOUND_PER_KEY, Binder, beacon, passed_over, read_bindings,
                                     write_ticket)
from stoa.transport import layout
from stoa.transport.signing import SignatureError, generate_private_key, key_id, sign_document
from stoa.transport.store import LocalStore


class _AnyKey:
    """Every key has standing (the binder's own tests)."""

    def __contains__(self, kid: object) -> bool:
        return True


ANY_KEY = _AnyKey()

RUN = "bind"


def _kid(key) -> str:
    return key_id(key.public_key())


def _reasons(store) -> dict[str, str]:
    out = {}
    for k in store.list(f"{RUN}/quarantine/_tickets/"):
        if k.endswith(".reason.json"):
            body = json.loads(store.get(k))
            out[body["key"]] = body["reason"]
    return out


def test_a_ticketed_number_is_bound_once_to_the_version_of_the_poll_that_saw_it(tmp_path):
    store, run_key, w = LocalStore(tmp_path), generate_private_key(), generate_private_key()
    binder = Binder(store, RUN, run_key)
    assert binder.poll(5, ANY_KEY) == [] and not store.exists(layout.bindings(RUN))  # nothing to bind
    for seq in (0, 1):
        write_ticket(store, RUN, seq, w)
    assert binder.poll(5, ANY_KEY) == []
    bound, top = read_bindings(store, RUN, run_key.public_key())
    b0 = bound[_kid(w)][0]
    assert (b0.version, bound[_kid(w)][1].version, top) == (5, 5, {_kid(w): 1})
    assert b0.beacon == beacon(run_key, RUN, _kid(w), 0, 5) != beacon(generate_private_key(), RUN, _kid(w), 0, 5)
    assert b0.beacon != bound[_kid(w)][1].beacon and store.list(layout.tickets(RUN)) == []  # read, then deleted
    write_ticket(store, RUN, 0, w)  # asked again later, at a newer version: the first binding stands
    binder.poll(7, ANY_KEY)
    assert binder.bound_to(_kid(w), 0) == b0 and read_bindings(store, RUN, run_key.public_key())[0][_kid(w)][0] == b0
    write_ticket(store, RUN, 3, w)  # one poll binds a key's numbers in increasing order
    write_ticket(store, RUN, 2, w)
    binder.poll(7, ANY_KEY)
    assert binder.bound_to(_kid(w), 3).version == 7 and binder.bound_to(_kid(w), 2).version == 7
    write_ticket(store, RUN, 5, w)
    binder.poll(7, ANY_KEY)
    write_ticket(store, RUN, 4, w)  # below a bound number: never bound (a skipped number stays a gap)
    binder.poll(8, ANY_KEY)
    assert binder.bound_to(_kid(w), 4) is None and binder.bind(_kid(w), 4, 8) is None
    assert binder.bind(_kid(w), 2, 9).version == 7 and store.list(layout.tickets(RUN)) == []
    binder.prune(6)  # versions below 6 can only make stale batches
    assert binder.bound_to(_kid(w), 0) is None and binder.bound_to(_kid(w), 3) is not None
    binder.poll(8, ANY_KEY)
    assert 0 not in read_bindings(store, RUN, run_key.public_key())[0][_kid(w)]


def test_bad_tickets_are_quarantined_with_a_reason_and_bind_nothing(tmp_path):
    store, run_key = LocalStore(tmp_path), generate_private_key()
    honest, stranger, other = generate_private_key(), generate_private_key(), generate_private_key()
    binder = Binder(store, RUN, run_key)
    planted = {
        layout.ticket(RUN, _kid(honest), 0): b"not json",
        layout.ticket(RUN, _kid(honest), 1): write_ticket(store, RUN, 1, other) and store.get(
            layout.ticket(RUN, _kid(other), 1)),  # another key's genuine ticket, copied to this key's name
        layout.ticket(RUN, _kid(honest), 2): sign_document("batch-ticket", {
            "format": "stoa.ticket/1", "run": "another-run", "key_id": _kid(honest), "seq": 2,
            "public_key": honest.public_key().public_bytes_raw().hex()}, honest),
        layout.ticket(RUN, _kid(honest), 3): b"x" * 10_000,
        f"{RUN}/tickets/{_kid(honest)}/7.json": b"{}",
        f"{RUN}/tickets/junk": b"{}",
    }
    store.delete(layout.ticket(RUN, _kid(other), 1))
    for k, blob in planted.items():
        store.put(k, blob)
    write_ticket(store, RUN, 0, stranger)  # genuine, but the key has no standing
    write_ticket(store, RUN, MAX_AHEAD + 5, other)  # genuine, far past anything bound for its key
    refused = binder.poll(3, {_kid(honest), _kid(other)})
    reasons = _reasons(store)
    assert {k for _, k, _ in refused} == set(reasons) and len(reasons) == 8
    assert "not a signed ticket" in reasons[layout.ticket(RUN, _kid(honest), 0)]
    assert "its public key is key" in reasons[layout.ticket(RUN, _kid(honest), 1)]
    assert "not a stoa.ticket/1 ticket of this run" in reasons[layout.ticket(RUN, _kid(honest), 2)]
    assert "over 4096 bytes" in reasons[layout.ticket(RUN, _kid(honest), 3)]
    assert "not a ticket's name" in reasons[f"{RUN}/tickets/junk"]
    assert "no standing" in reasons[layout.ticket(RUN, _kid(stranger), 0)]
    assert f"more than {MAX_AHEAD} free numbers past" in reasons[layout.ticket(RUN, _kid(other), MAX_AHEAD + 5)]
    assert binder.bound == {} and store.list(layout.tickets(RUN)) == []
    write_ticket(store, RUN, 0, honest)  # the key's own ticket still binds its number afterwards
    assert binder.poll(3, ANY_KEY) == [] and binder.bound_to(_kid(honest), 0).version == 3


def test_a_key_holds_a_bounded_number_of_live_bindings(tmp_path):
    store, run_key, w = LocalStore(tmp_path), generate_private_key(), generate_private_key()
    binder = Binder(store, RUN, run_key)
    for seq in range(MAX_BOUND_PER_KEY + 4):
        write_ticket(store, RUN, seq, w)
    binder.poll(1, ANY_KEY)
    assert len(binder.bound[_kid(w)]) == MAX_BOUND_PER_KEY and len(store.list(layout.tickets(RUN))) == 4  # waiting
    binder.prune(2)  # every live binding went stale: room for the waiting tickets, at the new version
    binder.poll(2, ANY_KEY)
    assert sorted(binder.bound[_kid(w)]) == list(range(MAX_BOUND_PER_KEY, MAX_BOUND_PER_KEY + 4))
    assert {b.version for b in read_bindings(store, RUN, run_key.public_key())[0][_kid(w)].values()} == {2}


def test_a_restarted_binder_keeps_every_binding_a_worker_may_have_seen(tmp_path):
    """A checkpoint older than the store's document, or none: a number bound before the restart
    keeps its version and beacon, and is never bound again."""
    store, run_key, w = LocalStore(tmp_path), generate_private_key(), generate_private_key()
    binder = Binder(store, RUN, run_key)
    write_ticket(store, RUN, 0, w)
    binder.poll(1, ANY_KEY)
    checkpoint = binder.state()
    write_ticket(store, RUN, 1, w)
    binder.poll(2, ANY_KEY)  # bound after the checkpoint
    seen = binder.bound_to(_kid(w), 1)
    again = Binder(store, RUN, run_key)
    again.recover()
    again.restore(checkpoint)
    assert again.bound_to(_kid(w), 1) == seen and again.bound_to(_kid(w), 0).version == 1
    write_ticket(store, RUN, 1, w)  # the worker, restarted too, tickets its number again
    again.poll(5, ANY_KEY)
    assert again.bound_to(_kid(w), 1) == seen


def test_a_bindings_document_that_breaks_its_schema_does_not_read(tmp_path):
    store, run_key = LocalStore(tmp_path), generate_private_key()
    good = {"format": "stoa.bindings/1", "run": RUN, "time": 0.0, "top": {}}
    for entries in ({"nothex": []}, {"0123456789abcdef": [[0, 1]]}, {"0123456789abcdef": [[0, -1, "a" * 32]]},
                    {"0123456789abcdef": [[0, 1, "zz"]]}):
        store.put(layout.bindings(RUN), sign_document("batch-bindings", {**good, "bindings": entries}, run_key))
        with pytest.raises(SignatureError):
            read_bindings(store, RUN, run_key.public_key())
    store.put(layout.bindings(RUN), sign_document("batch-bindings", {**good, "bindings": {}}, generate_private_key()))
    with pytest.raises(SignatureError):  # not the run's key
        read_bindings(store, RUN, run_key.public_key())


def test_a_worker_whose_bound_numbers_expired_while_it_slept_moves_past_them(tmp_path):
    # A worker tickets its next numbers ahead; asleep (or slow) past the trainer's window, their
    # bindings are pruned as stale, and a ticket for them again is "bound already". Waiting for
    # them would stall the worker for good: it must leave them as a gap and ticket anew.
    store, run_key, w = LocalStore(tmp_path), generate_private_key(), generate_private_key()
    binder = Binder(store, RUN, run_key)
    for seq in (4, 5):
        write_ticket(store, RUN, seq, w)
    binder.poll(2, ANY_KEY)
    binder.prune(3)  # the trainer moved on: versions below 3 can only make stale batches
    binder.poll(6, ANY_KEY)
    bound, top = read_bindings(store, RUN, run_key.public_key())
    mine, high = bound.get(_kid(w), {}), top[_kid(w)]
    assert mine == {} and high == 5
    write_ticket(store, RUN, 4, w)  # asking again binds nothing
    binder.poll(7, ANY_KEY)
    assert binder.bound_to(_kid(w), 4) is None
    assert passed_over(4, mine, high) == 6  # so the worker moves past both
    write_ticket(store, RUN, 6, w)
    binder.poll(7, ANY_KEY)
    bound, top = read_bindings(store, RUN, run_key.public_key())
    assert bound[_kid(w)][6].version == 7 and passed_over(6, bound[_kid(w)], top[_kid(w)]) is None
    assert passed_over(7, bound[_kid(w)], top[_kid(w)]) is None  # above the top: wait for its binding
    write_ticket(store, RUN, 8, w)  # 7 never ticketed, 8 bound: 7 is passed over, to 8
    binder.poll(7, ANY_KEY)
    bound, top = read_bindings(store, RUN, run_key.public_key())
    assert passed_over(7, bound[_kid(w)], top[_kid(w)]) == 8
