"""Run configuration: a TOML file resolved into frozen dataclasses, one per component.

A run config has a top-level ``name`` and ``seed`` and one table per component::

    name = "papersearch-tiny"
    seed = 0
    [model]      # which weights: a local HF folder, or a tiny model built for the task
    [model.tiny] # the tiny model's shape (stoa.models.tiny.TinyConfig)
    [env]        # gymnasium id and kwargs of the task
    [rollout]    # how workers sample (engine, group size, cohort size, temperature, caps)
    [trainer]    # batch, staleness gate, advantages, checkpoints, trust bounds
    [learner]    # backend and optimizer (stoa.backends.learner.LearnerConfig fields)
    [learner.megatron]  # kind = "megatron": parallel sizes, attention, collective timeout
    [objective]  # kind = a stoa.algos objective, plus that objective's Config fields
    [warmstart]  # optional supervised steps on scripted demonstrations before RL
    [pulse]      # weight channel (anchors, dtype)
    [eval]       # held-out evaluation
    [fleet]      # the local launcher (`stoa train`): how many workers
    [trust]      # which worker keys may upload, and how their episodes are verified
    [trust.audit]  # the log-prob audit and its spot-checks (stoa.fleet.trust.audit.AuditConfig)

Every section is typed and checked when the file is read: an unknown key, a value of the wrong
type or out of range is a :class:`ConfigError` naming the key's path (a typo must not surface
minutes later, after the warm start). ``[objective]`` is resolved at load into one
:class:`stoa.algos.Objective` (its config and its loss function together). The resolved config
is written as JSON beside the run (``<run>/config.json`` in the store) and read back by workers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stoa.algos import Objective
from stoa.backends.learner import LearnerConfig
from stoa.backends.megatron.options import MegatronOptions
from stoa.fleet.trust.gate import TrustConfig
from stoa.models.tiny import TinyConfig

__all__ = [
    "ConfigError", "EnvConfig", "EvalConfig", "FleetConfig", "LearnerSection", "ModelConfig", "PulseConfig",
    "RolloutConfig", "RunConfig", "TrainerConfig", "TrustConfig", "UnresolvedObjective", "WarmstartConfig",
    "check_runnable", "import_env_module", "load_config",
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
    """A local Hugging Face folder (config.json + safetensors + tokenizer). Empty: build a tiny model
    whose tokenizer is trained on the task's ``tokenizer_texts()``."""
    tiny: TinyConfig = TinyConfig()
    """Shape of the tiny model (used when ``path`` is empty); its ``seed`` is the run's seed."""


