"""The trust room's config sections: ``[trust]`` and ``[trust.audit]`` (``docs/trust.md``).

Leaves: frozen dataclasses that check their own bounds (a bad value is a
:class:`~stoa.fleet.sections.ConfigError` naming the key) and import nothing that runs. The gate
(:mod:`.gate`) and the checks (:mod:`.review`, :mod:`.audit`) read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from stoa.fleet.sections import check

__all__ = ["AuditConfig", "TrustConfig"]


@dataclass(frozen=True)
class AuditConfig:
    """The log-prob audit: how much is scored, what is suspicious, when a spot-check confirms
    (``[trust.audit]`` of the run config)."""

    enabled: bool = True
    """Score a sample of every batch with the learner, keep per-worker log-prob statistics, and
    spot-check suspicious workers with the int8 engine; a confirmed mismatch bans the worker."""
    fraction: float = 0.25
    """Fraction of each batch's episodes the audit scores (at least one)."""
    spot_check_episodes: int = 4
    """Episodes of a suspicious batch re-scored by the int8 engine."""
    random_spot_check: float = 0.02
    """Probability that an unsuspicious batch is spot-checked anyway."""
    episode_factor: float = 8.0
    """An episode is suspicious above this many times its staleness bucket's honest mean |log pi - log mu|."""
    worker_mads: float = 6.0
    """A worker is suspicious this many MADs (floored at the int8 calibration) above the fleet median."""
    min_tokens: int = 200
    """Audited tokens a worker needs in a staleness bucket before its running mean counts."""
    spot_check_tolerance: float = 0.1
    """A token mismatches when the int8 re-score and the claimed log mu differ by more (nats)."""
    spot_check_max_frac: float = 0.0
    """An episode fails the spot-check when more than this fraction of its model tokens mismatch.
    0 (the default): one token off by more than the tolerance fails it, so no share of an
    episode's tokens can carry a forged log-prob. Honest re-scores differ by about 1e-6 nat on one
    machine (int8 kernels against float32 ones, host against device sampler, any batch shape)."""

    every_episode: bool = True
    """With assigned work, check every episode of every batch: each sampled token re-derived from
    the assigned seed (``sampling_band``) and each claimed log mu compared with the int8 re-score
    (``spot_check_tolerance``), from one int8 forward pass per distinct row. Then the learner's
    audit and the spot-checks are not run (they only chose which episodes to re-score). False:
    the audit, spot-checks and ``sampling_episodes`` random episodes per batch."""
    sampling_episodes: int = 1
    """Without ``every_episode``: episodes of every batch (besides any that repeat another's
    tokens) whose every token is re-derived from the batch's assigned seed."""
    sampling_band: float = 0.02
    """In raw logits: a token beaten under the assigned noise by another kept token by more than
    this is one the sampling rule did not draw; within it, ambiguous (never punished). It
    tolerates a logit drift of half of it (any entry, after a common shift) between the worker's
    int8 stack and the trainer's re-score; measured honest drift: at most 7.6e-5 (see docs/trust.md)."""

    def __post_init__(self) -> None:
        check(self.sampling_episodes >= 0, "trust.audit.sampling_episodes must be >= 0")
        check(0 < self.sampling_band <= 10, "trust.audit.sampling_band must lie in (0, 10] (logits)")
        check(0 < self.fraction <= 1 and 0 <= self.random_spot_check <= 1,
              "trust.audit.fraction must lie in (0, 1] and trust.audit.random_spot_check in [0, 1]")
        check(self.spot_check_episodes >= 1 and self.min_tokens >= 1,
              "trust.audit.spot_check_episodes and trust.audit.min_tokens must be >= 1")
        check(self.episode_factor > 1 and self.worker_mads > 0 and self.spot_check_tolerance > 0
              and 0 <= self.spot_check_max_frac < 1,
              "trust.audit: episode_factor > 1, worker_mads > 0, spot_check_tolerance > 0 and "
              "0 <= spot_check_max_frac < 1")


@dataclass(frozen=True)
class TrustConfig:
    """Who may upload rollouts and how the trainer checks what they upload (``[trust]``; ``docs/trust.md``)."""

    mode: Literal["open", "enrolled"] = "open"
    """``open``: any worker key, bound to its worker id by its first accepted batch; ``enrolled``:
    only keys enrolled in the run's signed roster (``stoa enroll``)."""
    replay: bool = True
    """Replay every episode through the trainer's own environment before training on it (tasks
    that declare ``replayable``); a mismatch rejects the batch."""
    audit: AuditConfig = AuditConfig()
    """The log-prob audit and its spot-checks (``[trust.audit]``)."""
    ban_after: int = 2
    """Rejected batches from one key (replay, duplicate, invalid, ...) before it is banned; 0 = never."""
    max_worker_share: float = 1.0
    """Most of one optimizer step's groups that may come from one worker key (1.0 = no cap)."""
    max_hashes: int = 16384
    """Accepted batch and group hashes remembered to refuse copies (bounded memory, checkpointed;
    a copy older than ``trainer.max_lag`` versions is dropped as stale anyway)."""
    newcomers_per_poll: int = 4
    """Batches reviewed per poll from keys with no accepted work yet, one per key, chosen at random
    (the others wait, at most 64 per allowed batch); enrolled keys and keys with accepted work are
    never held back."""
    probation_batches: int = 1
    """Accepted probation batches (checked, never trained) a key makes before its assignment salt
    is published and its work can be trained; enrolled keys have their salt at once. Each key a
    grinder tries costs this many (``docs/trust.md``, key grinding); an honest newcomer pays it once."""
    idle_expiry_hours: float = 24.0
    """In an open run, a key bound by its work but with no accepted batch for this long loses its
    binding when the roster is full and a newcomer's accepted work needs the room."""
    reward_range: tuple[float, float] = (-1000.0, 1000.0)
    """Rewards a worker may report; a batch with one outside is quarantined (workers are strangers)."""

    def __post_init__(self) -> None:
        check(self.ban_after >= 0, "trust.ban_after must be >= 0")
        check(0 < self.max_worker_share <= 1, "trust.max_worker_share must lie in (0, 1]")
        check(self.max_hashes >= 1, "trust.max_hashes must be >= 1")
        check(self.newcomers_per_poll >= 1, "trust.newcomers_per_poll must be >= 1")
        check(self.probation_batches >= 1, "trust.probation_batches must be >= 1")
        check(self.idle_expiry_hours > 0, "trust.idle_expiry_hours must be > 0")
        lo, hi = self.reward_range
        check(math.isfinite(lo) and math.isfinite(hi) and lo <= hi and max(abs(lo), abs(hi)) < 1e30,
              "trust.reward_range must be two finite numbers lo <= hi (|x| < 1e30)")
