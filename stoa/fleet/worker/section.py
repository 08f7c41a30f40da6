"""The worker's config section: ``[rollout]``, how workers sample.

A leaf: a frozen dataclass that checks its own bounds and imports nothing that runs (the engine
registry and the sampling settings' type are read from :mod:`stoa.backends.engine` when used).
The trainer reads it too: its evaluation samples with :meth:`RolloutConfig.sampling`, and the
intake checks every batch against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from stoa.fleet.sections import check

if TYPE_CHECKING:
    from stoa.backends.engine import EngineConfig, SamplingConfig

__all__ = ["RolloutConfig"]


@dataclass(frozen=True)
class RolloutConfig:
    """How workers generate (``[rollout]``)."""

    group_size: int = 8
    """Samples per prompt (G); advantages are computed within a group."""
    groups_per_cohort: int = 8
    """Prompts per generation cohort (one upload); a cohort never spans a weight swap."""
    cohorts_per_version: int = 0
    """Cohorts a worker generates with one weight version before waiting for a newer one (0 = no limit)."""
    max_outstanding: int = 2
    """Batches a worker may have uploaded that the trainer has not taken yet; beyond that it waits
    (backpressure: bounds staleness and wasted work; 0 = no limit)."""
    temperature: float = 1.0
    """Sampling temperature; behaviour log-probs are recorded under it."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off, the default for training)."""
    max_turn_tokens: int = 32
    """Most tokens in one model turn."""
    max_episode_tokens: int = 1024
    """Most tokens in one episode (prompt included)."""
    max_batch: int = 128
    """Episodes in flight at once in the engine."""
    engine: str = "auto"
    """Rollout engine backend (``stoa.backends.engine.BACKENDS``), or ``auto``: MLX on Apple silicon,
    torch elsewhere (``stoa.backends.engine.resolve_backend``)."""
    engine_mode: Literal["auto", "int24", "int16", "quantized", "dequantized", "bfloat16"] = "auto"
    """Engine compute mode (MLX: ``quantized`` / ``dequantized``; torch: its int8 CPU kernel as
    ``int24`` (24-bit integer inputs; ``auto``'s choice on x86 CPUs with AVX-512 VNNI), ``quantized``
    (float32; ``auto`` on other CPUs) or ``int16``, ``dequantized`` (float32 weights; ``auto`` on
    GPUs) or ``bfloat16`` on GPUs; ``int16`` and ``bfloat16`` drift from the trainer's float32
    re-score: docs/rollout.md, docs/trust.md)."""
    poll_seconds: float = 0.5
    """How often an idle worker checks the version pointer."""
    lag: int = 0
    """Forced staleness for studies: workers generate with the version ``lag`` behind the head
    (reached through the same verified chain); 0 = the newest version, as a fleet normally runs."""

    def __post_init__(self) -> None:
        check(self.group_size >= 2, "rollout.group_size must be >= 2 (group advantages need a group)")
        check(self.groups_per_cohort >= 1, "rollout.groups_per_cohort must be >= 1")
        check(self.cohorts_per_version >= 0 and self.max_outstanding >= 0,
               "rollout.cohorts_per_version and max_outstanding must be >= 0 (0 = no limit)")
        check(self.temperature > 0 and 0 < self.top_p <= 1, "rollout.temperature > 0 and 0 < top_p <= 1")
        check(0 < self.max_turn_tokens <= self.max_episode_tokens, "0 < rollout.max_turn_tokens <= max_episode_tokens")
        check(self.max_batch >= 1 and self.poll_seconds > 0, "rollout.max_batch >= 1 and poll_seconds > 0")
        check(self.lag >= 0, "rollout.lag must be >= 0")
        from stoa.backends.engine import BACKENDS

        check(self.engine in BACKENDS or self.engine == "auto",
              f"rollout.engine {self.engine!r} is not one of {sorted(BACKENDS)} or auto")

    def engine_config(self, prompt_format: str = "auto") -> EngineConfig:
        """How an engine of this run batches and builds prompts (``prompt_format``: ``model.prompt_format``)."""
        from stoa.backends.engine import EngineConfig

        return EngineConfig(max_batch=self.max_batch, prompt_format=prompt_format)  # type: ignore[arg-type]

    def sampling(self, seed: int) -> SamplingConfig:
        """How a cohort samples: these settings and the seed its work was assigned."""
        from stoa.backends.engine import SamplingConfig

        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, max_turn_tokens=self.max_turn_tokens,
                              max_episode_tokens=self.max_episode_tokens, seed=seed)