@dataclass(frozen=True)
class EnvConfig:
    """The task."""

    id: str = "stoa/SyntheticSearch-v0"
    """gymnasium id of a registered ``stoa`` text environment."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``gymnasium.make`` shared by train and eval (the task validates them)."""
    module: str = ""
    """Imported before the env is made, on the trainer and on every worker, so that it can register
    ``id``: a module name, or a ``.py`` file path (a relative one is read from the config file's
    folder and recorded absolute). For one machine; a fleet installs the env as a package."""
    package: str = ""
    """``"name==version"`` of the installed package that declares ``id`` (entry-point group
    ``stoa.envs``): filled in when the config is loaded, checked where it is written, and a worker
    with another version refuses the run. Empty for ids not from a package."""
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
    engine: str = "mlx"
    """Rollout engine backend (``stoa.backends.engine.BACKENDS``)."""
    engine_mode: Literal["auto", "quantized", "dequantized"] = "auto"
    """Engine compute mode (for MLX, see ``stoa.backends.mlx``)."""
    poll_seconds: float = 0.5
    """How often an idle worker checks the version pointer."""
    lag: int = 0
    """Forced staleness for studies: workers generate with the version ``lag`` behind the head
    (reached through the same verified chain); 0 = the newest version, as a fleet normally runs."""

    def __post_init__(self) -> None:
        _check(self.group_size >= 2, "rollout.group_size must be >= 2 (group advantages need a group)")
        _check(self.groups_per_cohort >= 1, "rollout.groups_per_cohort must be >= 1")
        _check(self.cohorts_per_version >= 0 and self.max_outstanding >= 0,
               "rollout.cohorts_per_version and max_outstanding must be >= 0 (0 = no limit)")
        _check(self.temperature > 0 and 0 < self.top_p <= 1, "rollout.temperature > 0 and 0 < top_p <= 1")
        _check(0 < self.max_turn_tokens <= self.max_episode_tokens, "0 < rollout.max_turn_tokens <= max_episode_tokens")
        _check(self.max_batch >= 1 and self.poll_seconds > 0, "rollout.max_batch >= 1 and poll_seconds > 0")
        _check(self.lag >= 0, "rollout.lag must be >= 0")
        from stoa.backends.engine import BACKENDS

        _check(self.engine in BACKENDS, f"rollout.engine {self.engine!r} is not one of {sorted(BACKENDS)}")


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer turns episodes into optimizer steps."""

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
    checkpoint_every: int = 25
    """Save a full training checkpoint every this many steps (and at the end)."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    poll_seconds: float = 0.2
    """How often the trainer lists new rollouts while waiting."""
    mismatch_every: int = 0
    """Every this many steps, split the behaviour/trainer mismatch into its int8 and staleness parts
    (``stoa.fleet.mismatch``: one extra int8 prefill and one float scoring pass); 0 = never."""
    int8_scorer: Literal["auto", "engine", "torch"] = "auto"
    """What re-scores episodes under a version's int8 weights (spot-checks, sampling checks, the
    mismatch split): ``engine`` (the rollout engine, on the host), ``torch`` (the int8 state
    dequantized into a torch model on the learner's device), ``auto`` (torch when the learner
    runs on CUDA, else the engine). Evaluation always runs on the engine."""

    def __post_init__(self) -> None:
        _check(self.steps >= 0 and self.groups_per_step >= 1, "trainer.steps >= 0 and groups_per_step >= 1")
        _check(self.mismatch_every >= 0, "trainer.mismatch_every must be >= 0")
        _check(self.max_lag >= 0, "trainer.max_lag must be >= 0")
        _check(self.checkpoint_every >= 1 and self.threads >= 0, "trainer.checkpoint_every >= 1, threads >= 0")


@dataclass(frozen=True)
class LearnerSection:
    """The learner: a backend and its optimizer settings (``seed`` is always the run's seed)."""

    kind: Literal["torch", "megatron"] = "torch"
    """Learner backend (``stoa.backends.learner.BACKENDS``)."""
    config: LearnerConfig = LearnerConfig()
    """Every other key of ``[learner]``: ``stoa.backends.learner.LearnerConfig`` fields."""
    megatron: MegatronOptions = MegatronOptions()
    """``[learner.megatron]``: the Megatron learner's parallel layout and timeout
    (``stoa.backends.megatron.options.MegatronOptions``); only with ``kind = "megatron"``."""

    def __post_init__(self) -> None:
        _check(self.kind == "megatron" or self.megatron == MegatronOptions(),
               f"[learner.megatron] is set but learner.kind is {self.kind!r}; set learner.kind = \"megatron\"")


@dataclass(frozen=True)
class UnresolvedObjective:
    """An ``[objective]`` table read without importing its code (what workers hold: they never run
    the objective, and a custom ``module:function`` need not exist on their machines)."""

    kind: str
    options: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.options}


