"""Bound numbers: the weight version and the fresh randomness of a key's batch, fixed when it is due.

A key's salted work (:mod:`stoa.fleet.trust.assign`) also depends on a **beacon** that the
trainer draws for one sequence number of one key at the moment that number is due, and the
batch must be made with the weight version bound with it. The exchange, all through the store:

1. **Ticket.** When a worker is about to make its batch ``seq`` it writes a ticket,
   ``<run>/tickets/<key id>/<seq>.json``, signed with its own key (:func:`write_ticket`); it
   tickets up to :data:`TICKETS_AHEAD` numbers at once, so the next binding is ready while the
   current batch is made.
2. **Binding.** At each poll of the store the trainer binds every new ticket of a key with
   standing (enrolled, or with accepted work): the number gets the trainer's current version
   (less ``rollout.lag``) and its beacon, a keyed hash under the run's private key of (run, key,
   number, version) that nobody else can compute (:func:`beacon`). The first binding of a number
   is final, and a key's numbers are bound in increasing order at versions that never go down.
   All live bindings are in one signed document, ``<run>/bindings.json``, written at most once
   per poll; the ticket is deleted after the document is written.
3. **Batch.** The worker reads its binding, brings its weights to exactly the bound version,
   plays the items and sampling seed that ``hash(run seed, key, number, salt, beacon)`` names,
   and uploads the batch under that version. The trainer refuses (``assignment``) a salted
   batch whose number was never bound or that claims another version.

What it buys: nothing about a key's future work is known when the key is admitted or when its
salt is published, only when each number is due; and a number has one version and one random
stream, so a worker holding several versions cannot make its batch under each and keep the one
it likes. What it still can do is drop a bound number and ticket the next one: that leaves a
gap, counted as withheld like any other.

Bounds: a ticket is at most :data:`MAX_TICKET_BYTES`; a key holds at most
:data:`MAX_BOUND_PER_KEY` live bindings (a ticket past that waits for a later poll) and may not
ticket past :data:`MAX_AHEAD` *free* numbers above its highest bound one, so neither a key nor
its waiting tickets run far ahead. A number held by an object under the key's worker id (in the
store now, or settled by the trainer's reader) is not free: the worker's writer skips such
numbers, so junk someone planted there cannot push an honest worker's next number out of reach,
and a key that plants its own junk to reach further pays one object per number, as it would
to skip them anyway (:func:`free_between`). Keys without standing get
no bindings (their work is probation work, which needs none). A ticket that is malformed, does
not verify, or comes from a key without standing is moved to ``<run>/quarantine/_tickets/``
with the reason. A binding whose version is more than ``trainer.max_lag`` behind the trainer is
dropped from the document (any batch under it is stale), and so the document holds a few
entries per active key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

from stoa.transport import layout
from stoa.transport.signing import (
    SignatureError,
    key_id,
    load_private_key,
    load_public_key,
    open_document,
    read_signed,
    sign_document,
)
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge, StoreError

__all__ = ["MAX_AHEAD", "MAX_BOUND_PER_KEY", "TICKETS_AHEAD", "Binder", "Bound", "Held", "TicketListing", "Tickets", "beacon",
           "free_between", "passed_over", "read_bindings", "write_ticket"]

log = logging.getLogger("stoa.trainer")

TICKETS_AHEAD = 2
"""Numbers a worker tickets at once: the one due and the next (its binding comes while the due one is made)."""
MAX_BOUND_PER_KEY = 8
"""Live bindings one key may hold; a further ticket waits for a later poll."""
MAX_AHEAD = 64
"""How many free numbers (held by no object under the key's worker id) may lie between a key's
highest bound number and a ticket; a ticket beyond is refused. It also caps a key's waiting tickets."""
MAX_TICKET_BYTES = 4 << 10
MAX_BINDINGS_BYTES = 32 << 20
_TICKET_KIND, _TICKET_FORMAT = "batch-ticket", "stoa.ticket/1"
_BINDINGS_KIND, _BINDINGS_FORMAT = "batch-bindings", "stoa.bindings/1"
_TICKET_NAME = re.compile(rf"({layout.KEY_ID.pattern})/([0-9]{{12}})\.json")


@dataclass(frozen=True)
class TicketListing:
    """The tickets in the store at one listing (:meth:`Binder.listing`)."""

    parsed: list[tuple[str, int, str]]
    """``(key id, number, object key)``, sorted."""
    malformed: list[str]
    """Object keys that are not a ticket's name."""

    def keys(self) -> set[str]:
        """The key ids that wrote a ticket."""
        return {kid for kid, _, _ in self.parsed}


@dataclass(frozen=True)
class Bound:
    """Number ``seq`` of a key is made with weight ``version`` and mixes ``beacon`` into its work."""

    seq: int
    version: int
    beacon: str


def beacon(private_key: Any, run: str, kid: str, seq: int, version: int) -> str:
    """The beacon of number ``seq`` of key ``kid`` bound at ``version`` (32 hex): a keyed hash under
    the run's private key, so only the trainer can make it and a restarted trainer makes it again."""
    return _beacon(_mac_key(private_key), run.strip("/"), kid, seq, version)


def _mac_key(private_key: Any) -> bytes:
    return hashlib.sha256(b"stoa-binding-beacon-key\x1f" + load_private_key(private_key).private_bytes_raw()).digest()


def _beacon(mac_key: bytes, run: str, kid: str, seq: int, version: int) -> str:
    text = f"stoa-binding-beacon\x1f{run}\x1f{kid}\x1f{seq}\x1f{version}"
    return hashlib.blake2b(text.encode(), key=mac_key, digest_size=16).hexdigest()


Held = Callable[[str, int, int], set[int]]
"""``held(key id, after, below)``: the numbers in ``(after, below)`` that objects under the key's
worker id hold, whoever wrote them (the trainer's intake answers it from the store and its reader)."""


def free_between(top: int, seq: int, held: set[int] | frozenset[int]) -> int:
    """How many numbers strictly between ``top`` and ``seq`` no object holds (``held``): the
    lookahead a ticket for ``seq`` asks for when ``top`` is its key's highest bound number."""
    return max(0, seq - top - 1 - sum(1 for n in held if top < n < seq))


def _is_int(n: object, low: int = 0) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and low <= n <= layout.MAX_SEQ


# -- the worker's side --------------------------------------------------------------------------


def write_ticket(store: ObjectStore, run: str, seq: int, private_key: Any) -> str:
    """Ask the trainer to bind number ``seq`` of this key (signed with the worker's own key);
    returns the ticket's store key. Writing it again is harmless: the first binding stands."""
    key = load_private_key(private_key)
    pub = key.public_key()
    kid = key_id(pub)
    body = {"format": _TICKET_FORMAT, "run": run.strip("/"), "key_id": kid, "seq": int(seq),
            "public_key": pub.public_bytes_raw().hex()}
    where = layout.ticket(run.strip("/"), kid, seq)
    store.put(where, sign_document(_TICKET_KIND, body, key))
    return where


def read_bindings(store: ObjectStore, run: str, public_key: Any) -> tuple[dict[str, dict[int, Bound]], dict[str, int]]:
    """``(bound, top)`` from the trainer's signed ``bindings.json``: each key's live bindings by
    number, and each key's highest number ever bound; empty while there is none. Raises
    :class:`SignatureError` (a document that does not verify or breaks the schema) or ``StoreError``."""
    run = run.strip("/")
    where = layout.bindings(run)
    body = read_signed(store, where, _BINDINGS_KIND, public_key, expect={"run": run}, max_bytes=MAX_BINDINGS_BYTES)
    if body is None:
        return {}, {}
    entries, top = body.get("bindings"), body.get("top")
    if body.get("format") != _BINDINGS_FORMAT or not isinstance(entries, dict) or not isinstance(top, dict):
        raise SignatureError(f"{where}: not a {_BINDINGS_FORMAT} document")
    bound: dict[str, dict[int, Bound]] = {}
    for kid, rows in entries.items():
        if not layout.KEY_ID.fullmatch(kid) or not isinstance(rows, list):
            raise SignatureError(f"{where}: malformed entry for key {kid[:20]!r}")
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and _is_int(row[0]) and _is_int(row[1])
                    and isinstance(row[2], str) and layout.HEX32.fullmatch(row[2])):
                raise SignatureError(f"{where}: malformed binding of key {kid}: {str(row)[:80]}")
            bound.setdefault(kid, {})[row[0]] = Bound(row[0], row[1], row[2])
    if not all(layout.KEY_ID.fullmatch(k) and _is_int(v) for k, v in top.items()):
        raise SignatureError(f"{where}: malformed highest numbers")
    return bound, dict(top)


