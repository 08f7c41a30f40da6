"""Log-prob audit: are a worker's behaviour log-probs the ones its claimed policy gives?

By default (``AuditConfig.every_episode``, with assigned work) every episode's claims are
compared token by token with the int8 re-score of its claimed version (:func:`compare_logprobs`,
from the same forward pass that re-derives its draws), and the statistical audit below is not
run. It runs with ``every_episode = false``:

Every model token of an episode carries ``log mu``, the log-probability the worker says its int8
policy (the claimed ``policy_version``) gave it. The trainer scores a random sample of each
admitted batch with its own float weights (``log pi``, one forward pass, no backward) and keeps,
per worker key and per staleness bucket (versions behind: 0, 1, 2, 3+), running sums of
``|log pi - log mu|`` and of *implausible* tokens (``log pi < -15`` where ``log mu > -1``: a token
the trainer's policy all but never samples, claimed as likely).

Honest workers differ from the trainer only by int8 rounding and staleness, so their statistics
sit together. The honest range is calibrated from the fleet, never guessed:

* ``floor``: the int8-versus-float mismatch measured once, at version 0, on the trainer's own
  int8 evaluation episodes (the 99th percentile of per-episode mean ``|log pi - log mu|``);
* per bucket, the median across workers of each worker's running mean, and the median absolute
  deviation (MAD) around it.

An episode is *suspicious* when its mean ``|log pi - log mu|`` exceeds ``episode_factor`` times
the reference of its bucket (the fleet median, or the floor grown with staleness while the fleet
has no data there), or when it has an implausible token; a worker is suspicious when its running
mean leaves ``median + worker_mads * max(MAD, floor)``. Suspicion only selects: a suspicious
worker's episodes are then **spot-checked** (:func:`spot_check`), re-scored token by token with
the int8 engine at the claimed version; a confirmed mismatch is what bans a worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from stoa.fleet.trust.section import AuditConfig
from stoa.types import Episode

__all__ = ["LogprobAudit", "SpotCheck", "TokenStats", "compare_logprobs", "episode_stats", "spot_check"]

BUCKETS = ("0", "1", "2", "3+")
IMPLAUSIBLE_PI = -15.0
IMPLAUSIBLE_MU = -1.0


def bucket(staleness: int) -> str:
    """The staleness bucket name of an episode ``staleness`` versions behind."""
    return BUCKETS[min(max(int(staleness), 0), len(BUCKETS) - 1)]


@dataclass
class TokenStats:
    """Running sums over model tokens of some episodes."""

    episodes: int = 0
    tokens: int = 0
    abs_sum: float = 0.0
    """Sum of ``|log pi - log mu|``."""
    diff_sum: float = 0.0
    """Sum of ``log pi - log mu`` (its sign says whether claims are over- or under-confident)."""
    implausible: int = 0

    @property
    def mean_abs(self) -> float:
        return self.abs_sum / self.tokens if self.tokens else 0.0

    def add(self, other: TokenStats) -> None:
        self.episodes += other.episodes
        self.tokens += other.tokens
        self.abs_sum += other.abs_sum
        self.diff_sum += other.diff_sum
        self.implausible += other.implausible


def episode_stats(trainer_logprobs: np.ndarray, ep: Episode) -> TokenStats:
    """Statistics of one episode's model tokens; ``trainer_logprobs`` is aligned with ``ep.tokens()``."""
    mask = ep.loss_mask()
    pi = np.asarray(trainer_logprobs, np.float64)[mask]
    mu = ep.behavior_logprobs().astype(np.float64)[mask]
    d = pi - mu
    return TokenStats(1, int(mask.sum()), float(np.abs(d).sum()), float(d.sum()),
                      int(((pi < IMPLAUSIBLE_PI) & (mu > IMPLAUSIBLE_MU)).sum()))