@dataclass(frozen=True)
class WarmstartConfig:
    """Supervised steps on the task's scripted demonstrations, so RL starts from a realistic policy.

    Two phases, both built from the environment's hooks (``demonstration_turns``, ``practice_kwargs``).
    *Practice* (``practice_steps``): ``practice_style`` demonstrations in sibling tasks (so no item
    of this run's task is seen); for the search tasks they search and answer from the retrieved
    text, teaching the protocol and how to read (a base model's general skill). *Habit*
    (``steps``): demonstrations of this run's task in the styles of ``mix`` (weights), plus
    ``practice_answer_only`` practice demonstrations per batch trained on their last turn only
    (earlier turns are context), so the skill is kept without teaching the rest. For the demo:
    ``mix = {oracle = 0.22, guess = 0.78}``: RL starts from a policy that rarely searches.
    """

    practice_steps: int = 0
    """Supervised steps of practice in sibling tasks (0 = none)."""
    practice_worlds: int = 16
    """Sibling tasks (``env.practice_kwargs(1..N)``) the practice draws from."""
    practice_style: str = "oracle"
    """Demonstration style of the practice (and of the held-out check)."""
    steps: int = 0
    """Supervised steps in this run's task with the ``mix`` of styles (0 = none)."""
    mix: dict[str, float] = field(default_factory=lambda: {"oracle": 1.0})
    """Demonstration style -> weight, for the habit steps (styles the env lists in ``demo_styles``)."""
    practice_answer_only: int = 0
    """Practice demonstrations added to each habit batch with only their last turn trained."""
    batch_size: int = 64
    """Demonstrations per step."""
    lr: float = 2e-3
    """Learning rate of the warm start (AdamW, its own optimizer state)."""
    check_every: int = 0
    """Report p(last turn) of held-out practice-style demonstrations every this many steps (0 = at the end)."""
    threads: int = 0
    """torch CPU threads during the warm start (workers are idle then); 0 = the trainer's setting."""

    def __post_init__(self) -> None:
        _check(self.steps >= 0 and self.batch_size >= 1, "warmstart.steps >= 0 and batch_size >= 1")
        _check(self.practice_steps >= 0 and self.practice_worlds >= 1 and self.threads >= 0
               and self.practice_answer_only >= 0,
               "warmstart.practice_steps >= 0, practice_worlds >= 1, threads >= 0, practice_answer_only >= 0")
        _check(bool(self.mix) and all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v >= 0 for k, v in self.mix.items())
               and sum(self.mix.values()) > 0, "warmstart.mix must map style names to weights >= 0 (sum > 0)")
        _check(math.isfinite(self.lr) and self.lr > 0 and self.check_every >= 0, "warmstart.lr > 0 and check_every >= 0")


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
    learner: LearnerSection = LearnerSection()
    objective: Objective | UnresolvedObjective | None = None
    """The resolved :class:`stoa.algos.Objective` (``[objective]``; default: DPPO with its defaults),
    or an :class:`UnresolvedObjective` when read with ``resolve_objective=False``."""
    warmstart: WarmstartConfig = WarmstartConfig()
    pulse: PulseConfig = PulseConfig()
    eval: EvalConfig = EvalConfig()
    fleet: FleetConfig = FleetConfig()
    trust: TrustConfig = TrustConfig()

    def __post_init__(self) -> None:
        _check(bool(self.name) and all(c.isalnum() or c in "-_." for c in self.name) and self.name[0] != ".",
               f"name {self.name!r} must be non-empty and use only letters, digits, '-', '_', '.'")
        if self.objective is None:
            object.__setattr__(self, "objective", _resolve_objective({"kind": "dppo"}))
        _check(self.trainer.max_lag >= self.rollout.lag,
               f"trainer.max_lag ({self.trainer.max_lag}) must be >= rollout.lag ({self.rollout.lag}), "
               "or the staleness gate drops every forced-stale episode")

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, resolve_objective: bool = True) -> RunConfig:
        """Build and check a config from plain data (TOML or the JSON of :meth:`to_json`).

        ``resolve_objective=False`` keeps ``[objective]`` as an :class:`UnresolvedObjective`
        (no import of objective code): for workers, which never run it."""
        if not isinstance(data, dict):
            raise ConfigError("config must be a table")
        data = dict(data)
        table = data.pop("objective", {"kind": "dppo"})
        if not isinstance(table, dict):
            raise ConfigError("[objective] must be a table")
        if resolve_objective:
            objective = _resolve_objective(table)
        else:
            kind = table.get("kind", "dppo")
            _check(isinstance(kind, str), "objective.kind must be a string")
            objective = UnresolvedObjective(kind, {k: v for k, v in table.items() if k != "kind"})
        return _build(cls, {**data, "objective": objective}, "")


