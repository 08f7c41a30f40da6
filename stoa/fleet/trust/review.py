"""The trainer's review of an admitted batch's content: replay, log-prob audit, spot-checks and
the sampling check. Each check returns a typed :class:`Verdict` (or None to pass) and changes
nothing outside its own statistics; :class:`stoa.fleet.trust.gate.TrustGate` applies verdicts to
the records and the roster.

In the order a batch meets them:

1. **Replay** (:mod:`stoa.fleet.trust.replay`): every episode re-played through the trainer's
   own environment (tasks that declare ``replayable``). An episode whose outcome depended on
   the machine (``TextEnv.indeterminate_metrics``) is unverifiable: not a forgery, not trained.
2. **Every episode checked** (``audit.every_episode``, with assigned work): one int8 forward pass
   per distinct row at the claimed version gives, for every sampled token of every episode, its
   draw margin under the assigned seed (:func:`stoa.backends.sampling.draw_margins`) and its
   log-prob, compared with the claimed log mu token by token (:func:`~stoa.fleet.trust.audit.compare_logprobs`).
3. Otherwise (``every_episode = false``, or no assigned work): the **audit**
   (:mod:`stoa.fleet.trust.audit`) scores a sample of episodes with the learner (log pi against
   the claimed log mu); a suspicious episode or key, or a random draw, triggers a **spot-check**
   with the int8 policy of the claimed version; and with assigned work ``audit.sampling_episodes``
   random episodes, plus every episode whose tokens repeat another's, are re-derived.

A token the rule did not draw (margin below ``-audit.sampling_band``) or a claimed log-prob off
the re-score is a confirmed forgery: a verdict with ``ban=True``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stoa.fleet.trust.audit import LogprobAudit, compare_logprobs, episode_stats, spot_check
from stoa.fleet.trust.replay import layout_digest
from stoa.fleet.trust.section import AuditConfig
from stoa.types import Verdict

if TYPE_CHECKING:
    from stoa.backends.sampling import Draws
    from stoa.fleet.trust.assign import Assignment
    from stoa.fleet.trust.replay import Replayer
    from stoa.transport.exchange import Batch
    from stoa.types import Episode

__all__ = ["FloatScorer", "Int8Scorer", "Review", "Verdict", "distinct_rows", "sampling_pick"]

log = logging.getLogger("stoa.trust")


class FloatScorer(Protocol):
    """The trainer's float policy (a :class:`stoa.backends.learner.Learner` is one)."""

    def logprobs(self, episodes: Sequence[Episode], temperature: float | None = 1.0, *,
                 model_only: bool = False) -> list[np.ndarray]:
        """Per-episode log-probs aligned with ``Episode.tokens()`` (``temperature=None``: each
        episode's own; ``model_only``: model tokens only, 0 elsewhere)."""
        ...


class Int8Scorer(Protocol):
    """The int8 policies workers sampled from (:class:`stoa.fleet.trainer.policies.HeldPolicies` is one)."""

    def score(self, version: int, episodes: Sequence[Episode]) -> list[np.ndarray] | None:
        """Prefill log-probs of ``version``'s int8 policy, aligned with ``Episode.tokens()``; None
        when that version's weights are no longer held."""
        ...

    def sampling_margins(self, version: int, episodes: Sequence[Episode], seeds: Sequence[int],
                         drift: float = 0.0) -> list[np.ndarray] | None:
        """``RolloutEngine.sampling_margins`` under ``version``'s int8 policy; None when not held."""
        ...

    def check_draws(self, version: int, episodes: Sequence[Episode], seeds: Sequence[int],
                    drift: float = 0.0) -> list[Draws] | None:
        """``RolloutEngine.check_draws`` under ``version``'s int8 policy; None when not held."""
        ...


def distinct_rows(eps: Sequence[Episode]) -> tuple[list[Episode], list[int]]:
    """``(distinct, of)``: one episode per distinct (tokens, temperature), and the index in
    ``distinct`` of each episode of ``eps`` (what the audit scores once)."""
    row: dict[tuple[bytes, float], int] = {}
    distinct: list[Episode] = []
    of = []
    for e in eps:
        k = (layout_digest(e), float(e.temperature))
        if k not in row:
            row[k] = len(distinct)
            distinct.append(e)
        of.append(row[k])
    return distinct, of