def passed_over(seq: int, bound: dict[int, Bound], top: int) -> int | None:
    """For a worker whose next number ``seq`` has no binding in the document it just read (its
    key's live ``bound`` numbers and ``top``, its highest number ever bound): the number to move to
    when ``seq`` will never be bound (the trainer binds only numbers above ``top``, so ``seq`` was
    bound once and its binding expired with its version, or it was passed over), else None (wait
    for the binding). The numbers skipped are a gap, like any number whose version went stale."""
    if seq in bound or seq > top:
        return None
    return min([n for n in bound if n > seq] + [top + 1])


class Tickets:
    """A worker's side of the exchange for one key: tickets its due number and the next ones (again
    after :attr:`retry_s` without a binding) and reads its bindings from the signed document."""

    retry_s = 30.0

    def __init__(self, store: ObjectStore, run: str, private_key: Any, public_key: Any):
        self.store, self.run, self.private_key, self.public_key = store, run, private_key, public_key
        self.kid = key_id(load_private_key(private_key).public_key())
        self.ticketed: dict[int, float] = {}  # number -> when its ticket was written
        self.bindings: dict[int, Bound] = {}  # this key's live bindings, as last read
        self.top = -1  # this key's highest number the trainer ever bound, as last read

    def bound(self, seq: int) -> Bound | None:
        """Number ``seq``'s binding, or None while the trainer has not bound it. Raises
        :class:`SignatureError` (a document that does not verify) or ``StoreError``."""
        now = time.time()
        for s in range(seq, seq + TICKETS_AHEAD):
            if s not in self.bindings and s > self.top and now - self.ticketed.get(s, 0.0) > self.retry_s:
                write_ticket(self.store, self.run, s, self.private_key)
                self.ticketed[s] = now
        if seq not in self.bindings:
            bound, top = read_bindings(self.store, self.run, self.public_key)
            self.bindings, self.top = dict(bound.get(self.kid, {})), top.get(self.kid, -1)
        self.ticketed = {s: t for s, t in self.ticketed.items() if s >= seq}
        return self.bindings.get(seq)

    def passed_over(self, seq: int) -> int | None:
        """:func:`passed_over` for ``seq`` by the bindings last read."""
        return passed_over(seq, self.bindings, self.top)


