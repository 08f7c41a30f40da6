"""The coordinator: rank 0 of a run's trainers deals the fleet's work, merges, and publishes.

One outer step (one published version ``v``) is one *round*:

1. **members**: rank 0 and every other trainer whose heartbeat is fresh and who holds ``v``'s
   weights or was in the last merge (it applies that merge on its own). The first round waits up
   to ``outer.join_s`` for every trainer.
2. **deal**: the intake's steps (each ``trainer.groups_per_step`` checked groups, exactly as one
   trainer takes them) go one at a time to the member with the fewest so far, until each has
   ``outer.inner_steps``; rank 0 trains its own at once, the others get theirs through the store
   (:meth:`OuterExchange.put_work`). Every group is dealt to exactly one trainer.
3. **wait**: for each member's update, up to ``outer.deadline_s``; a member whose heartbeat goes
   silent (``outer.silent_s``), whose update fails a check, or who is late, is dropped: its items
   go back to the front of the intake's pool (the next round deals them to the others).
4. **merge**: the members' outer gradients (``theta_v - theta_i``; rank 0's exact) averaged and
   stepped by the Nesterov outer optimizer; the step, compressed with the coordinator's error
   feedback, is written signed and applied by every trainer alike, rank 0 included; the trainer
   then publishes the new weights on the chain. Only the groups of merged updates count as
   trained (the ledger says so); a late update of a dropped trainer is never read.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoa.fleet.intake import Taken
from stoa.fleet.outer.codec import UpdateError, encode_update, fp32_bytes, l2_norm
from stoa.fleet.outer.exchange import OuterExchange
from stoa.fleet.outer.nesterov import OuterOptimizer
from stoa.fleet.outer.section import OuterConfig

__all__ = ["Coordinator", "Merge", "mean_metrics"]

log = logging.getLogger("stoa.trainer")


@dataclass(frozen=True)
class Merge:
    """One finished round: what the trainer settles, publishes and logs."""

    trained: list[Taken]
    """Groups in the merged weights (settle as trained)."""
    returned: list[Taken]
    """Groups dealt to a dropped trainer (back to the pool, untrained)."""
    failed: list[tuple[Taken, Exception]]
    """Groups another trainer's learner could not take (settle with the error: the intake finds the batch)."""
    rollout: dict[str, float]
    learn: dict[str, float]
    metrics: dict[str, float]
    """``outer/*``: members, drops, norms, bytes each way, seconds."""
    summary: dict[str, Any]
    """For the ledger: ranks included and dropped (and why)."""


def mean_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each numeric key's mean over the rows that carry it (sums for ``groups/zero_variance``)."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v):
                acc.setdefault(k, []).append(float(v))
            elif isinstance(v, bool):
                acc.setdefault(k, []).append(float(v))
    return {k: (float(np.sum(v)) if k == "groups/zero_variance" or k.startswith("staleness/lag")
                else float(np.mean(v))) for k, v in acc.items()}


@dataclass
class _Round:
    version: int
    opened: float
    members: set[int] | None = None
    items: dict[int, list[Taken]] = field(default_factory=dict)
    own: list[dict[str, Any]] = field(default_factory=list)
    updates: dict[int, tuple[dict[str, Any], dict[str, np.ndarray]]] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    deadline: float | None = None
    bytes0: Counter[str] = field(default_factory=Counter)