def sampling_pick(eps: Sequence[Episode], rng: np.random.Generator, n_random: int) -> list[int]:
    """Which episodes of a batch the sampling check re-derives: ``n_random`` drawn with ``rng``,
    and every episode whose tokens repeat another's (a variant copy, or an honest
    near-deterministic sample)."""
    seen: dict[bytes, int] = {}
    dup = []
    for i, e in enumerate(eps):
        d = layout_digest(e)
        if d in seen:
            dup += [seen[d], i]
        seen.setdefault(d, i)
    drawn = rng.permutation(len(eps))[:n_random].tolist()
    return sorted(set(dup) | set(drawn))


class Review:
    """The content checks (see the module docstring) and their statistics.

    Args:
        cfg: ``[trust.audit]``.
        replay: whether ``[trust] replay`` is on.
        replayer, float_scorer, int8, rng: as :class:`~stoa.fleet.trust.gate.TrustGate` takes them.

    A check that needs the batch's assigned work (its seed) is handed it with the batch
    (:meth:`check`); without one, the checks that re-derive draws are not made.
    """

    def __init__(self, cfg: AuditConfig, replay: bool, *, replayer: Replayer | None,
                 float_scorer: FloatScorer | None, int8: Int8Scorer | None, rng: np.random.Generator):
        self.cfg, self.rng = cfg, rng
        self.audit = LogprobAudit(cfg)
        self.seconds = {"replay": 0.0, "audit": 0.0, "spot_check": 0.0, "sampling": 0.0, "episode_check": 0.0}
        self.counts = {"spot_checks": 0, "episodes_replayed": 0, "episodes_audited": 0, "sampled_tokens_checked": 0,
                       "sampled_tokens_ambiguous": 0, "sampling_violations": 0, "episodes_checked": 0}
        self.claim_gap = 0.0  # the largest |claimed log mu - int8 re-score at the claimed version| seen
        if replayer is not None and replay and not replayer.replayable:
            log.warning("the task is not replayable (TextEnv.replayable = False): episodes are audited only")
        self.replayer = replayer if replay and replayer is not None and replayer.replayable else None
        self.float_scorer = float_scorer if cfg.enabled else None
        self.int8 = int8 if cfg.enabled else None

    def draws_every_episode(self, key_id: str) -> bool:
        """Whether a batch sealed by ``key_id`` gets every episode's tokens re-derived from its
        assigned seed (:meth:`check` with assigned work): sealed, an int8 re-score, and
        ``audit.every_episode``."""
        return bool(key_id) and self.int8 is not None and self.cfg.every_episode

    def replay(self, b: Batch) -> tuple[Verdict | None, list[tuple[int, str]]]:
        """``(verdict, unverifiable)``: replay's verdict on ``b`` (None also when replay is off)
        and, when it passes, ``(index, reason)`` of its episodes that replay can neither confirm
        nor refute (:class:`~stoa.fleet.trust.replay.Unverifiable`: not the worker's fault, and
        not to be trained on)."""
        if self.replayer is None:
            return None, []
        unverifiable: list[tuple[int, str]] = []
        verdict = _guarded(self._replay, b, unverifiable)
        return verdict, unverifiable if verdict is None else []

    def check(self, b: Batch, work: Assignment | None, trainer_version: int) -> tuple[Verdict | None, bool]:
        """``(verdict, spot_checked)``: the audit and the sampling check of ``b``, whose assigned
        work is ``work`` (None: none known, so no draw is re-derived), and whether a spot-check
        was made (whatever its outcome)."""
        verdict, spot = None, [False]
        seed = work.seed if work is not None and self.int8 is not None and b.key_id else None
        if seed is not None and self.cfg.every_episode:
            return _guarded(self._every, b, seed), False
        if self.float_scorer is not None:
            verdict = _guarded(self._audit, b, seed, trainer_version, spot)
        if verdict is None and seed is not None:
            verdict = _guarded(self._draws, b, seed)
        return verdict, spot[0]

    def _every(self, b: Batch, seed: int) -> Verdict | None:
        """Every episode: its sampled tokens re-derived from the assigned seed and its claimed
        log mu compared with the int8 re-score, from one forward pass per distinct row."""
        eps = list(b.episodes)
        t0 = time.perf_counter()
        drift = self.cfg.sampling_band / 2
        draws = self.int8.check_draws(b.version, eps, [seed] * len(eps), drift)  # type: ignore[union-attr]
        self.seconds["episode_check"] += time.perf_counter() - t0
        if draws is None:  # never accepted unchecked: a forger would claim exactly such a version
            return Verdict("unverifiable", f"the episodes cannot be checked: version {b.version}'s int8 weights "
                                           "are neither held nor rebuildable from the weight chain")
        self.counts["episodes_checked"] += len(eps)
        lps = compare_logprobs(eps, [(d.at, d.logprobs) for d in draws], self.cfg)
        self.claim_gap = max(self.claim_gap, lps.worst)
        if lps.confirmed:
            return Verdict("audit", f"log-prob check: {lps.detail}", ban=True)
        why = self._sampling(b, eps, seed, [d.margins for d in draws])
        return None if why is None else Verdict("sampling", why, ban=True)

    def _replay(self, b: Batch, unverifiable: list[tuple[int, str]]) -> Verdict | None:
        t0 = time.perf_counter()
        bad, unverifiable[:] = self.replayer.triage(b.episodes)  # type: ignore[union-attr]
        self.seconds["replay"] += time.perf_counter() - t0
        self.counts["episodes_replayed"] += len(b.episodes)
        if not bad:
            return None
        i, why = bad[0]
        ep = b.episodes[i]
        return Verdict("replay", f"replay: {len(bad)} of {len(b.episodes)} episodes do not match the environment; "
                                 f"episode {i} (group {ep.group_id[:48]!r}, item {ep.item_index}): {why}")

    def _audit(self, b: Batch, seed: int | None, trainer_version: int, spot: list[bool]) -> Verdict | None:
        eps = b.episodes
        n = max(1, math.ceil(self.cfg.fraction * len(eps)))
        pick = sorted(self.rng.choice(len(eps), size=min(n, len(eps)), replace=False).tolist())
        t0 = time.perf_counter()
        lps = self._float_logprobs([eps[i] for i in pick])
        self.seconds["audit"] += time.perf_counter() - t0
        self.counts["episodes_audited"] += len(pick)
        staleness = trainer_version - b.version
        stats = [episode_stats(lp, eps[i]) for i, lp in zip(pick, lps)]
        suspicious = [(i, why) for i, st in zip(pick, stats) if (why := self.audit.episode_verdict(staleness, st))]
        why_worker = self.audit.worker_verdict(b.key_id, extra=(staleness, stats))
        verdict = None
        if suspicious or why_worker or self.rng.random() < self.cfg.random_spot_check:
            reason = suspicious[0][1] if suspicious else why_worker or "random spot-check"
            verdict = self._spot_check(b, seed, [i for i, _ in suspicious], reason, spot)
        if verdict is None:  # what passed (a spot-check, if any) shapes the worker's statistics and the fleet's range
            for st in stats:
                self.audit.observe(b.key_id, staleness, st)
        return verdict

    def _float_logprobs(self, eps: list[Episode]) -> list[np.ndarray]:
        """The learner's log pi of ``eps`` at their model tokens. Episodes with the same tokens and
        temperature (a converged policy repeats itself) share one scored row; each keeps its own
        claims, which the audit compares one episode at a time."""
        distinct, of = distinct_rows(eps)
        lps = self.float_scorer.logprobs(distinct, temperature=None, model_only=True)  # type: ignore[union-attr]
        return [lps[j] for j in of]

    def _spot_check(self, b: Batch, seed: int | None, first: list[int], reason: str,
                    spot: list[bool]) -> Verdict | None:
        """Re-score some episodes with the int8 policy of the claimed version: their log-probs
        token by token, and (when the batch's work was assigned) every token against the draw the
        sampling rule makes from the assigned seed. A confirmed mismatch bans the key."""
        if self.int8 is None:
            return None
        rest = [i for i in self.rng.permutation(len(b.episodes)).tolist() if i not in first]
        pick = (first + rest)[: self.cfg.spot_check_episodes]
        eps = [b.episodes[i] for i in pick]
        t0 = time.perf_counter()
        scored = self.int8.score(b.version, eps)
        if scored is None:  # never accepted unchecked: a forger would claim exactly such a version
            return Verdict("unverifiable", f"{reason}; the spot-check cannot be made: version {b.version}'s int8 "
                                           "weights are neither held nor rebuildable from the weight chain")
        result = spot_check(lambda _: scored, eps, self.audit.config)
        self.claim_gap = max(self.claim_gap, result.worst)
        drawn = None if result.confirmed or seed is None else self._sampling(b, eps, seed)
        self.seconds["spot_check"] += time.perf_counter() - t0
        self.counts["spot_checks"] += 1
        spot[0] = True
        if not result.confirmed and drawn is None:
            log.info("spot-check of %s (%s): %s", b.key, reason, result.detail)
            return None
        why = f"log-prob audit: {reason}; spot-check: {result.detail if result.confirmed else drawn}"
        return Verdict("audit" if result.confirmed else "sampling", why, ban=True)

    def _draws(self, b: Batch, seed: int) -> Verdict | None:
        """Every batch: ``audit.sampling_episodes`` random episodes, and every episode whose tokens
        repeat another's in the batch (a variant copy, or an honest near-deterministic sample),
        re-derived from the assigned seed; a token the rule did not draw bans the key."""
        pick = sampling_pick(b.episodes, self.rng, self.cfg.sampling_episodes)
        t0 = time.perf_counter()
        eps = [b.episodes[i] for i in pick]
        drift = self.cfg.sampling_band / 2
        margins = self.int8.sampling_margins(b.version, eps, [seed] * len(eps), drift)  # type: ignore[union-attr]
        if margins is None:  # never accepted unchecked
            return Verdict("unverifiable", f"the sampling check cannot be made: version {b.version}'s int8 weights "
                                           "are neither held nor rebuildable from the weight chain")
        why = self._sampling(b, eps, seed, margins)
        self.seconds["sampling"] += time.perf_counter() - t0
        return None if why is None else Verdict("sampling", why, ban=True)

    def _sampling(self, b: Batch, eps: list[Episode], seed: int,
                  margins: list[np.ndarray] | None = None) -> str | None:
        """Why some of ``eps``' tokens are not the ones the sampling rule draws from the batch's
        assigned seed under the claimed version's int8 weights (``margins``, computed here when
        not given), or None."""
        if margins is None:
            margins = self.int8.sampling_margins(b.version, eps, [seed] * len(eps),  # type: ignore[union-attr]
                                                 self.cfg.sampling_band / 2)
            if margins is None:  # only after the log-prob re-score of the same version succeeded
                return None
        band = self.cfg.sampling_band
        flat = np.concatenate(margins) if margins else np.zeros(0)
        self.counts["sampled_tokens_checked"] += int(flat.size)
        self.counts["sampled_tokens_ambiguous"] += int((np.abs(flat) <= band).sum())
        bad = [(e, int((m < -band).sum()), int(m.size)) for e, m in zip(eps, margins) if (m < -band).any()]
        if not bad:
            return None
        self.counts["sampling_violations"] += sum(n for _, n, _ in bad)
        e, n, total = bad[0]
        return (f"sampling: {len(bad)} of {len(eps)} episodes hold tokens the sampling rule does not draw from the "
                f"assigned seed at temperature {e.temperature:g}, top_p {e.top_p:g} (group {e.group_id[:40]!r} sample "
                f"{e.sample_index}: {n} of {total} tokens beaten by another by more than {band:g} logits)")

    def calibrate(self, episodes: Sequence[Episode], trainer_logprobs: Sequence[np.ndarray]) -> float:
        """The int8-versus-float floor, from the trainer's own int8 episodes at one version."""
        floor = self.audit.calibrate([episode_stats(lp, ep) for ep, lp in zip(episodes, trainer_logprobs)])
        log.info("audit calibrated: int8-vs-float mean |log pi - log mu| (99th percentile per episode) %.4f", floor)
        return floor

    def metrics(self) -> dict[str, float]:
        """``trust/...`` seconds and counts of the checks, the audit's floor and fleet median, and
        ``trust/claim_gap_max``: the largest gap between a claimed log mu and the int8 re-score at
        its claimed version over every token re-scored (what an honest engine's numerics leave;
        ``audit.spot_check_tolerance`` is the bound)."""
        out = {**{f"trust/{k}_s": round(v, 4) for k, v in self.seconds.items()},
               **{f"trust/{k}": float(v) for k, v in self.counts.items()}}
        if self.counts["episodes_checked"] or self.counts["spot_checks"]:
            out["trust/claim_gap_max"] = self.claim_gap
        if self.audit.floor is not None:
            out["trust/audit_floor"] = self.audit.floor
        f = self.audit.fleet("0")
        if f is not None:
            out["trust/audit_median_s0"] = f[0]
        return out


def _guarded(check: Callable[..., Verdict | None], *args: Any) -> Verdict | None:
    """A check that fails on a stranger's batch rejects the batch; it never stops the trainer."""
    try:
        return check(*args)
    except Exception as e:
        name = check.__name__
        return Verdict("invalid", f"checking the batch failed ({name}): {type(e).__name__}: {str(e)[:300]}")