# -- the trainer's side -------------------------------------------------------------------------


class Binder:
    """The trainer's bindings (see the module docstring): reads the tickets, binds them, keeps the
    signed document current, and answers what a key's number is bound to.

    State (checkpointed, and merged with the store's signed document at start): ``bound`` (key ->
    number -> version) and ``top`` (key -> highest number ever bound)."""

    def __init__(self, store: ObjectStore, run: str, private_key: Any):
        self.store, self.run, self.key = store, run.strip("/"), load_private_key(private_key)
        self._mac = _mac_key(self.key)
        self.bound: dict[str, dict[int, int]] = {}
        self.top: dict[str, int] = {}
        self.dirty = False
        self.bound_total = self.tickets_refused = 0

    # -- questions ----------------------------------------------------------------------------
    def bound_to(self, kid: str, seq: int) -> Bound | None:
        """What number ``seq`` of ``kid`` is bound to, or None (never bound, or dropped as stale)."""
        version = self.bound.get(kid, {}).get(seq)
        return None if version is None else Bound(seq, version, _beacon(self._mac, self.run, kid, seq, version))

    # -- binding ------------------------------------------------------------------------------
    def bind(self, kid: str, seq: int, version: int) -> Bound | None:
        """Bind number ``seq`` of ``kid`` to ``version`` unless a number at or above it was bound
        already (the first binding stands: then its binding, or None when it is gone)."""
        if seq <= self.top.get(kid, -1):
            return self.bound_to(kid, seq)
        self.bound.setdefault(kid, {})[seq] = version
        self.top[kid] = seq
        self.dirty = True
        self.bound_total += 1
        return self.bound_to(kid, seq)

    def listing(self) -> TicketListing:
        """The tickets in the store now, by name (nothing is read or verified yet). Store errors
        are logged; the listing is then empty."""
        try:
            keys = self.store.list(layout.tickets(self.run))
        except StoreError as e:
            log.warning("could not list the tickets (%s); will retry", e)
            return TicketListing([], [])
        prefix = layout.tickets(self.run)
        parsed, malformed = [], []
        for k in keys:
            m = _TICKET_NAME.fullmatch(k[len(prefix):])
            if m is None or not _is_int(int(m.group(2))):
                malformed.append(k)
                continue
            parsed.append((m.group(1), int(m.group(2)), k))
        return TicketListing(sorted(parsed), malformed)

    def poll(self, version: int, standing: Container[str], held: Held | None = None,
             listing: TicketListing | None = None) -> list[tuple[str, str, str]]:
        """Read the tickets of ``listing`` (None: list them now), bind those of keys in
        ``standing`` at ``version``, write the document if anything changed, then delete the
        tickets read. Returns the refused ones as ``(key id or "", ticket key, reason)`` (already
        moved to the quarantine). ``held`` answers which numbers objects under a key's worker id
        hold (None: none counted); it is asked only for a genuine ticket of a key with standing
        more than :data:`MAX_AHEAD` numbers past its key's highest bound one, so a forged ticket
        costs the trainer no listing. Store errors are logged; the tickets then stay for the
        next poll."""
        listing = self.listing() if listing is None else listing
        done: list[str] = []
        refused = [("", k, "not a ticket's name (<key id>/<12-digit number>.json)") for k in listing.malformed]
        parsed = listing.parsed
        last = {kid: seq for kid, seq, _ in parsed}  # each key's highest ticketed number (sorted)
        occupied: dict[str, set[int]] = {}
        waiting: dict[str, int] = {}
        for kid, seq, k in parsed:
            top = self.top.get(kid, -1)
            if seq <= top:  # bound already (the first binding stands), or below one
                done.append(k)
                continue
            far = seq > top + MAX_AHEAD
            why = None
            if far or len(self.bound.get(kid, {})) < MAX_BOUND_PER_KEY:
                why = self._ticket_problem(k, kid, seq)
                if why is None and kid not in standing:
                    why = "the key has no standing (no accepted batch, not enrolled, or banned): its work is probation work"
            if why is None and far:  # held numbers are looked up only for a genuine ticket of a key with standing
                if kid not in occupied:  # once a poll, up to the key's furthest ticket
                    occupied[kid] = set(held(kid, top, last[kid])) if held is not None else set()
                if free_between(top, seq, occupied[kid]) >= MAX_AHEAD:
                    why = f"number {seq} is more than {MAX_AHEAD} free numbers past the key's highest bound number"
            if why is not None:
                refused.append((kid, k, why))
                continue
            if len(self.bound.get(kid, {})) >= MAX_BOUND_PER_KEY:
                waiting[kid] = waiting.get(kid, 0) + 1
                if waiting[kid] > MAX_AHEAD:
                    refused.append((kid, k, f"more than {MAX_AHEAD} of the key's tickets wait for a binding"))
                continue  # waits for a later poll
            self.bind(kid, seq, version)
            done.append(k)
        if self.dirty and not self.write():
            return []  # the tickets stay: bound again (the same way) once the document is written
        for k in done:
            self._delete(k)
        for kid, k, why in refused:
            self._quarantine(k, why)
        self.tickets_refused += len(refused)
        return refused

    def prune(self, oldest: int) -> None:
        """Drop bindings whose version is below ``oldest`` (any batch under them is stale)."""
        for kid in list(self.bound):
            live = {s: v for s, v in self.bound[kid].items() if v >= oldest}
            if len(live) != len(self.bound[kid]):
                self.dirty = True
                if live:
                    self.bound[kid] = live
                else:
                    del self.bound[kid]

    def write(self) -> bool:
        """Put the signed document of the live bindings; False (logged) when the store failed."""
        entries = {kid: [[s, v, _beacon(self._mac, self.run, kid, s, v)] for s, v in sorted(rows.items())]
                   for kid, rows in sorted(self.bound.items())}
        body = {"format": _BINDINGS_FORMAT, "run": self.run, "time": time.time(), "bindings": entries,
                "top": dict(sorted(self.top.items()))}
        try:
            self.store.put(layout.bindings(self.run), sign_document(_BINDINGS_KIND, body, self.key))
        except StoreError as e:
            log.warning("could not write the bindings document (%s); will retry", e)
            return False
        self.dirty = False
        return True

    # -- tickets ------------------------------------------------------------------------------
    def _ticket_problem(self, where: str, kid: str, seq: int) -> str | None:
        """Why the ticket at ``where`` is not a valid ticket of ``kid`` for ``seq``, or None."""
        try:
            blob = self.store.get(where, max_bytes=MAX_TICKET_BYTES)
        except KeyNotFound:
            return "gone before it was read"
        except ObjectTooLarge:
            return f"over {MAX_TICKET_BYTES} bytes"
        except StoreError as e:
            return f"unreadable: {e}"
        try:
            env = json.loads(blob)
            body = json.loads(env["body"])
            pub = load_public_key(bytes.fromhex(body["public_key"]))
        except Exception as e:  # a stranger's bytes: whatever they break is the ticket's fault
            return f"not a signed ticket ({type(e).__name__})"
        if key_id(pub) != kid:
            return f"its public key is key {key_id(pub)}, not {kid}"
        try:
            body = open_document(blob, _TICKET_KIND, pub, where)
        except SignatureError as e:
            return str(e)
        if (body.get("format") != _TICKET_FORMAT or body.get("run") != self.run or body.get("key_id") != kid
                or body.get("seq") != seq or set(body) != {"format", "run", "key_id", "seq", "public_key"}):
            return f"not a {_TICKET_FORMAT} ticket of this run, key and number"
        return None

    def _delete(self, where: str) -> None:
        try:
            self.store.delete(where)
        except StoreError as e:
            log.info("could not delete ticket %s (%s); the next poll meets it again", where, e)

    def _quarantine(self, where: str, reason: str) -> None:
        """Copy (up to its size cap), explain, delete: a crash in between quarantines it again."""
        dest = layout.quarantined_ticket(self.run, hashlib.sha256(where.encode("utf-8", "surrogatepass")).hexdigest()[:32])
        try:
            try:
                blob: bytes | None = self.store.get(where, max_bytes=MAX_TICKET_BYTES)
            except (KeyNotFound, ObjectTooLarge):
                blob = None
            if blob is not None:
                self.store.put(dest, blob)
            self.store.put(dest + ".reason.json", json.dumps(
                {"key": where[:1024], "reason": reason[:2000], "copied": blob is not None, "time": time.time()},
                indent=1).encode())
            self.store.delete(where)
        except StoreError as e:
            log.info("could not quarantine ticket %s (%s); the next poll meets it again", where, e)
        log.warning("refused ticket %s: %s", where, reason)

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"bound": {kid: sorted(rows.items()) for kid, rows in self.bound.items()}, "top": dict(self.top)}

    def restore(self, state: dict[str, Any]) -> None:
        """Merge a checkpoint's bindings in (what is known already stands: it is newer)."""
        for kid, rows in state.get("bound", {}).items():
            for s, v in rows:
                self.bound.setdefault(kid, {}).setdefault(int(s), int(v))
        for kid, s in state.get("top", {}).items():
            self.top[kid] = max(self.top.get(kid, -1), int(s))

    def recover(self) -> None:
        """Merge the bindings of the store's signed document in (a restart keeps every binding a
        worker may have seen). A document that does not verify is logged and ignored."""
        try:
            bound, top = read_bindings(self.store, self.run, self.key.public_key())
        except (SignatureError, StoreError) as e:
            log.warning("the bindings document does not read (%s); starting from the checkpoint's", e)
            return
        self.restore({"bound": {kid: [(b.seq, b.version) for b in rows.values()] for kid, rows in bound.items()},
                      "top": top})