class LogprobAudit:
    """Per-worker statistics, the fleet's honest range, and the verdicts (see the module docstring)."""

    def __init__(self, config: AuditConfig = AuditConfig()):
        self.config = config
        self.floor: float | None = None
        self.workers: dict[str, dict[str, TokenStats]] = {}

    # -- calibration ------------------------------------------------------------------------------
    def calibrate(self, stats: Sequence[TokenStats]) -> float:
        """Set the floor from int8 episodes scored by the float learner at the same version."""
        per_episode = [s.mean_abs for s in stats if s.tokens]
        self.floor = float(np.quantile(per_episode, 0.99)) if per_episode else 0.0
        self.floor = max(self.floor, 1e-3)  # an exact match still leaves float noise
        return self.floor

    # -- statistics -------------------------------------------------------------------------------
    def observe(self, worker: str, staleness: int, stats: TokenStats) -> None:
        self.workers.setdefault(worker, {}).setdefault(bucket(staleness), TokenStats()).add(stats)

    def forget(self, worker: str) -> None:
        """Drop a worker's statistics (a banned worker must not shape the honest range)."""
        self.workers.pop(worker, None)

    def fleet(self, b: str, exclude: str | None = None) -> tuple[float, float] | None:
        """(median, MAD) across workers with enough tokens in bucket ``b``, or None."""
        means = [s[b].mean_abs for w, s in self.workers.items()
                 if w != exclude and b in s and s[b].tokens >= self.config.min_tokens]
        if not means:
            return None
        med = float(np.median(means))
        return med, float(np.median(np.abs(np.array(means) - med)))

    def reference(self, b: str) -> float:
        """The honest per-token mean |log pi - log mu| of bucket ``b``."""
        floor = self.floor if self.floor is not None else 0.05
        f = self.fleet(b)
        if f is not None:
            return max(f[0], floor)
        return floor * (1 + BUCKETS.index(b))  # staleness adds policy change on top of int8 rounding

    def episode_verdict(self, staleness: int, stats: TokenStats) -> str | None:
        """Why one episode's log-probs look wrong, or None."""
        if stats.implausible:
            return f"{stats.implausible} implausible token(s) (log pi < {IMPLAUSIBLE_PI:g} where log mu > {IMPLAUSIBLE_MU:g})"
        ref = self.reference(bucket(staleness))
        if stats.tokens and stats.mean_abs > self.config.episode_factor * ref:
            return (f"mean |log pi - log mu| {stats.mean_abs:.3f} over {stats.tokens} tokens at staleness {staleness}, "
                    f"over {self.config.episode_factor:g}x the honest {ref:.3f}")
        return None

    def worker_verdict(self, worker: str, extra: tuple[int, Sequence[TokenStats]] | None = None) -> str | None:
        """Why a worker's running statistics (with ``extra = (staleness, new episodes' stats)``
        counted in) leave the fleet's honest range, or None."""
        floor = self.floor if self.floor is not None else 0.05
        mine = {b: TokenStats(**asdict(s)) for b, s in self.workers.get(worker, {}).items()}
        if extra is not None:
            for st in extra[1]:
                mine.setdefault(bucket(extra[0]), TokenStats()).add(st)
        for b, s in sorted(mine.items()):
            if s.tokens < self.config.min_tokens:
                continue
            f = self.fleet(b, exclude=worker)
            med, mad = f if f is not None else (self.reference(b), 0.0)
            limit = med + self.config.worker_mads * max(mad, floor)
            if s.mean_abs > limit:
                return (f"running mean |log pi - log mu| {s.mean_abs:.3f} at staleness {b} leaves the fleet's honest "
                        f"range (median {med:.3f}, limit {limit:.3f})")
        return None

    # -- state ------------------------------------------------------------------------------------
    def summary(self, worker: str) -> dict[str, float]:
        """Per-bucket mean |log pi - log mu| and implausible tokens of one worker (for reports)."""
        out: dict[str, float] = {}
        for b, s in sorted(self.workers.get(worker, {}).items()):
            out[f"abs_s{b}"] = round(s.mean_abs, 5)
            out[f"tokens_s{b}"] = s.tokens
            if s.implausible:
                out[f"implausible_s{b}"] = s.implausible
        return out

    def state(self) -> dict:
        return {"floor": self.floor,
                "workers": {w: {b: asdict(s) for b, s in bs.items()} for w, bs in self.workers.items()}}

    def restore(self, state: dict) -> None:
        floor = state.get("floor")
        if floor is not None and not (isinstance(floor, (int, float)) and math.isfinite(floor)):
            raise ValueError("audit state: floor must be a finite number or null")
        self.floor = None if floor is None else float(floor)
        self.workers = {w: {b: TokenStats(**s) for b, s in bs.items() if b in BUCKETS}
                        for w, bs in state.get("workers", {}).items()}


@dataclass(frozen=True)
class SpotCheck:
    """The outcome of re-scoring some episodes with the int8 engine at their claimed version."""

    episodes: int
    failed: int
    """Episodes with more than ``spot_check_max_frac`` of their model tokens mismatching."""
    worst: float
    """Largest |int8 re-score - claimed log mu| over all model tokens (nats)."""
    detail: str

    @property
    def confirmed(self) -> bool:
        return self.failed > 0


def compare_logprobs(episodes: Sequence[Episode], scored: Sequence[tuple[np.ndarray, np.ndarray]],
                     config: AuditConfig = AuditConfig()) -> SpotCheck:
    """Compare each episode's claimed log mu with the int8 re-score at its claimed version,
    token by token: ``scored[i] = (positions, log-probs)`` at model-token positions of
    ``episodes[i].tokens()``.

    With ``top_p < 1`` the claimed log mu is of the renormalized nucleus (never below the full
    softmax's), so only claims *below* the re-score count as mismatches there.
    """
    eps = list(episodes)
    failed, worst, notes = 0, 0.0, []
    for ep, (at, lp) in zip(eps, scored):
        d = ep.behavior_logprobs()[at].astype(np.float64) - np.asarray(lp, np.float64)
        if ep.top_p < 1.0:
            d = np.minimum(d, 0.0)
        bad = np.abs(d) > config.spot_check_tolerance
        worst = max(worst, float(np.abs(d).max()) if d.size else 0.0)
        if d.size and bad.mean() > config.spot_check_max_frac:
            failed += 1
            if len(notes) < 2:
                notes.append(f"group {ep.group_id[:40]!r} sample {ep.sample_index}: {int(bad.sum())} of {d.size} "
                             f"tokens differ by more than {config.spot_check_tolerance:g} (mean "
                             f"{float(np.abs(d).mean()):.3f})")
    detail = (f"{failed} of {len(eps)} episodes re-scored with the int8 policy at their claimed version do not match "
              f"their log mu; " + "; ".join(notes)) if failed else f"{len(eps)} episodes re-scored: all match"
    return SpotCheck(len(eps), failed, worst, detail)


def spot_check(score: Callable[[list[Episode]], list[np.ndarray]], episodes: Sequence[Episode],
               config: AuditConfig = AuditConfig()) -> SpotCheck:
    """:func:`compare_logprobs` with ``score(episodes)`` (the int8 engine's prefill log-probs at
    the claimed version, aligned with ``tokens()``) at every model token."""
    eps = list(episodes)
    at = [np.flatnonzero(ep.loss_mask()) for ep in eps]
    return compare_logprobs(eps, [(a, np.asarray(lp)[a]) for a, lp in zip(at, score(eps))], config)
