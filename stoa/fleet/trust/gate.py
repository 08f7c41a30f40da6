"""The trainer's gate for untrusted workers: one object over the roster, the records and the review.

One :class:`TrustGate` per trainer, owned by its :class:`stoa.fleet.intake.Intake`. Its state
lives in three modules, each owning one kind:

* :mod:`~stoa.fleet.trust.roster` (:class:`~stoa.fleet.trust.roster.Membership`): who may upload,
  newcomer pacing, binding by accepted work, expiry;
* :mod:`~stoa.fleet.trust.records` (:class:`~stoa.fleet.trust.records.Records`): per key, batches
  accepted and rejected by category, strikes, bans, withholding, and the signed
  :class:`~stoa.fleet.trust.records.TrustReport`;
* :mod:`~stoa.fleet.trust.review` (:class:`~stoa.fleet.trust.review.Review`): replay, the log-prob
  audit, spot-checks and the sampling check, each returning a typed
  :class:`~stoa.types.Verdict` and changing nothing else.

The gate applies verdicts: a confirmed forgery bans its key, ``ban_after`` strikes ban it too;
the ban goes into the key's signed ban document, the trainer's ban log and the ledger
(:mod:`stoa.fleet.trust.ledger`), and the intake drops the key's queued batches. Groups are scoped to the key that sealed them
(:func:`scoped`), and :meth:`TrustGate.max_groups` caps one key's share of a step. The gate's
state (records, audit statistics) is plain JSON for the trainer's checkpoint; the roster itself
lives in the store.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoa.fleet.trust.planted import count_planted
from stoa.fleet.trust.records import REPORT_KIND, Records, TrustReport, build_report, public_reason
from stoa.fleet.trust.review import FloatScorer, Int8Scorer, Review
from stoa.fleet.trust.roster import Admission, Membership
from stoa.fleet.trust.section import TrustConfig
from stoa.transport import layout
from stoa.transport.identity import Ban, BatchSeal, Roster
from stoa.transport.signing import sign_document
from stoa.transport.store import ObjectStore, StoreError
from stoa.types import Category, Verdict

if TYPE_CHECKING:
    from stoa.fleet.trust.assign import Assignment
    from stoa.fleet.trust.ledger import Ledger
    from stoa.fleet.trust.replay import Replayer
    from stoa.transport.exchange import Batch, Rejection
    from stoa.types import Episode

__all__ = ["TrustGate", "group_episodes", "scoped"]

log = logging.getLogger("stoa.trust")

_REPORT_EVERY_S = 2.0


def scoped(key_id: str, group_id: str) -> str:
    """A group id in its sender's namespace (``<key id>/<group id>``; the raw id when unsigned)."""
    return f"{key_id}/{group_id}" if key_id else group_id


def group_episodes(episodes: Sequence[Episode]) -> dict[str, list[Episode]]:
    """A batch's episodes by group id, in order of first appearance."""
    groups: dict[str, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group_id, []).append(ep)
    return groups


