"""The :class:`Intake`: polls the store, asks the trust gate what each batch is worth, pools it.

The intake does the store's side of a batch's way: it reads (the reader applies the gate's
:meth:`~stoa.fleet.trust.gate.TrustGate.admission` to each seal before decoding), sifts copies
out, hands what is left to :meth:`~stoa.fleet.trust.gate.TrustGate.judge`, and acts on each
:class:`~stoa.fleet.trust.bounds.Judgement`: pool the batch, credit probation work, drop it
(``stale``, ``behind``: no strike) or refuse it. Every refusal goes through
:meth:`Intake.reject`, which quarantines the object in the store (so a restart never retries
it), writes the ledger and emits an event row, together; the gate counts it against its
sender's key (strikes, bans). The version rules a batch must keep are the gate's
(:mod:`stoa.fleet.trust.bounds`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoa.fleet.config import RunConfig
from stoa.fleet.intake.copies import Copies
from stoa.fleet.intake.pool import Pool, Taken
from stoa.fleet.trust.bounds import Judgement, RunBounds, scoped
from stoa.fleet.trust.gate import TrustGate, max_groups
from stoa.fleet.trust.ledger import Ledger
from stoa.fleet.trust.records import public_reason
from stoa.fleet.trust.review import FloatScorer
from stoa.transport.exchange import Batch, Rejection, RolloutReader, write_progress
from stoa.transport.sequence import write_floors
from stoa.transport.store import StoreError

if TYPE_CHECKING:
    from stoa.fleet.trainer.policies import HeldPolicies
    from stoa.transport.store import ObjectStore
    from stoa.types import Category, Episode

__all__ = ["Intake", "IntakeCounters"]

log = logging.getLogger("stoa.trainer")

_PROGRESS_EVERY_S = 5.0


@dataclass
class IntakeCounters:
    dropped_stale_groups: int = 0
    dropped_reused_groups: int = 0
    dropped_malformed_groups: int = 0
    dropped_behind_groups: int = 0
    """Groups of batches below their key's version floor (:mod:`stoa.fleet.trust.bounds`)."""
    probation_batches: int = 0
    """Accepted batches of probation work (checked, never trained: :mod:`stoa.fleet.trust.assign`)."""
    future_version_batches: int = 0
    rejected_batches: int = 0
    """Decoded batches refused (the reader's refusals of undecodable objects are counted in its
    ``quarantined``)."""


