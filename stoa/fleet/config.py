"""Run configuration: a TOML file resolved into frozen dataclasses, one per component.

A run config has a top-level ``name`` and ``seed`` and one table per component; each table's
dataclass is a leaf in the ``section`` module of the room that uses it, and this module
assembles them::

    name = "papersearch-tiny"
    seed = 0
    [model]      # which weights: a local HF folder, or a tiny model (stoa.fleet.trainer.section.ModelConfig)
    [model.tiny] # the tiny model's shape (stoa.models.tiny.TinyConfig)
    [env]        # gymnasium id and kwargs of the task (stoa.fleet.task.EnvConfig)
    [rollout]    # how workers sample: engine, group and cohort size, temperature, caps
                 # (stoa.fleet.worker.section.RolloutConfig)
    [trainer]    # batch, staleness gate, advantages, checkpoints (stoa.fleet.trainer.section.TrainerConfig)
    [learner]    # backend and optimizer (stoa.backends.learner.LearnerConfig fields)
    [learner.megatron]  # kind = "megatron": parallel sizes, attention, collective timeout
                        # (stoa.backends.megatron.options.MegatronOptions)
    [objective]  # kind = a stoa.algos objective, plus that objective's Config fields
    [warmstart]  # optional supervised steps on scripted demonstrations before RL
                 # (stoa.fleet.trainer.section.WarmstartConfig)
    [pulse]      # weight channel: anchors, export dtype (stoa.fleet.trainer.section.PulseConfig)
    [eval]       # held-out evaluation (stoa.fleet.trainer.section.EvalConfig)
    [outer]      # several trainers of one run, DiLoCo-style outer steps (stoa.fleet.outer.section.OuterConfig)
    [fleet]      # the local launcher (`stoa train`): how many workers (stoa.fleet.operator.section.FleetConfig)
    [trust]      # which worker keys may upload, how their episodes are verified, the reward
                 # range they may report (stoa.fleet.trust.section.TrustConfig)
    [trust.audit]  # the check of every episode: draws and log-probs (stoa.fleet.trust.section.AuditConfig)

Every section is typed and checked when the file is read: an unknown key, a value of the wrong
type or out of range is a :class:`ConfigError` naming the key's path (a typo must not surface
minutes later, after the warm start). ``[objective]`` is resolved at load into one
:class:`stoa.algos.Objective` (its config and its loss function together). The resolved config
is written as JSON beside the run (``<run>/config.json`` in the store) and read back by workers.

Reading a config imports no runtime module: the sections are leaves, and the runtime (the
trainer, the worker, the intake, the trust checks) imports this module, never the reverse.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stoa.algos import Objective
from stoa.backends.learner import LearnerConfig
from stoa.backends.megatron.options import MegatronOptions
from stoa.fleet.operator.section import FleetConfig
from stoa.fleet.outer.section import OuterConfig
from stoa.fleet.sections import ConfigError, check
from stoa.fleet.task import EnvConfig, import_env_module
from stoa.fleet.trainer.section import EvalConfig, ModelConfig, PulseConfig, TrainerConfig, WarmstartConfig
from stoa.fleet.trust.section import AuditConfig, TrustConfig
from stoa.fleet.worker.section import RolloutConfig

__all__ = [
    "AuditConfig", "ConfigError", "EnvConfig", "EvalConfig", "FleetConfig", "LearnerSection", "ModelConfig", "OuterConfig",
    "PulseConfig",
    "RolloutConfig", "RunConfig", "TrainerConfig", "TrustConfig", "UnresolvedObjective", "WarmstartConfig",
    "check_runnable", "import_env_module", "load_config",
]


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
        check(self.kind == "megatron" or self.megatron == MegatronOptions(),
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
    outer: OuterConfig = OuterConfig()

    def __post_init__(self) -> None:
        check(bool(self.name) and all(c.isalnum() or c in "-_." for c in self.name) and self.name[0] != ".",
               f"name {self.name!r} must be non-empty and use only letters, digits, '-', '_', '.'")
        if self.objective is None:
            object.__setattr__(self, "objective", _resolve_objective({"kind": "dppo"}))
        check(self.trainer.max_lag >= self.rollout.lag,
               f"trainer.max_lag ({self.trainer.max_lag}) must be >= rollout.lag ({self.rollout.lag}), "
               "or the staleness gate drops every forced-stale episode")
        check(not self.outer.active or self.learner.kind == "torch",
              "[outer] steps need learner.kind = \"torch\" (the megatron learner cannot load merged weights yet)")

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
            check(isinstance(kind, str), "objective.kind must be a string")
            objective = UnresolvedObjective(kind, {k: v for k, v in table.items() if k != "kind"})
        return _build(cls, {**data, "objective": objective}, "")


MOVED = {"trainer.reward_range": "trust.reward_range"}
"""Keys that moved to another section: the old place is refused with the new one named."""


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
        moved = [f"{section}.{k} is now {MOVED[f'{section}.{k}']}" for k in unknown if f"{section}.{k}" in MOVED]
        if moved:
            raise ConfigError(f"{'; '.join(moved)} (the key moved to the section that uses it)")
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


def check_runnable(cfg: RunConfig) -> str:
    """What ``stoa train --check`` verifies beyond the config's own types and bounds: ``env.module``
    imports, ``env.id`` is registered (an id of a family, ``stoa.envs.ID_PREFIXES``, is also made
    with ``env.kwargs``, so that a task the family refuses is refused here), ``model.path`` (if
    set) is a Hugging Face folder whose config every stack reads alike and ``learner.kind`` builds
    (:func:`stoa.models.hfconfig.check_learner`), and its tokenizer can build prompts in
    ``model.prompt_format``.

    Returns:
        One line naming the prompt format the run will use (``stoa.backends.prompting.describe``).

    Raises:
        ConfigError: naming the key and what to set.
    """
    import difflib

    import_env_module(cfg.env)
    import gymnasium

    import stoa.envs  # registers the built-in ids

    try:
        registered = stoa.envs.resolve(cfg.env.id)
    except ValueError as e:
        raise ConfigError(f"env.id: {e}") from None
    if registered and stoa.envs.family(cfg.env.id) is not None:  # a family's env refuses its kwargs when made
        try:
            stoa.envs.make(cfg.env.id, **cfg.env.kwargs).close()
        except ValueError as e:
            raise ConfigError(f"env: {e}") from None
    if not registered:
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
    return _check_prompt_format(cfg)


def _check_prompt_format(cfg: RunConfig) -> str:
    """``model.prompt_format`` resolved against the model's tokenizer (the tiny model's has a chat template)."""
    from stoa.backends import prompting

    fmt = cfg.model.prompt_format
    if not cfg.model.path:
        shown = "auto -> chat" if fmt == "auto" else fmt
        return f"prompt format: {shown} (the tiny model's tokenizer has a chat template)"
    path = Path(cfg.model.path).expanduser()
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return f"prompt format: {fmt} (not checked: model.path has no tokenizer files)"
    from transformers import AutoTokenizer

    try:
        return prompting.describe(fmt, AutoTokenizer.from_pretrained(str(path)))
    except prompting.PromptFormatError as e:
        raise ConfigError(f"model.prompt_format: {e}") from None


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
    """Fill ``env.package`` from the installed package that provides ``env.id`` (or check it)."""
    from stoa.envs import provider

    env_id = env.get("id", EnvConfig.id)
    found = provider(env_id) if isinstance(env_id, str) else None
    if found is None or env.get("module"):
        return
    if not env.get("package"):
        env["package"] = found.requirement
    elif env["package"] != found.requirement:
        raise ConfigError(f"env.package is {env['package']!r} but this machine has {found.requirement} "
                          f"for {env_id!r}: pip install {env['package']!r}, or update env.package")