class Coordinator:
    """Rank 0's side of the outer loop; the trainer calls :meth:`begin` once and :meth:`advance` in its loop.

    Args:
        config: ``[outer]``.
        exchange: the run's outer objects (with the run's private key).
        learner: rank 0's learner (``iter_weights``, ``load_weights``).
        learn: one inner step on a taken step's groups: ``(rollout metrics, learner metrics)``;
            raises what the learner raises.
        refuse: settles a taken step the learner failed on (the intake finds the batch to blame).
        event: sink for event rows.
    """

    def __init__(self, config: OuterConfig, exchange: OuterExchange, learner: Any,
                 learn: Callable[[Taken], tuple[dict[str, Any], dict[str, Any]]],
                 refuse: Callable[[Taken, Exception], None], event: Callable[..., Any] = lambda **_: None):
        self.oc, self.exchange, self.learner = config, exchange, learner
        self.learn, self.refuse, self.event = learn, refuse, event
        self.opt = OuterOptimizer(config.lr, config.momentum, config.nesterov)
        self.residual: dict[str, np.ndarray] | None = None  # error feedback of the merged step
        self.rounds = 0
        self.included: set[int] = set()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat seq, local time it changed)
        self.base: dict[str, np.ndarray] = {}
        self.round: _Round | None = None
        self.total: Counter[str] = Counter()

    def _weights(self) -> dict[str, np.ndarray]:
        return {k: np.array(v, np.float32) for k, v in self.learner.iter_weights("float32")}

    def begin(self, version: int) -> None:
        """Write ``version``'s float weights for the trainers to join from, and open its round."""
        self.base = self._weights()
        self.shapes = {k: tuple(v.shape) for k, v in self.base.items()}
        self.exchange.put_base(version, self.base)
        self.newest_base = version
        self.round = _Round(version, time.time(), bytes0=Counter(self.exchange.bytes))

    def abandon(self) -> list[Taken]:
        """Stopping mid-round: rank 0's weights back to the round's base, and every group dealt in
        it, to go back to the pool untrained (a checkpoint then holds exactly what was merged)."""
        r = self.round
        if r is None:
            return []
        self.learner.load_weights(self.base)
        out = [t for items in r.items.values() for t in items]
        r.items, r.own = {}, []
        return out

    # -- the round ------------------------------------------------------------------------------
    def advance(self, version: int, take: Callable[[], Taken | None]) -> tuple[bool, Merge | None]:
        """One pass: ``(whether anything happened, the finished round or None)``."""
        r = self.round
        assert r is not None and r.version == version, "begin() first; the trainer publishes each merge"
        beats = self._fresh()
        if r.members is None:
            r.members = self._members(r, beats)
            if r.members is None:
                return False, None
            self.event(event="outer_round", round_version=version, members=sorted(r.members))
        for rank in sorted(r.members - {0} - set(r.dropped) - set(r.updates)):
            if rank not in beats:
                self._drop(r, rank, f"silent for {self.oc.silent_s:.0f} s")
        if not self._dealt(r):
            taken = take()
            if taken is None:
                return False, None
            rank = min((m for m in r.members if m not in r.dropped and len(r.items.get(m, [])) < self.oc.inner_steps),
                       key=lambda m: (len(r.items.get(m, [])), m == 0, m))
            if rank == 0:
                try:
                    rollout, learned = self.learn(taken)
                except Exception as e:  # the intake blames a batch; the slot is dealt again
                    self.refuse(taken, e)
                    return True, None
                r.own.append({**rollout, **learned})
            else:
                self.exchange.put_work(version, rank, len(r.items.get(rank, [])), taken.episodes)
            r.items.setdefault(rank, []).append(taken)
            return True, None
        if r.deadline is None:
            r.deadline = time.time() + self.oc.deadline_s
        got = self._poll(r)
        waiting = r.members - {0} - set(r.dropped) - set(r.updates)
        if waiting and time.time() < r.deadline:
            return got, None
        for rank in sorted(waiting):
            self._drop(r, rank, f"no update within outer.deadline_s = {self.oc.deadline_s:g} s")
        return True, self._merge(r)

    def _fresh(self) -> set[int]:
        """Ranks whose heartbeat changed within ``outer.silent_s`` (by this process's clock)."""
        now, beats = time.time(), self.exchange.beats()
        self.beats = beats
        for rank, b in beats.items():
            seq, _ = self._seen.get(rank, (None, 0.0))
            if seq != b.seq:
                self._seen[rank] = (b.seq, now)
        return {rank for rank, (_, t) in self._seen.items() if now - t < self.oc.silent_s
                and 0 < rank < self.oc.trainers}

    def _members(self, r: _Round, fresh: set[int]) -> set[int] | None:
        ready = {k for k in fresh if self.beats[k].base == r.version}
        if self.rounds == 0 and len(ready) < self.oc.trainers - 1 and time.time() - r.opened < self.oc.join_s:
            return None
        return {0} | ready | (fresh & self.included)

    def _dealt(self, r: _Round) -> bool:
        assert r.members is not None
        return all(len(r.items.get(m, [])) >= self.oc.inner_steps for m in r.members if m not in r.dropped)

    def _drop(self, r: _Round, rank: int, why: str) -> None:
        if rank in r.dropped:
            return
        r.dropped[rank] = why
        r.updates.pop(rank, None)
        log.warning("outer step from v%d: trainer %d dropped (%s); its %d item(s) go back to the pool",
                    r.version, rank, why, len(r.items.get(rank, [])))
        self.event(event="outer_trainer_dropped", rank=rank, round_version=r.version, reason=why[:300],
                   returned_items=len(r.items.get(rank, [])))

    def _poll(self, r: _Round) -> bool:
        got = False
        for rank in sorted(r.members - {0} - set(r.dropped) - set(r.updates)):
            try:
                res = self.exchange.update(r.version, rank, self.shapes)
            except UpdateError as e:
                self._drop(r, rank, f"update refused: {e}")
                continue
            if res is None:
                continue
            meta, _ = res
            dealt = set(range(len(r.items.get(rank, []))))
            items, failed = meta.get("items"), meta.get("failed")
            if not (isinstance(items, list) and isinstance(failed, dict)
                    and set(items) | {int(k) for k in failed if str(k).isdigit()} == dealt
                    and isinstance(meta.get("metrics"), list)):
                self._drop(r, rank, "update refused: its items do not match what was dealt")
                continue
            r.updates[rank] = res
            got = True
        return got

    def _merge(self, r: _Round) -> Merge:
        t0 = time.time()
        now = self._weights()
        own = {k: self.base[k] - now[k] for k in self.base}
        own_norm = l2_norm(own)
        grads, included, norms = [own], [0], {"0": own_norm}
        for rank, (meta, dec) in sorted(r.updates.items()):
            n = l2_norm(dec)
            if self.oc.norm_ratio and own_norm > 0 and n > self.oc.norm_ratio * own_norm:
                self._drop(r, rank, f"update refused: L2 norm {n:.3g} > {self.oc.norm_ratio:g} x rank 0's {own_norm:.3g}")
                continue
            grads.append(dec)
            included.append(rank)
            norms[str(rank)] = n
        step = self.opt.step(grads)
        enc = encode_update(step, self.residual, compress=self.oc.compress, block=self.oc.block,
                             topk=self.oc.topk)
        self.residual = enc.residual
        self.base = {k: self.base[k] + enc.decoded[k] for k in self.base}
        self.learner.load_weights(self.base)
        to_version = r.version + 1
        self.exchange.put_merged(r.version, to_version, enc, included, sorted(r.dropped))
        self.rounds += 1
        self.included = set(included) - {0}
        if self.rounds % self.oc.base_every == 0:
            self.exchange.put_base(to_version, self.base)
            self.newest_base = to_version
        self.exchange.prune(r.version, self.newest_base)
        trained = [t for rank in included for t in r.items.get(rank, [])]
        failed: list[tuple[Taken, Exception]] = []
        rows = list(r.own)
        for rank in included[1:]:
            meta = r.updates[rank][0]
            bad = {int(k): str(v) for k, v in meta["failed"].items()}
            for i, t in enumerate(r.items[rank]):
                if i in bad:
                    trained.remove(t)
                    failed.append((t, RuntimeError(f"trainer {rank}'s learner failed: {bad[i][:500]}")))
            rows += [m for m in meta["metrics"] if isinstance(m, dict)]
        returned = [t for rank in r.dropped for t in r.items.get(rank, [])]
        metrics = mean_metrics(rows)
        rollout = {k: v for k, v in metrics.items() if not k.startswith(("learner/", "loss", "gate/", "grad", "lr",
                                                                            "tokens", "seconds", "micro", "pad"))}
        learn = {k: v for k, v in metrics.items() if k not in rollout}
        sent = self.exchange.bytes - r.bytes0
        inner = len(included) - 1
        full = fp32_bytes(self.shapes)
        out = {"outer/members": len(r.members or ()), "outer/included": len(included), "outer/dropped": len(r.dropped),
               "outer/inner_steps": self.oc.inner_steps, "outer/update_norm": own_norm,
               "outer/step_norm": l2_norm(enc.decoded),
               "outer/update_bytes": sent["update_in"], "outer/merged_bytes": (sent["merged_out"] - 0) * max(inner, 0),
               "outer/work_bytes": sent["work_out"], "outer/base_bytes": sent["base_out"],
               "outer/fp32_update_bytes": full,
               "outer/fp32_per_step_bytes": 2 * inner * full * self.oc.inner_steps,
               "outer/merge_s": time.time() - t0, "outer/round_s": time.time() - r.opened}
        out["outer/exchanged_bytes"] = out["outer/update_bytes"] + out["outer/merged_bytes"]
        for k in ("update_bytes", "merged_bytes", "work_bytes", "base_bytes", "exchanged_bytes", "fp32_per_step_bytes"):
            self.total[k] += int(out[f"outer/{k}"])
            out[f"outer/total_{k}"] = self.total[k]
        summary = {"version": r.version, "included": included, "dropped": dict(sorted((str(k), v[:200])
                                                                                     for k, v in r.dropped.items()))}
        self.round = _Round(to_version, time.time(), bytes0=Counter(self.exchange.bytes))
        return Merge(trained, returned, failed, rollout, learn, out, summary)
