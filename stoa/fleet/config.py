"""Run configuration: a TOML file resolved into frozen dataclasses, one per component.

A run config has a top-level ``name`` and ``seed`` and one table per component::

    name = "papersearch-tiny"
    seed = 0
    [model]      # which weights: a local HF folder, or a tiny model built for the task
    [env]        # gymnasium id and kwargs of the task
    [rollout]    # how workers sample (group size, cohort size, temperature, caps)
    [trainer]    # learner, batch, staleness gate, objective and its settings
    [warmstart]  # optional supervised steps on scripted demonstrations before RL
    [pulse]      # weight channel (anchors, dtype)
    [eval]       # held-out evaluation
    [fleet]      # the local launcher (`stoa train`): how many workers

Unknown keys are errors (a typo must not silently fall back to a default). The resolved config is
written as JSON beside the run (``<run>/config.json`` in the store) and read back by workers.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ConfigError", "EnvConfig", "EvalConfig", "FleetConfig", "ModelConfig", "PulseConfig",
    "RolloutConfig", "RunConfig", "TrainerConfig", "WarmstartConfig", "load_config",
]


class ConfigError(ValueError):
    """The run configuration is invalid; the message names the key."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights the run starts from."""

    path: str = ""
    """A local Hugging Face folder (config.json + safetensors + tokenizer). Empty: build a tiny model."""
    tiny: dict[str, Any] = field(default_factory=dict)
    """``stoa.models.tiny.TinyConfig`` fields for the tiny model (used when ``path`` is empty)."""


@dataclass(frozen=True)
class EnvConfig:
    """The task."""

    id: str = "stoa/SyntheticSearch-v0"
    """gymnasium id of a registered ``stoa`` text environment."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``gymnasium.make`` shared by train and eval."""
    train_split: str = "train"
    """Split the workers draw prompts from."""
    eval_split: str = "test"
    """Held-out split for evaluation."""


