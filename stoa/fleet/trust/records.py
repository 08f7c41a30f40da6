"""What the trainer knows of each worker key, and the signed report it publishes of it.

:class:`Records` holds one :class:`WorkerRecord` per key (batches accepted and rejected by
:data:`~stoa.types.Category`, episodes trained, strikes, spot-checks, ban, sequence numbers seen)
and per-worker counts of refusals whose sender is unknown. A key is due a ban after
``trust.ban_after`` strikes (:data:`STRIKE_CATEGORIES`). :class:`TrustReport` is
``<run>/trust.json``: written by the trainer, and read through :func:`read_trust_report` by the
worker, ``stoa status`` and the launcher's summary.

What the store's report says is public (any worker reads it), so it publishes nothing that decides
whether a batch is checked: no audit floor, no per-worker log-prob means (only how many tokens
were audited), and reasons without the audit's suspicion figures (:func:`public_reason`). The
trainer writes the whole report, means and floor included, to its own run folder only.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from stoa.fleet.trust.planted import planted_before
from stoa.transport import layout
from stoa.transport.identity import printable
from stoa.transport.signing import read_signed
from stoa.transport.store import ObjectStore
from stoa.types import Category

__all__ = ["STRIKE_CATEGORIES", "REPORT_KIND", "PublicRecord", "Records", "TrustReport", "WorkerRecord",
           "WorkerReport", "public_reason", "read_trust_report"]

STRIKE_CATEGORIES: frozenset[Category] = frozenset({"replay", "duplicate", "invalid", "audit", "sampling",
                                                    "assignment"})
"""Rejections that count toward ``ban_after``: the sender is known and the content is its fault. A
refused key (not enrolled yet, banned, impersonating) is not struck: its batches are never read."""
REPORT_KIND = "trust-report"
MAX_RECORDS = 8192
"""Records beyond this: those of keys with no accepted batch and no ban, seen longest ago, are
forgotten (a throwaway key's record is a few hundred bytes; a flood of them must stay bounded)."""
_MAX_REPORT_WORKERS = 1024
"""Keys in the report (those seen most recently): with every string bounded, it stays under 1 MiB."""
_RIPE_SEQS = 8  # sequence numbers a key shows before its withholding rate is judged
_MAX_REASON = 240
_MAX_ANONYMOUS = 4096  # worker ids with refusals of unknown sender counted apart; the rest count under "?"


def public_reason(category: str, reason: str) -> str:
    """What may be published of a refusal's ``reason`` (in the store's report, quarantine and ban
    documents): at most 240 printable ASCII characters, and for a spot-check or sampling verdict
    only the evidence, not the audit's suspicion that chose the batch (its figures would tell a
    forger how far below the fleet's range to stay)."""
    if category in ("audit", "sampling") and reason.startswith("log-prob audit:"):
        _, sep, evidence = reason.partition("; spot-check: ")
        reason = f"spot-check: {evidence}" if sep else f"{category} check failed"
    return printable(reason, _MAX_REASON)


@dataclass
class PublicRecord:
    """What the trainer knows of one worker key and publishes: the fields a :class:`WorkerRecord`
    and its :class:`WorkerReport` line share, in the order the report writes them."""

    worker_id: str = ""
    accepted_batches: int = 0
    accepted_episodes: int = 0
    trained_episodes: int = 0
    rejected_batches: int = 0
    rejected_episodes: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    """Rejected batches by category (:data:`~stoa.types.Category`)."""
    unverifiable_episodes: int = 0
    """Its episodes whose outcome depended on the machine (a scorer's timeout, in its claim or
    the trainer's replay): not trained, not struck; a key claiming many more than the fleet is
    worth a look."""
    strikes: int = 0
    """Rejections that count toward a ban (:data:`STRIKE_CATEGORIES`)."""
    spot_checks: int = 0
    spot_check_failures: int = 0
    probation_batches: int = 0
    """Accepted batches of probation work (played before the key had its assignment salt; never trained)."""
    last_reason: str = ""
    """The last rejection's :func:`public_reason`."""
    banned: str = ""
    """Why the key is banned (``code: detail``; "" if it is not)."""
    last_seen: float = 0.0
    last_accepted: float = 0.0
    """When its last batch was accepted (0: never)."""
    batches_seen: int = 0
    """Batches of this key the intake read (any outcome)."""
    max_seq: int = -1
    """Its highest sequence number read."""
    taken_by_others: int = 0
    """Its worker id's numbers held by objects it did not seal (planted by others; not its gaps)."""
    late_batches: int = 0
    """Its batches that came more than ``trainer.max_lag`` versions behind, dropped unread: their
    numbers count in :attr:`withheld` (delay is a way to withhold), and this says how many of the
    gaps came late rather than never (a slow or overloaded machine)."""
    standing_lost: int = 0
    """Times it lost its standing: while fresh (no accepted salted batch since it gained standing)
    it left a bound number undelivered (abandoned, expired, refused, or passed by probation work).
    No strike: a crash or planted junk can cause it too, and it costs the key a probation."""
    probation_owed: int = 0
    """Accepted probation batches it still owes before it has standing again (0: none owed)."""


@dataclass
class WorkerRecord(PublicRecord):
    """What the trainer knows of one worker key: its :class:`PublicRecord` and what it keeps to itself."""

    floors: list[list[int]] = field(default_factory=list)
    """``[seq, version]`` of its most recent batches: each says its later-numbered batches held at
    least that version (:class:`stoa.fleet.intake.Intake`'s version floor). Not reported."""
    salted_at_standing: int = 0
    """Its accepted salted batches when it last regained its standing: it is fresh while it has
    no more (:attr:`fresh`). Not reported."""
    lost_at: int = -1
    """The bound number it left when it last lost its standing. Not reported."""

    @property
    def fresh(self) -> bool:
        """Whether it has no accepted salted batch since it (re)gained standing: then it holds one
        binding at a time, and leaving its bound number undelivered costs its standing."""
        return self.accepted_batches - self.probation_batches <= self.salted_at_standing

    @property
    def withheld(self) -> int:
        """Sequence numbers up to :attr:`max_seq` of which no batch came (withheld, or lost in a
        crash), less those :attr:`taken_by_others`."""
        return max(0, self.max_seq + 1 - self.batches_seen - self.taken_by_others)


class Records(dict[str, WorkerRecord]):
    """Key id -> :class:`WorkerRecord`, plus :attr:`anonymous` (worker id -> rejections by
    category, for refusals whose sender key is unknown).

    Args:
        ban_after: strikes after which a key is due a ban (0: never).
    """

    def __init__(self, ban_after: int):
        super().__init__()
        self.ban_after = ban_after
        self.anonymous: dict[str, dict[str, int]] = {}
        self.planted: dict[str, dict[str, int]] = {}
        """Worker id -> sealing key id (``""``: none) -> quarantined objects under that id
        (:func:`stoa.fleet.trust.planted.count_planted`): a key's record made later starts with the
        ones it did not seal as ``taken_by_others``."""

    def touch(self, kid: str, worker_id: str) -> WorkerRecord:
        """The record of ``kid`` (made on first sight), marked as seen now."""
        rec = self.get(kid)
        if rec is None:
            rec = self[kid] = WorkerRecord(worker_id, taken_by_others=planted_before(self.planted, kid, worker_id))
        elif not rec.worker_id and worker_id:  # made before its worker id was known (a binding it left, a ban)
            rec.worker_id = worker_id
        rec.last_seen = time.time()
        return rec

    def reject(self, kid: str, worker_id: str, category: Category, reason: str, episodes: int = 0) -> bool:
        """Count a rejected batch against its sender; returns whether the key is now due a ban."""
        if not kid:
            wid = worker_id if worker_id in self.anonymous or len(self.anonymous) < _MAX_ANONYMOUS else "?"
            per = self.anonymous.setdefault(wid or "?", {})
            per[category] = per.get(category, 0) + 1
            return False
        rec = self.touch(kid, worker_id)
        rec.rejected_batches += 1
        rec.rejected_episodes += episodes
        rec.rejected[category] = rec.rejected.get(category, 0) + 1
        rec.last_reason = public_reason(category, reason)
        if category in STRIKE_CATEGORIES:
            rec.strikes += 1
            return bool(self.ban_after) and rec.strikes >= self.ban_after and not rec.banned
        return False

    def accept(self, kid: str, worker_id: str, episodes: int, probation: bool = False) -> bool:
        """Count an accepted batch; returns whether it gave the key its standing back (the last
        probation batch it owed)."""
        rec = self.touch(kid, worker_id)
        rec.accepted_batches += 1
        rec.probation_batches += probation
        rec.accepted_episodes += episodes
        rec.last_accepted = time.time()
        if not (probation and rec.probation_owed):
            return False
        rec.probation_owed -= 1
        if rec.probation_owed:
            return False
        rec.salted_at_standing = rec.accepted_batches - rec.probation_batches  # fresh again
        return True

    def lose_standing(self, kid: str, worker_id: str, seq: int, probation: int) -> bool:
        """A fresh ``kid`` left its bound number ``seq`` undelivered: it owes ``probation`` accepted
        probation batches before it has standing again. Returns False when it owed some already."""
        rec = self.touch(kid, worker_id)
        if rec.probation_owed:
            return False
        rec.standing_lost += 1
        rec.probation_owed, rec.lost_at = probation, seq
        return True

    def lost(self, limit: int) -> dict[str, int]:
        """The keys that owe probation (lost their standing) -> the number each left: the ``limit``
        seen most recently."""
        owing = sorted(((r.last_seen, k) for k, r in self.items() if r.probation_owed and not r.banned), reverse=True)
        return {k: self[k].lost_at for _, k in owing[:limit]}

    def saw(self, kid: str, worker_id: str, seq: int) -> None:
        """A batch of ``kid`` with sequence number ``seq`` reached the intake (withholding accounting)."""
        if kid:
            rec = self.touch(kid, worker_id)
            rec.batches_seen += 1
            rec.max_seq = max(rec.max_seq, seq)

    def late(self, kid: str, worker_id: str) -> None:
        """A batch of ``kid`` came too late (stale) and was dropped unread: its number stays a gap."""
        if kid:
            self.touch(kid, worker_id).late_batches += 1

    def unsee(self, kid: str) -> None:
        """A batch counted by :meth:`saw` was dropped unread after all: its number is a gap again."""
        self[kid].batches_seen -= 1

    def version_floor(self, kid: str, worker_id: str, seq: int, held: int) -> int:
        """The lowest version ``kid``'s batch ``seq`` may claim: the most that any of its
        lower-numbered batches said the key held. Notes that batch ``seq`` says the key held
        ``held`` (kept for its 8 most recent numbers: the lowest folds into the next, a bound that
        is weaker, never wrong)."""
        rec = self.touch(kid, worker_id)
        floor = max([v for s, v in rec.floors if s < seq], default=-1)
        rec.floors = sorted([[s, v] for s, v in rec.floors if s != seq] + [[seq, held]])
        while len(rec.floors) > 8:
            (_, v0), nxt = rec.floors.pop(0), rec.floors[0]
            nxt[1] = max(nxt[1], v0)
        return floor

    def banned(self, kid: str) -> str:
        """Why ``kid`` is banned in the records ("" if it is not)."""
        rec = self.get(kid)
        return rec.banned if rec is not None else ""

    def withholding(self, worker_mads: float) -> dict[str, tuple[float, bool]]:
        """Per key ``(withheld rate, flagged)``: a key is flagged when its rate leaves the fleet's
        range (median + ``worker_mads`` x max(MAD, 0.05)) over keys with 8 or more numbers that
        are not banned (a banned copier's numbers are mostly gaps: counted in, they raised the
        median past a withholder's rate). A flag says "look", never "ban": a gap is also what a
        crash mid-cohort leaves."""
        rates = {k: r.withheld / (r.max_seq + 1) for k, r in self.items() if r.max_seq >= 0}
        ripe = [v for k, v in rates.items() if self[k].max_seq >= _RIPE_SEQS - 1 and not self[k].banned]
        if not ripe:
            return {k: (v, False) for k, v in rates.items()}
        med = float(np.median(ripe))
        limit = med + worker_mads * max(float(np.median(np.abs(np.array(ripe) - med))), 0.05)
        return {k: (v, self[k].max_seq >= _RIPE_SEQS - 1 and v > limit) for k, v in rates.items()}

    def forget_strangers(self, keep: set[str]) -> list[str]:
        """Keep at most :data:`MAX_RECORDS` records: forget keys not in ``keep`` that never had a
        batch accepted (seen longest ago first), then banned ones (their bans are kept apart, in
        the roster's ban documents and the trainer's ban log); returns the keys forgotten. A
        record is a few hundred bytes in every checkpoint: neither throwaway keys nor bans may
        grow it without bound."""
        limit = MAX_RECORDS
        if len(self) <= limit:
            return []
        idle = sorted((bool(r.banned), r.last_seen, k) for k, r in self.items()
                      if k not in keep and (r.banned or not r.accepted_batches))
        gone = [k for _, _, k in idle[: len(self) - limit]]
        for k in gone:
            del self[k]
        return gone

    def metrics(self, worker_mads: float) -> dict[str, float]:
        """``trust/...`` counts over every key (cumulative)."""
        recs = self.values()
        cats: dict[str, int] = {}
        for d in [r.rejected for r in recs] + list(self.anonymous.values()):
            for c, n in d.items():
                cats[c] = cats.get(c, 0) + n
        return {
            "trust/workers": float(len(self)),
            "trust/banned_workers": float(sum(bool(r.banned) for r in recs)),
            "trust/withheld_batches": float(sum(r.withheld for r in recs)),
            "trust/withholding_flagged": float(sum(f for _, f in self.withholding(worker_mads).values())),
            "trust/accepted_batches": float(sum(r.accepted_batches for r in recs)),
            "trust/standing_lost": float(sum(r.standing_lost for r in recs)),
            "trust/unverifiable_episodes": float(sum(r.unverifiable_episodes for r in recs)),
            "trust/rejected_batches": float(sum(r.rejected_batches for r in recs)
                                            + sum(sum(d.values()) for d in self.anonymous.values())),
            **{f"trust/rejected/{c}": float(n) for c, n in sorted(cats.items())},
        }

    def state(self) -> dict[str, Any]:
        return {"records": {k: asdict(r) for k, r in self.items()}, "anonymous": self.anonymous, "planted": self.planted}

    def restore(self, state: dict[str, Any]) -> None:
        self.clear()
        self.update({k: WorkerRecord(**r) for k, r in state.get("records", {}).items()})
        for r in self.values():  # checkpoints from before reasons were bounded
            r.last_reason, r.banned = printable(r.last_reason, _MAX_REASON), printable(r.banned, 2 * _MAX_REASON)
        self.anonymous = {w: dict(d) for w, d in state.get("anonymous", {}).items()}
        self.planted = {w: dict(d) for w, d in state.get("planted", {}).items()}


# -- the report -------------------------------------------------------------------------------------


_PUBLIC_FIELDS = frozenset(f.name for f in fields(PublicRecord))


@dataclass
class WorkerReport(PublicRecord):
    """One key's line of the :class:`TrustReport`: its :class:`PublicRecord`, its withholding and
    its audit summary."""

    withheld: int = 0
    withheld_rate: float = 0.0
    withholding_flagged: bool = False
    audit: dict[str, float] = field(default_factory=dict)
    """Per staleness bucket, tokens audited (``tokens_s<b>``); the operator's copy adds the mean
    |log pi - log mu| (``abs_s<b>``) and implausible tokens."""


def _fits(v: Any, default: Any) -> bool:
    """Whether ``v`` has the type of ``default`` (None: a number or None; float admits int, never bool;
    a number must be finite)."""
    number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if default is None:
        return v is None or number
    if type(default) is float:
        return number
    return type(v) is type(default) if type(default) in (int, bool, str) else isinstance(v, type(default))


def _typed(cls: type, data: Any, where: str) -> dict[str, Any]:
    """``data``'s fields of dataclass ``cls``, checked against their defaults' types (missing:
    the default; unknown: ignored). Raises ValueError."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not an object")
    out = {}
    for f in fields(cls):
        if f.name in data:
            v, default = data[f.name], f.default_factory() if callable(f.default_factory) else f.default
            if not _fits(v, default):
                raise ValueError(f"{where}.{f.name} is {type(v).__name__}, expected {type(default).__name__}")
            out[f.name] = float(v) if type(default) is float else v
    return out


def _counts(d: Any, where: str) -> dict[str, int]:
    if not isinstance(d, dict) or not all(isinstance(k, str) and type(n) is int for k, n in d.items()):
        raise ValueError(f"{where} is not a map of counts")
    return dict(d)


@dataclass(frozen=True)
class TrustReport:
    """``<run>/trust.json``: the trainer's per-key records, signed with the run's key."""

    run: str = ""
    version: int = 0
    time: float = 0.0
    mode: str = ""
    floor: float | None = None
    """The audit's int8-versus-float floor (the operator's copy only; None in the store's)."""
    workers: dict[str, WorkerReport] = field(default_factory=dict)
    """Key id -> its record (the keys seen most recently, at most 1,024)."""
    anonymous: dict[str, dict[str, int]] = field(default_factory=dict)
    """Worker id -> rejections by category, for objects whose sender key is unknown."""
    keys: int = 0
    """Keys the trainer holds a record of (the report lists at most 1,024 of them)."""
    banned_keys: int = 0
    """Keys banned in this run (each has a ban document, ``<run>/bans/<key id>.json``)."""
    operator: bool = False
    """True in the operator's copy (the trainer's run folder): audit means and floor included."""

    @classmethod
    def parse(cls, body: Any) -> TrustReport:
        """The report in a document body; raises ValueError on a field of the wrong type."""
        top = _typed(cls, body, "trust report")
        workers = {}
        for kid, w in (top.pop("workers", None) or {}).items():
            one = _typed(WorkerReport, w, f"trust report worker {str(kid)[:20]!r}")
            if "rejected" in one:
                one["rejected"] = _counts(one["rejected"], "rejected")
            if "audit" in one and not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                                          and math.isfinite(v) for k, v in one["audit"].items()):
                raise ValueError("audit is not a map of finite numbers")
            workers[str(kid)] = WorkerReport(**one)
        anonymous = {str(w): _counts(d, "anonymous") for w, d in (top.pop("anonymous", None) or {}).items()}
        return cls(**top, workers=workers, anonymous=anonymous)

    def to_body(self) -> dict[str, Any]:
        return asdict(self)