class Intake:
    """Reads, checks and pools the fleet's batches for one trainer (see ``docs/architecture.md``).

    Args:
        cfg: the run config (``[rollout]`` sampling settings, ``[trainer]`` gates, ``[trust]``).
        store, private_key: the fleet's store and the run's signing key (roster, progress, reports).
        vocab_size: every token id must lie below it (the learner's).
        metric_types: the task's declared metric types (``TextEnv.metric_types``).
        ledger: the trainer's ledger.
        float_scorer: the learner (the audit's log pi and its floor; finds the batch to blame
            when a step fails).
        int8: the held int8 policies (spot-checks; replay's text codec).
        make_env: builds the run's training environment (replay).
        event: called with an event row's fields for every refusal and ban (the metrics log).
        roster_copy: where the gate keeps the newest roster it has seen (see :class:`TrustGate`).
    """

    def __init__(self, cfg: RunConfig, store: ObjectStore, private_key: Any, *, vocab_size: int,
                 metric_types: dict[str, Any], ledger: Ledger, float_scorer: FloatScorer, int8: HeldPolicies | None,
                 make_env: Callable[[], Any], event: Callable[..., Any] = lambda **_: None,
                 roster_copy: Path | None = None):
        from stoa.fleet.trust.replay import Replayer

        self.cfg, self.store, self.key = cfg, store, private_key
        self.metric_types, self.ledger, self.float_scorer, self.event = metric_types, ledger, float_scorer, event
        rc = cfg.rollout
        replayer = (Replayer(make_env, int8.codec, max_turn_tokens=rc.max_turn_tokens,
                             max_episode_tokens=rc.max_episode_tokens) if cfg.trust.replay and int8 else None)
        self.n_items = len(make_env().unwrapped)
        self.gate = TrustGate(cfg.trust, store, cfg.name, private_key, bounds=RunBounds.of(cfg, self.n_items, metric_types),
                              ledger=ledger, replayer=replayer, float_scorer=float_scorer, int8=int8,
                              roster_copy=roster_copy)
        self.gate.refresh(force=True)
        self.listed: dict[str, int] = {}  # object key -> the trainer's version at the listing before it appeared
        self._list_version = -1  # the trainer's version at the last listing (-1: none yet)
        self.reader = RolloutReader(store, cfg.name, vocab_size=vocab_size, hand_back=True)
        self.copies = Copies(cfg.trust.max_hashes)
        self.pool = Pool()
        self.waiting: list[Batch] = []  # newcomers' batches past this poll's quota (trust.newcomers_per_poll)
        self.used_groups: set[str] = set()
        self.counters = IntakeCounters()
        self._progress_written = 0.0

    # -- the verbs ---------------------------------------------------------------------------------
    def take(self, version: int) -> Taken | None:
        """Poll the store, check what came, and return ``trainer.groups_per_step`` eligible groups
        (oldest first), or None while there are not enough yet."""
        self._poll(version)
        tc = self.cfg.trainer
        taken, dropped = self.pool.choose(version, tc.groups_per_step, self.cfg.rollout.group_size, tc.max_lag,
                                          max_groups(self.cfg.trust, tc.groups_per_step), self.used_groups)
        self.counters.dropped_reused_groups += len(dropped["reused"])
        self.counters.dropped_stale_groups += len(dropped["stale"])
        self.counters.dropped_malformed_groups += len(dropped["malformed"])
        if any(dropped.values()):
            self.ledger.write(dropped={k: v for k, v in dropped.items() if v})
        return taken

    def settle(self, taken: Taken, error: Exception | None = None) -> None:
        """After the learner's step over ``taken``: with no ``error`` its groups are used and its
        senders credited; with one, the batches whose episodes the learner cannot take are
        refused and the other groups go back to the pool (if no batch alone fails, every batch
        of the step is refused)."""
        if error is None:
            for batch, g in zip(taken.batches, taken.groups):
                self.used_groups.add(g[0].group_id)
                self.gate.trained(batch, len(g))
            return
        by_batch: dict[str, tuple[Batch, list[list[Episode]]]] = {}
        for batch, g in zip(taken.batches, taken.groups):
            by_batch.setdefault(batch.key, (batch, []))[1].append(g)
        guilty = []
        for batch, groups in by_batch.values():
            try:
                lps = self.float_scorer.logprobs([e for g in groups for e in g])
                if not all(np.isfinite(lp).all() for lp in lps):
                    raise ValueError("non-finite trainer log-probs")
            except Exception as e:
                guilty.append((batch, f"the learner cannot take it: {type(e).__name__}: {e}"))
        if not guilty:
            guilty = [(b, f"a learner step over this and {len(by_batch) - 1} other batch(es) failed: "
                          f"{type(error).__name__}: {error}") for b, _ in by_batch.values()]
        for batch, reason in guilty:
            self.pool.remove(batch.key)
            self.reject(batch, reason[:2000])
        self.pool.put_back(taken, [b.key for b, _ in guilty])

    def put_back(self, taken: Taken) -> None:
        """Groups taken but never trained (dealt to a trainer an outer step dropped,
        :mod:`stoa.fleet.outer`): back to the front of the pool as they were, first in line."""
        self.pool.put_back(taken, [])

    def reject(self, item: Batch | Rejection, reason: str = "", category: Category = "invalid") -> None:
        """Refuse a batch, or an object the reader refused, everywhere at once: quarantine (a
        restart never retries it), the sender's record (strikes, bans), the ledger and an event
        row. A reader's refusal carries its own reason and category (``reason`` and ``category``
        are for a batch)."""
        if isinstance(item, Rejection):
            reason, category = item.reason, item.category  # type: ignore[assignment]
            kid, worker, episodes = item.key_id or "", item.worker_id or "", 0
        else:
            kid, worker, episodes = item.key_id, item.worker_id, len(item.episodes)
        self.gate.refused(item, kid, worker, category, reason, episodes)  # once per object, however often met
        self._refuse(item, kid, worker, reason, category)

    def _refuse(self, item: Batch | Rejection, kid: str, worker: str, reason: str, category: Category) -> None:
        """:meth:`reject`'s store side, for a refusal the gate has counted already."""
        if not self.reader.quarantine(item, public_reason(category, reason)):  # the store's copy is public
            return  # it stays in the store; the next poll meets it again
        if isinstance(item, Batch):
            self.counters.rejected_batches += 1
        self.ledger.write(rejected=item.key, category=category, reason=reason[:500])
        self.event(event="rejected", batch=item.key, worker=worker, key_id=kid, category=category,
                   reason=reason[:500])
        log.warning("quarantined %s: %s", item.key, reason)

    def calibrate(self, episodes: list[Episode]) -> float | None:
        """Set the audit's int8-versus-float floor from the trainer's own int8 ``episodes`` when
        the audit needs one (:meth:`TrustGate.calibrate`); returns it, or None."""
        return self.gate.calibrate(episodes)

    # -- polling and checks ------------------------------------------------------------------------
    def _poll(self, version: int) -> None:
        self.gate.refresh()
        for kid, where, reason in self.gate.bind(version, self.reader):
            self.ledger.write(refused_ticket=where, key_id=kid, reason=reason[:500])
            self.event(event="ticket_refused", ticket=where, key_id=kid, reason=reason[:500])
        admission = self.gate.admission()
        batches = self.reader.poll(admission=admission)  # unsealed and refused keys: never decoded
        self._listed(self.reader.last_report.listed, version)
        for refused in self.reader.last_report.rejected:
            self.reject(refused)
        batches, copies = self.copies.sift(batches, redraws=admission.redraws)
        for batch, why in copies:
            self.reject(batch, why, "duplicate")
        self._write_progress(bool(batches))
        judged = self.gate.judge(batches, version, listed=self.listed, pooled=[b for b, _ in self.pool.entries],
                                 waiting=self.waiting)
        for b in batches:
            self.listed.pop(b.key, None)
        self.waiting = judged.waiting
        for j in judged.judgements:
            self._act(j)
        for kid, worker, reason in judged.bans:
            self.event(event="banned", key_id=kid, worker=worker, reason=reason[:500])

    def _act(self, j: Judgement) -> None:
        """Do what the gate judged one batch worth (its refusal is counted by the gate already)."""
        batch = j.batch
        if j.action == "reject":
            assert j.verdict is not None
            if j.verdict.category == "future":
                self.counters.future_version_batches += 1
            self.pool.remove(batch.key)  # a pooled batch of a key banned now, or nothing
            self._refuse(batch, batch.key_id, batch.worker_id, j.verdict.reason, j.verdict.category)
        elif j.action == "drop":
            self.pool.remove(batch.key)  # a pooled batch taken back, or nothing
            groups = j.groups()
            if j.dropped == "stale":
                self.counters.dropped_stale_groups += len(groups)
                self.ledger.write(dropped={"stale": groups})
            else:
                self.counters.dropped_behind_groups += len(groups)
                self.ledger.write(dropped={j.dropped: groups}, batch=batch.key, reason=j.detail)
                log.info("dropped %s (%s): %s", batch.key, j.dropped, j.detail)
        elif j.action == "probation":  # checked and credited, never trained on
            self.counters.probation_batches += 1
            self.ledger.write(probation=batch.key)
        else:
            skip = j.untrained  # groups holding an unverifiable episode
            self.pool.add(dataclasses.replace(batch, episodes=[e for e in batch.episodes if e.group_id not in skip])
                          if skip else batch)

    def _listed(self, keys: list[str], version: int) -> None:
        """The reader's listing of the rollouts at the trainer's ``version``: every object new since
        the previous listing was uploaded after it, when the version of that listing was already
        published (a probation batch's version floor, :mod:`stoa.fleet.trust.bounds`)."""
        present = set(keys)
        self.listed = {k: v for k, v in self.listed.items() if k in present}
        for k in keys:
            self.listed.setdefault(k, self._list_version)
        self._list_version = version

    def _write_progress(self, fresh: bool) -> None:
        """What was taken, per worker (signed): workers throttle on it (rollout.max_outstanding) and
        wait while it is missing, so it is rewritten every few seconds even when nothing came."""
        if fresh or time.time() - self._progress_written > _PROGRESS_EVERY_S:
            try:
                write_progress(self.store, self.cfg.name, self.reader.progress(), self.key)
                write_floors(self.store, self.cfg.name, self.reader.next_numbers(), self.key)  # no number reused
                self._progress_written = time.time()
            except StoreError as e:
                log.warning("could not write the progress document (%s); will retry", e)

    # -- reports -----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``dropped/...`` and ``trust/...`` figures for the trainer's rows (cumulative)."""
        c = self.counters
        return {"dropped/stale_groups": c.dropped_stale_groups, "dropped/reused_groups": c.dropped_reused_groups,
                "dropped/behind_groups": c.dropped_behind_groups, "trust/probation_batches": c.probation_batches,
                "dropped/quarantined_batches": self.reader.quarantined, "dropped/rejected_batches": c.rejected_batches,
                **self.gate.metrics()}

    def report(self, version: int, force: bool = False) -> None:
        """Put the signed per-worker report (``<run>/trust.json``) that ``stoa status`` shows (at
        most every 2 s unless ``force``)."""
        self.gate.write_report(version, force=force)

    # -- checkpoints -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON-ready state for a checkpoint: pooled and waiting batches stay unconsumed, so a
        restart from it delivers them again (:meth:`RolloutReader.state`)."""
        pending = self.pool.batches() + self.waiting
        waiting_groups = self.pool.waiting_groups()
        pending_used = sorted(gid for b in self.pool.batches() for gid in {scoped(b.key_id, e.group_id)
                                                                           for e in b.episodes}
                              if gid in self.used_groups and gid not in waiting_groups)
        return {"reader": self.reader.state(pending=pending), "hashes": self.copies.state(pending),
                "used_groups": pending_used, "counters": asdict(self.counters), "trust": self.gate.state()}

    def restore(self, state: dict[str, Any]) -> None:
        self.reader.restore(state["reader"])
        self.copies.restore(state.get("hashes", state["reader"].get("hashes", [])))  # older states keep them there
        self.used_groups = set(state["used_groups"])
        self.counters = IntakeCounters(**state["counters"])
        trust = dict(state.get("trust") or {})
        if "bindings" in state:  # older states keep them beside the trust state
            trust.setdefault("bindings", state["bindings"])
        if trust:
            self.gate.restore(trust)

    def prune(self, state: dict[str, Any]) -> None:
        """Delete consumed batches that ``state`` (a checkpoint's) no longer needs from the store."""
        self.reader.prune(state["reader"])