def _resolve_objective(table: dict[str, Any]) -> Any:
    from stoa.algos import resolve_objective

    options = dict(table)
    kind = options.pop("kind", "dppo")
    if not isinstance(kind, str):
        raise ConfigError(f"objective.kind must be a string, got {type(kind).__name__}")
    try:
        return resolve_objective(kind, options, where="objective")
    except (ValueError, TypeError, ImportError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("objective") else f"objective: {msg}") from None


def _to_plain(value: Any) -> Any:
    if isinstance(value, (Objective, UnresolvedObjective)):
        return value.to_dict()
    if isinstance(value, LearnerSection):
        return {"kind": value.kind, **_to_plain(value.config), "megatron": _to_plain(value.megatron)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _type_problem(value: Any, hint: Any) -> str | None:
    """Why ``value`` does not fit the annotation ``hint`` (the few shapes configs use), or None."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if origin is Literal:
        return None if value in args else f"must be one of {list(args)}, got {value!r}"
    if origin in (typing.Union, types.UnionType):
        return None if any(_type_problem(value, a) is None for a in args) else f"has the wrong type ({type(value).__name__})"
    if hint is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"must be an integer, got {value!r}"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else f"must be a finite number, got {value!r}"
    if hint is str:
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return f"must be a list of {len(args)} values, got {value!r}"
        for v, a in zip(value, args):
            why = _type_problem(v, a)
            if why:
                return why
        return None
    if origin is dict:
        if not isinstance(value, dict):
            return f"must be a table, got {value!r}"
        for k, v in value.items():
            why = _type_problem(k, args[0]) or _type_problem(v, args[1])
            if why:
                return f"entry {k!r} {why}"
        return None
    return None


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a table")
    if cls is LearnerSection:
        data = dict(data)
        kind = data.pop("kind", "torch")
        megatron = data.pop("megatron", {})
        return LearnerSection(kind=_build_value(LearnerSection, "kind", kind, where),
                              config=_build(LearnerConfig, data, where),
                              megatron=_build(MegatronOptions, megatron, f"[{where.strip('[]')}.megatron]"))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        section = where.strip("[]")
        path = ", ".join(f"{section}.{k}" if section else k for k in unknown)
        raise ConfigError(f"unknown key(s) {path} in {where or 'the top level'}; valid: {', '.join(sorted(fields))}")
    kwargs = {name: _build_value(cls, name, value, where) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{where.strip('[]') or 'config'}] {e}") from None


def _build_value(cls: type, name: str, value: Any, where: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    path = f"{where.strip('[]')}.{name}" if where else name
    default = f.default if f.default is not dataclasses.MISSING else None
    if dataclasses.is_dataclass(default) and not isinstance(value, type(default)):
        return _build(type(default), value, f"[{path}]")
    hint = typing.get_type_hints(cls).get(name, Any)
    if isinstance(value, list) and typing.get_origin(hint) is tuple:
        value = tuple(value)
    why = None if dataclasses.is_dataclass(value) else _type_problem(value, hint)
    if why:
        raise ConfigError(f"{path} {why}")
    return value


def import_env_module(env: EnvConfig) -> None:
    """Make ``env.id`` available: check that the installed package is the version the run names
    (``env.package``), then import ``env.module`` (a module name or a ``.py`` path), which
    registers the id.

    Raises:
        ConfigError: the package is missing or another version, or the module is not there.
    """
    from stoa.plugins import import_module_or_file, installed_env

    if env.package:
        found = installed_env(env.id)
        if found is None or found.requirement != env.package:
            have = f"this machine has {found.requirement}" if found else "it is not installed here"
            raise ConfigError(f"env {env.id!r} of this run comes from the package {env.package}, {have}: "
                              f"pip install {env.package!r}")
    spec = env.module
    if not spec:
        return
    try:
        import_module_or_file(spec)
    except ModuleNotFoundError as e:
        if spec.endswith(".py") and e.name == spec:
            raise ConfigError(f"env.module {spec!r}: no such file (a relative path in a config file is read "
                              "from the file's folder, one given with --set from the working directory)") from None
        if e.name and spec.startswith(e.name):
            raise ConfigError(f"env.module {spec!r}: no module named {e.name!r} (install its package, "
                              "or give a .py file)") from None
        raise


def check_runnable(cfg: RunConfig) -> None:
    """What ``stoa train --check`` verifies beyond the config's own types and bounds: ``env.module``
    imports, ``env.id`` is registered, and ``model.path`` (if set) is a Hugging Face folder whose
    config every stack reads alike and ``learner.kind`` builds (:func:`stoa.models.hfconfig.check_learner`).

    Raises:
        ConfigError: naming the key and what to set.
    """
    import difflib

    import_env_module(cfg.env)
    import gymnasium

    import stoa.envs  # noqa: F401 - registers the built-in ids

    if cfg.env.id not in gymnasium.registry:
        known = sorted(k for k, spec in gymnasium.registry.items()  # gymnasium's own ids are no text envs
                       if "/" in k and not str(spec.entry_point).startswith("gymnasium."))
        close = difflib.get_close_matches(cfg.env.id, known, 1)
        raise ConfigError(f"env.id {cfg.env.id!r} is not registered" + (f": did you mean {close[0]!r}?" if close else ".")
                          + " Set env.module to the module (or .py file) that registers it, or install the "
                          "package that declares it; known ids: " + ", ".join(known))
    if cfg.model.path and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        raise ConfigError(f"model.path {cfg.model.path!r} is not a Hugging Face folder (no config.json): "
                          "give a local folder with config.json, safetensors and tokenizer, or leave it "
                          "empty for a tiny model")
    if cfg.model.path:
        from stoa.models.hfconfig import ModelConfigError, check_learner, load

        try:
            check_learner(load(Path(cfg.model.path).expanduser()), cfg.learner.kind)
        except ModelConfigError as e:
            raise ConfigError(f"model.path {cfg.model.path!r} cannot be run: {e}") from None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a TOML run config; ``overrides`` maps dotted keys (``"trainer.steps"``) to values.

    A relative ``.py`` path in ``env.module`` or ``objective.kind`` (``"my_obj.py:loss"``) is made
    absolute against the config file's folder (one given in ``overrides``, against the working
    directory). ``env.package`` is filled in from the installed package that declares ``env.id``."""
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
            if not isinstance(node, dict):
                raise ConfigError(f"--set {dotted}: {p} is not a table")
        node[leaf] = value
    here = Path(path).resolve().parent
    env = data.get("env")
    if isinstance(env, dict):
        # A file named in the config is read beside the config; one given with --set, from here.
        if "module" in env:
            env["module"] = _beside(env["module"], Path.cwd() if "env.module" in (overrides or {}) else here)
        _record_package(env)
    objective = data.get("objective")
    if isinstance(objective, dict) and isinstance(objective.get("kind"), str):
        file, sep, fn = objective["kind"].rpartition(":")
        if sep and file.endswith(".py"):
            given = "objective" in (overrides or {}) or "objective.kind" in (overrides or {})
            objective["kind"] = f"{_beside(file, Path.cwd() if given else here)}:{fn}"
    return RunConfig.from_dict(data)


def _beside(spec: Any, base: Path) -> Any:
    """A relative ``.py`` path made absolute against ``base``; anything else unchanged."""
    if isinstance(spec, str) and spec.endswith(".py") and not Path(spec).expanduser().is_absolute():
        return str((base / spec).resolve())
    return spec


def _record_package(env: dict[str, Any]) -> None:
    """Fill ``env.package`` from the installed package that declares ``env.id`` (or check it)."""
    from stoa.plugins import installed_env

    env_id = env.get("id", EnvConfig.id)
    found = installed_env(env_id) if isinstance(env_id, str) else None
    if found is None or env.get("module"):
        return
    if not env.get("package"):
        env["package"] = found.requirement
    elif env["package"] != found.requirement:
        raise ConfigError(f"env.package is {env['package']!r} but this machine has {found.requirement} "
                          f"for {env_id!r}: pip install {env['package']!r}, or update env.package")