class TrustGate:
    """See the module docstring.

    Args:
        cfg: the run's ``[trust]`` section.
        store, run, private_key: where the roster and the report live, and the run's signing key.
        ledger: where bans are recorded (None: nowhere, for tests).
        replayer: replays episodes through the run's environment (None, or ``cfg.replay`` off, or
            a task that is not replayable: no replay).
        float_scorer: the learner, for the audit's log pi (None or ``cfg.audit.enabled`` off: no audit).
        int8: the held int8 policies, for spot-checks (None: suspicion is logged, never confirmed).
        roster_copy: a local folder (the trainer's run folder) keeping the newest roster seen, so a
            stale ``workers.json`` put back while the trainer is down cannot undo a ban or a
            binding: revisions never go back, across restarts too.
        seed: only for tests that need the same choices twice. By default which episodes are
            audited and when a random spot-check comes are drawn from the operating system's
            entropy, so nothing public (the run's seed is in its world-readable config) predicts them.
    """

    def __init__(self, cfg: TrustConfig, store: ObjectStore, run: str, private_key: Any, *,
                 ledger: Ledger | None = None, replayer: Replayer | None = None,
                 float_scorer: FloatScorer | None = None, int8: Int8Scorer | None = None,
                 roster_copy: Path | None = None, seed: int | None = None):
        self.cfg, self.store, self.run, self.key, self.ledger = cfg, store, run, private_key, ledger
        self.rng = np.random.default_rng(seed)  # None: fresh OS entropy
        self.records = Records(cfg.ban_after)
        self.members = Membership(cfg, store, run, private_key, self.records, self.rng, roster_copy)
        self.checks = Review(cfg.audit, cfg.replay, replayer=replayer, float_scorer=float_scorer, int8=int8,
                             rng=self.rng)
        self.version = 0
        self.private = roster_copy  # the trainer's own folder: the operator's copy of the report goes there
        self._report_written = 0.0
        self._new_bans: list[str] = []
        self.untrained: dict[str, set[str]] = {}
        """Batch key -> ids of the groups of that admitted batch not to train on (they hold an
        unverifiable episode), as of the last :meth:`review`."""

    @property
    def roster(self) -> Roster:
        return self.members.roster

    @roster.setter
    def roster(self, roster: Roster) -> None:
        self.members.roster = roster

    @property
    def audit(self):  # the review's LogprobAudit
        return self.checks.audit

    @property
    def counts(self) -> dict[str, int]:
        return self.checks.counts

    # -- identity ---------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Re-read the roster (``stoa enroll`` / ``stoa ban`` edit it live), keeping our own bans and bindings."""
        self._new_bans += self.members.refresh(force)

    def admission(self) -> Admission:
        """Who may upload as of now, for the reader to apply to each seal before decoding
        (:meth:`Membership.admission`)."""
        return self.members.admission()

    def admit(self, seal: BatchSeal) -> str | None:
        """Why the seal's key may not upload as the seal's worker id, or None (:meth:`Admission.refusal`)."""
        return self.members.admission().refusal(seal)

    def established(self, kid: str) -> bool:
        return self.members.established(kid)

    def pace_newcomers(self, batches: Sequence[Batch]) -> tuple[list[Batch], list[Batch]]:
        return self.members.pace_newcomers(batches)

    def is_banned(self, kid: str) -> bool:
        return self.members.is_banned(kid)

    # -- accounting -------------------------------------------------------------------------------
    def reject(self, kid: str, worker_id: str, category: Category, reason: str, episodes: int = 0) -> None:
        """Count a rejected batch against its sender; ban it after ``ban_after`` strikes."""
        if self.records.reject(kid, worker_id, category, reason, episodes):
            self.ban(kid, f"{self.records[kid].strikes} rejected batches; last: {public_reason(category, reason)}",
                     code="strikes")

    def planted(self, refused: Sequence[Rejection]) -> None:
        """Numbers held by objects the reader refused under a worker id, sealed by another key (or
        none), are not that worker's gaps (:func:`stoa.fleet.trust.planted.count_planted`)."""
        count_planted(self.records, refused, self.records.planted)

    def ban(self, kid: str, reason: str, version: int = -1, *, code: str = "banned") -> None:
        """Ban a key: the records refuse it at once; its ban document tells the worker, the
        trainer's ban log keeps it across restarts. ``code`` says why in one word, ``reason``
        becomes the ban's bounded public detail (:class:`~stoa.transport.identity.Ban`). One
        small write per ban, whatever the number of bans. Never raises."""
        rec = self.records.get(kid) or self.records.touch(kid, "")
        if rec.banned or kid in self.members.bans:  # (a record forgotten since, made again: the ban stands)
            rec.banned = rec.banned or self.members.bans[kid]
            return
        ban = Ban.of(rec.worker_id, code, reason, time.time(), version if version >= 0 else self.version)
        rec.banned = ban.reason
        self.members.ban(kid, ban)
        self._new_bans.append(kid)
        self.checks.audit.forget(kid)
        if self.ledger is not None:
            self.ledger.write(banned=kid, worker=rec.worker_id, reason=reason[:500])
        log.warning("banned worker %s (key %s): %s", rec.worker_id, kid, ban.reason)

    def take_new_bans(self) -> list[tuple[str, str, str]]:
        """``(key id, worker id, reason)`` of each key banned since the last call (the intake
        drops their queued batches)."""
        out, self._new_bans = self._new_bans, []
        return [(k, self.records[k].worker_id, self.records[k].banned) for k in out]

    def saw(self, kid: str, worker_id: str, seq: int) -> None:
        """A batch of ``kid`` with sequence number ``seq`` reached the intake (withholding accounting)."""
        self.records.saw(kid, worker_id, seq)

    def withholding(self) -> dict[str, tuple[float, bool]]:
        """Per key ``(withheld rate, flagged)`` (:meth:`Records.withholding`)."""
        return self.records.withholding(self.cfg.audit.worker_mads)

    def late(self, kid: str, worker_id: str) -> None:
        """A batch of ``kid`` came more than ``trainer.max_lag`` versions behind (:meth:`Records.late`)."""
        self.records.late(kid, worker_id)

    def unsaw(self, kid: str) -> None:
        """A batch of ``kid`` counted by :meth:`saw` is dropped unread after all: its number is a gap again."""
        self.records.unsee(kid)

    def version_floor(self, kid: str, worker_id: str, seq: int, held: int) -> int:
        """The lowest version ``kid``'s batch ``seq`` may claim, noting that this batch says its key
        held ``held`` already (:meth:`Records.version_floor`; the intake's rule)."""
        return self.records.version_floor(kid, worker_id, seq, held)

    def trained(self, batch: Batch, episodes: int) -> None:
        self.records.touch(batch.key_id, batch.worker_id).trained_episodes += episodes

    def max_groups(self, groups_per_step: int) -> int:
        """Most groups one key may contribute to a step."""
        return max(1, math.floor(self.cfg.max_worker_share * groups_per_step + 1e-9))

    # -- review -----------------------------------------------------------------------------------
    def review(self, batches: Sequence[Batch], trainer_version: int,
               work: Sequence[Assignment | None] | None = None) -> list[Verdict | None]:
        """For each batch, the :class:`~stoa.types.Verdict` that rejects it, or None to admit it.
        ``work[i]`` is batch ``i``'s assigned work (:mod:`stoa.fleet.trust.assign`; the caller's
        :meth:`stoa.fleet.intake.Intake.assigned`): given, its draws are re-derived from the
        assigned seed (the sampling check, and with spot-checks) and an accepted probation batch
        is counted as such; None, neither. The checks are the review's
        (:mod:`stoa.fleet.trust.review`); the gate applies what they find (a confirmed forgery
        bans its key; the groups of an episode replay can neither confirm nor refute go to
        :attr:`untrained`, with no strike) and binds an accepted batch's unbound key to its worker
        id (open runs, :meth:`Membership.bind`), which also publishes its assignment salt."""
        self.version = trainer_version
        work = list(work) if work is not None else [None] * len(batches)
        verdicts: list[Verdict | None] = [None] * len(batches)
        self.untrained = {}
        for i, b in enumerate(batches):
            self.records.touch(b.key_id, b.worker_id)
            if self.is_banned(b.key_id):
                verdicts[i] = Verdict("refused", f"key {b.key_id} is banned")
            else:
                verdicts[i], unverifiable = self.checks.replay(b)
                if unverifiable:
                    verdicts[i] = self._unverifiable(b, unverifiable)
        for i, b in enumerate(batches):
            if verdicts[i] is None:
                verdict, spot_checked = self.checks.check(b, work[i], trainer_version)
                rec = self.records.touch(b.key_id, b.worker_id)
                rec.spot_checks += spot_checked
                if verdict is not None and verdict.ban:
                    rec.spot_check_failures += 1
                    self.ban(b.key_id, public_reason(verdict.category, verdict.reason), code=verdict.category)
                verdicts[i] = verdict
        for i, b in enumerate(batches):
            if verdicts[i] is None and b.key_id and (why := self.members.bind(b)):
                verdicts[i] = Verdict("refused", why)
            if verdicts[i] is None:
                probation = bool(b.key_id) and work[i] is not None and work[i].probation
                dropped = self.untrained.get(b.key, set())
                kept = sum(e.group_id not in dropped for e in b.episodes)
                self.records.accept(b.key_id, b.worker_id, kept, probation)
                if not probation or self.records[b.key_id].probation_batches >= self.cfg.probation_batches:
                    self.members.publish_salt(b.key_id)  # its probation is done: its worker may now compute its work
        for k in self.records.forget_strangers(set(self.roster.enrolled)):
            self.checks.audit.forget(k)
        return verdicts

    def _unverifiable(self, b: Batch, found: list[tuple[int, str]]) -> Verdict | None:
        """Note ``b``'s unverifiable episodes against its key (no strike) and set their groups
        apart in :attr:`untrained`; a batch with no other group is refused as ``unverifiable``."""
        self.records.touch(b.key_id, b.worker_id).unverifiable_episodes += len(found)
        groups = {b.episodes[i].group_id for i, _ in found}
        i, why = found[0]
        detail = (f"{len(found)} of {len(b.episodes)} episodes cannot be verified; episode {i} "
                  f"(item {b.episodes[i].item_index}): {why}")
        log.info("batch %s: %s; %d group(s) not trained", b.key, detail, len(groups))
        if groups >= {e.group_id for e in b.episodes}:
            return Verdict("unverifiable", f"replay: {detail}")
        self.untrained[b.key] = groups
        return None

    def calibrate(self, episodes: Sequence[Episode], trainer_logprobs: Sequence[np.ndarray]) -> float:
        """The int8-versus-float floor, from the trainer's own int8 episodes at one version."""
        return self.checks.calibrate(episodes, trainer_logprobs)

    # -- reports ----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``trust/...`` metrics for the trainer's train rows (cumulative counts and seconds)."""
        banned = {"trust/banned_workers": float(len(self.members.bans))}  # records of banned keys may be forgotten
        return {**self.records.metrics(self.cfg.audit.worker_mads), **banned, **self.checks.metrics()}

    def report(self, version: int, operator: bool = False) -> TrustReport:
        """The per-key report: the public one (the store's ``trust.json``: nothing that decides
        whether a batch is checked), or with ``operator`` the whole one (audit means, floor)."""
        return build_report(self.run, version, self.cfg.mode, self.checks.audit.floor, self.records,
                            self.withholding(), self.checks.audit, len(self.members.bans), operator)

    def write_report(self, version: int = -1, force: bool = False) -> None:
        """Put the signed public report at ``<run>/trust.json``, and the operator's copy in the
        trainer's own folder (``roster_copy``/``trust.json``), at most every 2 s unless forced."""
        now = time.time()
        if not force and now - self._report_written < _REPORT_EVERY_S:
            return
        self._report_written = now
        self.version = version if version >= 0 else self.version
        try:
            self.store.put(layout.trust_report(self.run),
                           sign_document(REPORT_KIND, self.report(self.version).to_body(), self.key))
        except StoreError as e:
            log.warning("could not write the trust report: %s", e)
        if self.private is not None:
            try:
                self.private.mkdir(parents=True, exist_ok=True)
                tmp = self.private / ".trust.json.tmp"
                tmp.write_text(json.dumps(self.report(self.version, operator=True).to_body(), allow_nan=False))
                tmp.replace(self.private / "trust.json")
            except (OSError, ValueError) as e:
                log.warning("could not write the operator's trust report: %s", e)

    # -- state ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {**self.records.state(), "audit": self.checks.audit.state()}

    def restore(self, state: dict[str, Any]) -> None:
        self.records.restore(state)
        self.checks.audit.restore(state.get("audit", {}))
        self.refresh(force=True)