@dataclass(frozen=True)
class RolloutConfig:
    """How workers generate."""

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
    engine_mode: Literal["auto", "quantized", "dequantized"] = "auto"
    """MLX compute mode (see ``stoa.backends.mlx``)."""
    poll_seconds: float = 0.5
    """How often an idle worker checks the version pointer."""

    def __post_init__(self) -> None:
        _check(self.group_size >= 2, "rollout.group_size must be >= 2 (group advantages need a group)")
        _check(self.groups_per_cohort >= 1, "rollout.groups_per_cohort must be >= 1")
        _check(self.cohorts_per_version >= 0 and self.max_outstanding >= 0,
               "rollout.cohorts_per_version and max_outstanding must be >= 0 (0 = no limit)")
        _check(self.temperature > 0 and 0 < self.top_p <= 1, "rollout.temperature > 0 and 0 < top_p <= 1")
        _check(0 < self.max_turn_tokens <= self.max_episode_tokens, "0 < rollout.max_turn_tokens <= max_episode_tokens")
        _check(self.max_batch >= 1 and self.poll_seconds > 0, "rollout.max_batch >= 1 and poll_seconds > 0")


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer turns episodes into optimizer steps."""

    learner: str = "torch"
    """Learner backend: ``"torch"`` or ``"megatron"``."""
    steps: int = 100
    """Optimizer steps of RL (each publishes one weight version)."""
    groups_per_step: int = 16
    """Prompt groups per optimizer step."""
    max_lag: int = 3
    """Staleness gate: episodes more than this many versions behind are dropped (and counted)."""
    advantage: Literal["grpo", "drgrpo", "rloo"] = "drgrpo"
    """Group advantage estimator (``stoa.algos.advantages``)."""
    skip_zero_variance_groups: bool = True
    """Leave out groups whose rewards are all equal (they carry no signal)."""
    objective: str = "dppo"
    """A built-in objective name (``stoa.algos.OBJECTIVES``) or ``"module:function"``."""
    objective_config: dict[str, Any] = field(default_factory=dict)
    """Overrides of the objective's ``Config`` fields."""
    learner_config: dict[str, Any] = field(default_factory=dict)
    """Overrides of ``stoa.backends.learner.LearnerConfig`` (lr, grad_clip, micro_batch_tokens, ...)."""
    checkpoint_every: int = 25
    """Save a full training checkpoint every this many steps (and at the end)."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    poll_seconds: float = 0.2
    """How often the trainer lists new rollouts while waiting."""

    def __post_init__(self) -> None:
        _check(self.steps >= 0 and self.groups_per_step >= 1, "trainer.steps >= 0 and groups_per_step >= 1")
        _check(self.max_lag >= 0, "trainer.max_lag must be >= 0")
        _check(self.checkpoint_every >= 1 and self.threads >= 0, "trainer.checkpoint_every >= 1, threads >= 0")


@dataclass(frozen=True)
class WarmstartConfig:
    """Supervised steps on scripted demonstrations, so RL starts from a policy that rarely searches.

    Two phases. *Reading practice* (``reading_steps``): demonstrations played in other worlds of
    the task (the environment with other corpus ``seed``s, so no fact of this run's world is
    seen) that search and answer from the retrieved text; they teach the protocol and how to read
    (a base model's general skill). *Habit* (``steps``): demonstrations in this run's world in which
    only ``search_fraction`` search; the rest answer at once with a random name, so the policy
    RL starts from rarely searches.
    """

    reading_steps: int = 0
    """Supervised steps of reading practice in other worlds (0 = none)."""
    reading_worlds: int = 16
    """Other worlds (corpus seeds ``env.kwargs.seed + 1 ...``) the reading practice draws from."""
    steps: int = 0
    """Supervised steps in this run's world with ``search_fraction`` searching (0 = none)."""
    batch_size: int = 64
    """Demonstrations per step."""
    search_fraction: float = 0.22
    """Fraction of this world's demonstrations that search and then answer from the retrieved text."""
    habit_reading_demos: int = 0
    """Other-world demonstrations added to each habit batch with only their answer trained (the
    search turn is context), so the reading skill is kept without teaching the decision to search."""
    lr: float = 2e-3
    """Learning rate of the warm start (AdamW, its own optimizer state)."""
    check_every: int = 0
    """Report accuracy-after-search on held-out demonstrations every this many steps (0 = only at the end)."""
    threads: int = 0
    """torch CPU threads during the warm start (workers are idle then); 0 = the trainer's setting."""

    def __post_init__(self) -> None:
        _check(self.steps >= 0 and self.batch_size >= 1, "warmstart.steps >= 0 and batch_size >= 1")
        _check(self.reading_steps >= 0 and self.reading_worlds >= 1 and self.threads >= 0
               and self.habit_reading_demos >= 0,
               "warmstart.reading_steps >= 0, reading_worlds >= 1, threads >= 0, habit_reading_demos >= 0")
        _check(0.0 <= self.search_fraction <= 1.0, "warmstart.search_fraction must lie in [0, 1]")
        _check(self.lr > 0 and self.check_every >= 0, "warmstart.lr > 0 and check_every >= 0")


@dataclass(frozen=True)
class PulseConfig:
    """The weight channel."""

    anchor_every: int = 50
    """A full anchor every this many versions (deltas in between)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the trainer exports before int8 quantization (scales/biases travel in it)."""

    def __post_init__(self) -> None:
        _check(self.anchor_every >= 1, "pulse.anchor_every must be >= 1")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation with the int8 policy the workers run."""

    every: int = 25
    """Evaluate every this many versions (and at the first and last)."""
    num_questions: int = 200
    """Held-out questions per evaluation."""
    samples: int = 4
    """Samples per question (pass@1 is their mean; pass@k uses all of them)."""

    def __post_init__(self) -> None:
        _check(self.every >= 1 and self.num_questions >= 1 and self.samples >= 1, "eval.every/num_questions/samples >= 1")


@dataclass(frozen=True)
class FleetConfig:
    """The local launcher."""

    workers: int = 2
    """Worker processes started by ``stoa train``."""
    worker_threads: int = 1
    """CPU threads per worker (MLX/OpenBLAS)."""

    def __post_init__(self) -> None:
        _check(self.workers >= 0 and self.worker_threads >= 1, "fleet.workers >= 0 and worker_threads >= 1")


@dataclass(frozen=True)
class RunConfig:
    """A whole run."""

    name: str = "run"
    """Run name: the store prefix and ``runs/<name>/`` locally."""
    seed: int = 0
    """Seed of everything seeded (model init, data, prompt streams, sampling)."""
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    pulse: PulseConfig = PulseConfig()
    eval: EvalConfig = EvalConfig()
    fleet: FleetConfig = FleetConfig()

    def __post_init__(self) -> None:
        _check(bool(self.name) and all(c.isalnum() or c in "-_." for c in self.name) and self.name[0] != ".",
               f"name {self.name!r} must be non-empty and use only letters, digits, '-', '_', '.'")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        return _build(cls, data, "")


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) in {where or 'the top level'}: {', '.join(unknown)}")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, f"[{name}]")
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where or 'config'}: {e}") from None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a TOML run config; ``overrides`` maps dotted keys (``"trainer.steps"``) to values."""
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return RunConfig.from_dict(data)