def build_report(run: str, version: int, mode: str, floor: float | None, records: Records,
                 withholding: dict[str, tuple[float, bool]], audit: Any, banned_keys: int = 0,
                 operator: bool = False) -> TrustReport:
    """The report of ``records`` (the keys seen most recently, at most 1,024). Without
    ``operator`` it is the public one: no floor, audit token counts only (see the module docstring)."""
    recs = sorted(records.items(), key=lambda kv: -kv[1].last_seen)[:_MAX_REPORT_WORKERS]
    workers = {}
    for kid, r in sorted(recs):
        rate, flagged = withholding.get(kid, (0.0, False))
        summary = audit.summary(kid)
        if not operator:
            summary = {k: v for k, v in summary.items() if k.startswith("tokens_")}
        public = {k: v for k, v in asdict(r).items() if k in _PUBLIC_FIELDS}  # asdict: copies, never the live dicts
        workers[kid] = WorkerReport(**public, withheld=r.withheld, withheld_rate=round(rate, 4),
                                    withholding_flagged=flagged, audit=summary)
    anonymous = {printable(w, 64): d for w, d in list(records.anonymous.items())[:256]}
    return TrustReport(run, version, time.time(), mode, floor if operator else None, workers, anonymous,
                       len(records), banned_keys, operator)


def read_trust_report(store: ObjectStore, run: str, public_key: Any = None, *,
                      max_bytes: int = 4 << 20) -> TrustReport | None:
    """The trainer's per-worker report (verified when ``public_key`` is given), or None (missing,
    or unverified and malformed). Raises ``SignatureError`` when a verified read fails."""
    key = layout.trust_report(run)
    if public_key is not None:
        body = read_signed(store, key, REPORT_KIND, public_key, expect={"run": run}, max_bytes=max_bytes)
    else:
        try:
            body = json.loads(json.loads(store.get(key, max_bytes=max_bytes))["body"])
        except Exception:
            return None
    if body is None:
        return None
    try:
        return TrustReport.parse(body)
    except ValueError:
        return None
