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

**A fresh key holds one binding at a time.** A key with no accepted salted batch since it
gained standing (*fresh*: a newcomer past probation, a newly enrolled key) gets a ticket bound
only once the trainer has read a batch of it at or past its highest bound number; its other
tickets wait. A fresh key that leaves that number undelivered (its binding expires, or the
trainer reads anything else of it there or past it) loses its standing and makes probation work
again (the gate decides, :mod:`stoa.fleet.trust.gate`; the document says so, below). So each
look at bound work that a fresh key declines costs a whole probation. Its bound work may land at
a later number (:meth:`Binder.carry`): junk someone planted at its bound number then costs it
nothing, and gives a key that plants its own nothing either (the work is the bound number's).

The document also names the fresh keys holding a live binding (``fresh``: their worker may carry
its bound work past others' objects) and the keys that lost their standing (``lost``: key -> the
number they left; their worker makes probation work until the trainer lists them no longer).
Both are in the signed document because both change what an honest worker does: an unsigned
word could make it waste work.

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
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
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

__all__ = ["MAX_AHEAD", "MAX_BOUND_PER_KEY", "MAX_LOST_LISTED", "TICKETS_AHEAD", "Binder", "Bound", "Bindings", "Held",
           "TicketListing", "Tickets", "beacon", "free_between", "passed_over", "read_bindings", "read_document",
           "write_ticket"]

log = logging.getLogger("stoa.trainer")

TICKETS_AHEAD = 2
"""Numbers a worker tickets at once: the one due and the next (its binding comes while the due one is made)."""
MAX_BOUND_PER_KEY = 8
"""Live bindings one key may hold; a further ticket waits for a later poll."""
MAX_AHEAD = 64
"""How many free numbers (held by no object under the key's worker id) may lie between a key's
highest bound number and a ticket; a ticket beyond is refused. It also caps a key's waiting tickets."""
MAX_LOST_LISTED = 4096
"""Keys that lost their standing named in the document (those seen most recently; a key that
tickets again is seen again)."""
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
    made_as: int | None = None
    """The number whose work this is, when a fresh key's bound work was carried to ``seq``
    (:meth:`Binder.carry`); None: ``seq`` itself."""

    @property
    def work_seq(self) -> int:
        """The number the assigned work is computed for."""
        return self.seq if self.made_as is None else self.made_as


@dataclass(frozen=True)
class Bindings:
    """The signed bindings document as a worker reads it (:func:`read_document`)."""

    bound: dict[str, dict[int, Bound]]
    """Each key's live bindings by number."""
    top: dict[str, int]
    """Each key's highest number ever bound."""
    fresh: frozenset[str] = frozenset()
    """Fresh keys holding a live binding: one at a time, and their bound work may be carried
    past numbers others' objects hold."""
    lost: dict[str, int] = field(default_factory=dict)
    """Keys that lost their standing -> the number they left undelivered: they make probation work."""


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


def read_document(store: ObjectStore, run: str, public_key: Any) -> Bindings:
    """The trainer's signed ``bindings.json`` (:class:`Bindings`; empty while there is none).
    Raises :class:`SignatureError` (a document that does not verify or breaks the schema) or
    ``StoreError``."""
    run = run.strip("/")
    where = layout.bindings(run)
    body = read_signed(store, where, _BINDINGS_KIND, public_key, expect={"run": run}, max_bytes=MAX_BINDINGS_BYTES)
    if body is None:
        return Bindings({}, {})
    entries, top = body.get("bindings"), body.get("top")
    fresh, lost = body.get("fresh", []), body.get("lost", {})
    if (body.get("format") != _BINDINGS_FORMAT or not isinstance(entries, dict) or not isinstance(top, dict)
            or not isinstance(fresh, list) or not isinstance(lost, dict)):
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
    if not all(isinstance(k, str) and layout.KEY_ID.fullmatch(k) for k in fresh) or not all(
            layout.KEY_ID.fullmatch(k) and _is_int(v, -1) for k, v in lost.items()):
        raise SignatureError(f"{where}: malformed standing")
    return Bindings(bound, dict(top), frozenset(fresh), dict(lost))


def read_bindings(store: ObjectStore, run: str, public_key: Any) -> tuple[dict[str, dict[int, Bound]], dict[str, int]]:
    """``(bound, top)`` of :func:`read_document`: each key's live bindings by number, and each
    key's highest number ever bound."""
    doc = read_document(store, run, public_key)
    return doc.bound, doc.top


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
    after :attr:`retry_s` without a binding) and reads its bindings and its standing from the
    signed document."""

    retry_s = 30.0

    def __init__(self, store: ObjectStore, run: str, private_key: Any, public_key: Any):
        self.store, self.run, self.private_key, self.public_key = store, run, private_key, public_key
        self.kid = key_id(load_private_key(private_key).public_key())
        self.ticketed: dict[int, float] = {}  # number -> when its ticket was written
        self.bindings: dict[int, Bound] = {}  # this key's live bindings, as last read
        self.top = -1  # this key's highest number the trainer ever bound, as last read
        self.fresh = False  # as last read: one binding at a time, and its bound work may be carried
        self.lost: int | None = None  # as last read: the number this key left undelivered (it makes probation work)

    def read(self) -> None:
        """Read this key's bindings and standing from the document. Raises :class:`SignatureError`
        (a document that does not verify) or ``StoreError``."""
        doc = read_document(self.store, self.run, self.public_key)
        self.bindings, self.top = dict(doc.bound.get(self.kid, {})), doc.top.get(self.kid, -1)
        self.fresh, self.lost = self.kid in doc.fresh, doc.lost.get(self.kid)

    def bound(self, seq: int) -> Bound | None:
        """Number ``seq``'s binding, or None while the trainer has not bound it or while this key's
        standing is lost (:attr:`lost`: no tickets then; the document is read at every call).
        Raises :class:`SignatureError` (a document that does not verify) or ``StoreError``."""
        if seq not in self.bindings or self.lost is not None:
            self.read()
        now = time.time()
        if self.lost is None:
            for s in range(seq, seq + TICKETS_AHEAD):
                if s not in self.bindings and s > self.top and now - self.ticketed.get(s, 0.0) > self.retry_s:
                    write_ticket(self.store, self.run, s, self.private_key)
                    self.ticketed[s] = now
        self.ticketed = {s: t for s, t in self.ticketed.items() if s >= seq}
        return None if self.lost is not None else self.bindings.get(seq)

    def passed_over(self, seq: int) -> int | None:
        """:func:`passed_over` for ``seq`` by the bindings last read."""
        return passed_over(seq, self.bindings, self.top)


# -- the trainer's side -------------------------------------------------------------------------


class Binder:
    """The trainer's bindings (see the module docstring): reads the tickets, binds them, keeps the
    signed document current, and answers what a key's number is bound to.

    State (checkpointed, and merged with the store's signed document at start): ``bound`` (key ->
    number -> version), ``top`` (key -> highest number ever bound) and ``carried`` (key -> number
    -> the number whose work it carries). What the document says of standing (``fresh``, ``lost``)
    is the gate's word, given at each :meth:`poll`."""

    def __init__(self, store: ObjectStore, run: str, private_key: Any):
        self.store, self.run, self.key = store, run.strip("/"), load_private_key(private_key)
        self._mac = _mac_key(self.key)
        self.bound: dict[str, dict[int, int]] = {}
        self.top: dict[str, int] = {}
        self.carried: dict[str, dict[int, int]] = {}
        self.fresh: dict[str, int] = {}  # fresh key -> the highest number of it the trainer read (the gate's)
        self.lost: dict[str, int] = {}  # key that lost its standing -> the number it left (the gate's)
        self.dirty = False
        self.bound_total = self.tickets_refused = 0

    # -- questions ----------------------------------------------------------------------------
    def bound_to(self, kid: str, seq: int) -> Bound | None:
        """What number ``seq`` of ``kid`` is bound to, or None (never bound, or dropped as stale)."""
        version = self.bound.get(kid, {}).get(seq)
        if version is None:
            return None
        made = self.carried.get(kid, {}).get(seq)
        return Bound(seq, version, _beacon(self._mac, self.run, kid, seq if made is None else made, version), made)

    def open_number(self, kid: str, read: int | None = None) -> int | None:
        """A fresh key's bound number that no batch of it has reached yet (its highest bound one,
        live, above ``read``: the highest number of it the trainer read, for a key the caller
        knows is fresh; None: the key's freshness and number as the gate last said), or None.
        While there is one, the key gets no other binding."""
        if read is None:
            if kid not in self.fresh:
                return None
            read = self.fresh[kid]
        top = self.top.get(kid, -1)
        return top if top > read and top in self.bound.get(kid, {}) else None

    def carry(self, kid: str, seq: int, read: int) -> Bound | None:
        """Let a fresh key's batch at ``seq`` deliver its open bound number below it (the worker's
        writer found that number held by another's object and went on to the next free one): the
        binding moves to ``seq`` with its version and its work, which stay those of the number
        it was bound for, so carrying chooses nothing. ``read``: the highest number of the key the
        trainer has read (a number already reached is never carried). Returns the binding, or
        None when there is nothing to carry."""
        n = self.open_number(kid, read) if kid in self.fresh else None
        if n is None or seq <= n:
            return None
        self.bound[kid][seq] = self.bound[kid].pop(n)
        self.carried.setdefault(kid, {})[seq] = n
        self.top[kid] = seq
        self.dirty = True
        return self.bound_to(kid, seq)

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
             listing: TicketListing | None = None, *, fresh: Mapping[str, int] | None = None,
             lost: Mapping[str, int] | None = None) -> list[tuple[str, str, str]]:
        """Read the tickets of ``listing`` (None: list them now), bind those of keys in
        ``standing`` at ``version``, write the document if anything changed, then delete the
        tickets read. Returns the refused ones as ``(key id or "", ticket key, reason)`` (already
        moved to the quarantine). ``held`` answers which numbers objects under a key's worker id
        hold (None: none counted); it is asked only for a genuine ticket of a key with standing
        more than :data:`MAX_AHEAD` numbers past its key's highest bound one, so a forged ticket
        costs the trainer no listing. ``fresh``: the fresh keys (one open binding at a time, see
        the module docstring) -> the highest number of each the trainer has read; ``lost``: the
        keys that lost their standing -> the number each left (both announced in the document;
        None: none). Store errors are logged; the tickets then stay for the next poll."""
        said = self._standing()
        self.fresh, self.lost = dict(fresh or {}), dict(lost or {})
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
            full = len(self.bound.get(kid, {})) >= MAX_BOUND_PER_KEY or self.open_number(kid) is not None
            why = None
            if far or not full:
                why = self._ticket_problem(k, kid, seq)
                if why is None and kid not in standing:
                    why = ("the key has no standing (no accepted batch, not enrolled, banned, or it left a bound number "
                           "undelivered while fresh): its work is probation work")
            if why is None and far:  # held numbers are looked up only for a genuine ticket of a key with standing
                if kid not in occupied:  # once a poll, up to the key's furthest ticket
                    occupied[kid] = set(held(kid, top, last[kid])) if held is not None else set()
                if free_between(top, seq, occupied[kid]) >= MAX_AHEAD:
                    why = f"number {seq} is more than {MAX_AHEAD} free numbers past the key's highest bound number"
            if why is not None:
                refused.append((kid, k, why))
                continue
            if full:  # (a fresh key's further tickets wait for a batch at its bound number)
                waiting[kid] = waiting.get(kid, 0) + 1
                if waiting[kid] > MAX_AHEAD:
                    refused.append((kid, k, f"more than {MAX_AHEAD} of the key's tickets wait for a binding"))
                continue  # waits for a later poll
            self.bind(kid, seq, version)
            done.append(k)
        self.dirty = self.dirty or self._standing() != said
        if self.dirty and not self.write():
            return []  # the tickets stay: bound again (the same way) once the document is written
        for k in done:
            self._delete(k)
        for kid, k, why in refused:
            self._quarantine(k, why)
        self.tickets_refused += len(refused)
        return refused

    def announce(self, lost: Mapping[str, int]) -> None:
        """Say at once which keys lost their standing (``lost``: key -> the number each left), when
        that changed since the last poll: a worker waiting on the word makes no extra work."""
        said = self._standing()
        self.lost = dict(lost)
        if self._standing() != said:
            self.dirty = True
            self.write()

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
            carried = {s: n for s, n in self.carried.get(kid, {}).items() if s in live}
            if carried:
                self.carried[kid] = carried
            else:
                self.carried.pop(kid, None)

    def _standing(self) -> tuple[list[str], list[tuple[str, int]]]:
        """What the document says of standing: the fresh keys holding a live binding, the lost keys."""
        return [k for k in sorted(self.bound) if k in self.fresh], sorted(self.lost.items())[:MAX_LOST_LISTED]

    def write(self) -> bool:
        """Put the signed document of the live bindings; False (logged) when the store failed."""
        entries = {kid: [[s, v, _beacon(self._mac, self.run, kid, s, v)] for s, v in sorted(rows.items())
                         if s not in self.carried.get(kid, {})]  # a carried binding is delivered: nobody waits on it
                   for kid, rows in sorted(self.bound.items())}
        fresh, lost = self._standing()
        body = {"format": _BINDINGS_FORMAT, "run": self.run, "time": time.time(),
                "bindings": {kid: rows for kid, rows in entries.items() if rows},
                "top": dict(sorted(self.top.items())), "fresh": fresh, "lost": dict(lost)}
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
        return {"bound": {kid: sorted(rows.items()) for kid, rows in self.bound.items()}, "top": dict(self.top),
                "carried": {kid: sorted(rows.items()) for kid, rows in self.carried.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        """Merge a checkpoint's bindings in (what is known already stands: it is newer)."""
        for kid, rows in state.get("bound", {}).items():
            for s, v in rows:
                self.bound.setdefault(kid, {}).setdefault(int(s), int(v))
        for kid, rows in state.get("carried", {}).items():
            for s, n in rows:
                self.carried.setdefault(kid, {}).setdefault(int(s), int(n))
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
