"""Objectives by name, resolved once into one value: :class:`Objective` (config + loss function).

An objective is a module with a frozen dataclass ``Config`` and a function
``loss(inputs: ObjectiveInputs, config: Config) -> (loss, metrics)`` (see :mod:`stoa.algos.base`).
A run names it by a key of :data:`OBJECTIVES` or as ``"module:function"`` for custom code, with
that ``Config``'s fields as options; :func:`resolve_objective` checks the options (unknown keys,
wrong types, out-of-range values, each named by its key path) and returns an :class:`Objective`,
the one value the learners take. Its :meth:`Objective.to_dict` is the ``[objective]`` table of a
run config, so a resolved config can be written out and read back.

Resolving a built-in imports no torch: the objective modules import it when a loss first runs.
Objective names execute imports: take them only from the operator's own config, never from
anything read out of the object store.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Union

from stoa.plugins import import_module_or_file

if TYPE_CHECKING:
    from stoa.algos.base import ObjectiveInputs

__all__ = ["DEFAULT_OBJECTIVE", "LossFn", "OBJECTIVES", "Objective", "resolve_objective"]

LossFn = Callable[["ObjectiveInputs", Any], tuple[Any, dict[str, float]]]
"""``loss_fn(inputs, config) -> (scalar loss tensor, {metric: float})``."""

OBJECTIVES: dict[str, str] = {
    "dppo": "stoa.algos.dppo:loss",
    "ppo": "stoa.algos.ppo:loss",
    "tis": "stoa.algos.tis:loss",
    "icepop": "stoa.algos.icepop:loss",
    "reinforce": "stoa.algos.reinforce:loss",
    "gepo": "stoa.algos.gepo:loss",
}
"""Built-in objectives by name: ``name -> "module:function"``; the first, ``"dppo"``, is the default."""

DEFAULT_OBJECTIVE = "dppo"


@dataclass(frozen=True)
class Objective:
    """A resolved objective: which loss, with which hyper-parameters. Build it with
    :func:`resolve_objective` (from a config table) or directly from a ``Config`` instance::

        Objective("dppo", dppo.Config(gate="kl"))

    Attributes:
        name: a key of :data:`OBJECTIVES` or ``"module:function"``.
        config: an instance of exactly that objective module's ``Config`` class; any other type
            (e.g. DPPO's config under the name ``"ppo"``) is a :class:`TypeError` here.
        loss_fn: the loss function the name resolves to (set from ``name``, not passed in).

    Raises:
        ValueError: the name is neither a built-in nor an importable ``"module:function"``
            whose module defines a dataclass ``Config``.
        TypeError: ``config`` is not an instance of that ``Config``.
    """

    name: str
    config: Any
    loss_fn: LossFn = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        config_cls, fn = _lookup(self.name, "objective")
        if type(self.config) is not config_cls:
            raise TypeError(f"objective {self.name!r} takes a {_qualname(config_cls)}, "
                            f"got a {_qualname(type(self.config))}")
        object.__setattr__(self, "loss_fn", fn)

    def loss(self, inputs: ObjectiveInputs) -> tuple[Any, dict[str, float]]:
        """``loss_fn(inputs, config)``: the scalar loss tensor and the objective's metrics."""
        return self.loss_fn(inputs, self.config)

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": name, **config fields}``: plain data for JSON or TOML (tuples become lists).

        :meth:`from_dict` (or :func:`resolve_objective`) reads it back to an equal value.
        Floats may be ``inf`` (e.g. an uncapped ``ratio_cap``): TOML writes ``inf``, JSON needs
        ``allow_nan``.
        """
        values = {f.name: _plain(getattr(self.config, f.name)) for f in dataclasses.fields(self.config) if f.init}
        return {"kind": self.name, **values}

    @classmethod
    def from_dict(cls, table: Mapping[str, Any], where: str = "objective") -> Objective:
        """Resolve an ``[objective]`` table: ``kind`` (default ``"dppo"``) plus Config fields."""
        options = dict(table)
        return resolve_objective(options.pop("kind", DEFAULT_OBJECTIVE), options, where)


def resolve_objective(kind: str, options: Mapping[str, Any] | None = None, where: str = "objective") -> Objective:
    """Build the :class:`Objective` named ``kind`` with ``options`` as its ``Config`` fields.

    Args:
        kind: a key of :data:`OBJECTIVES` or ``"module:function"``.
        options: ``Config`` field values (e.g. the rest of a TOML ``[objective]`` table);
            omitted fields keep their defaults. Ints are accepted for float fields and lists for
            tuple fields.
        where: the key path of the table, used to name keys in error messages.

    Raises:
        ValueError: an unknown kind (``"<where>.kind: ..."``), an unknown option
            (``"<where>.<key>: unknown option of objective '<kind>'; valid: [...]"``), a value
            of the wrong type (``"<where>.<key>: expected float, got str ..."``) or one the
            ``Config`` rejects (its own message, prefixed with ``"<where>."`` when it starts
            with the field's name, e.g. ``"objective.ratio_cap must be >= 1, got 0.0"``, else
            with ``"<where>: "``).
    """
    config_cls, _ = _lookup(kind, where)
    options = {} if options is None else options
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}: options must be a table, got {type(options).__name__}")
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    unknown = sorted(str(k) for k in options if k not in fields)
    if unknown:
        keys = ", ".join(f"{where}.{k}" for k in unknown)
        raise ValueError(f"{keys}: unknown option{'s' if len(unknown) > 1 else ''} of objective {kind!r}; "
                         f"valid: {sorted(fields)}")
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: the Config's own checks decide
        hints = {}
    values = {k: _coerce(f"{where}.{k}", v, hints.get(k, Any)) for k, v in options.items()}
    try:
        config = config_cls(**values)
    except (TypeError, ValueError) as e:
        msg = str(e)
        # Config checks name their field first ("ratio_cap must be >= 1"): make that a key path.
        sep = "." if msg.split(" ", 1)[0] in fields else ": "
        raise ValueError(f"{where}{sep}{msg}") from None
    return Objective(kind, config)


def _lookup(kind: Any, where: str) -> tuple[type, LossFn]:
    """``(Config class, loss function)`` of a built-in name or ``"module:function"``."""
    if not isinstance(kind, str):
        raise ValueError(f"{where}.kind must be a string, got {type(kind).__name__} {kind!r}")
    target = OBJECTIVES.get(kind, kind)
    module_name, sep, fn_name = target.partition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"{where}.kind: unknown objective {kind!r}; expected one of {list(OBJECTIVES)} "
                         f"or 'module:function'")
    try:
        module = import_module_or_file(module_name)
    except ImportError as e:
        raise ValueError(f"{where}.kind: cannot import objective module {module_name!r}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{where}.kind: module {module_name} has no callable {fn_name!r}")
    config_cls = getattr(module, "Config", None)
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise ValueError(f"{where}.kind: objective module {module_name} must define a dataclass 'Config'")
    return config_cls, fn


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """``value`` checked against a field's type hint; ints widen to float, lists become tuples.

    Only the plain types a config file can hold are checked; other annotations pass through to
    the ``Config``'s own checks.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ValueError(f"{path}: must be one of {list(args)}, got {value!r}")
    if origin in (Union, types.UnionType):
        for arm in args:
            try:
                return _coerce(path, value, arm)
            except ValueError:
                continue
        raise ValueError(f"{path}: expected {_describe(hint)}, got {type(value).__name__} {value!r}")
    ok: bool
    if hint is type(None):
        ok = value is None
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif origin in (tuple, list) or hint in (tuple, list):
        ok = isinstance(value, (list, tuple))
        if ok and origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ValueError(f"{path}: expected {len(args)} values, got {len(value)}")
            value = tuple(_coerce(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
        elif ok:
            elems = [_coerce(f"{path}[{i}]", v, args[0]) if args else v for i, v in enumerate(value)]
            value = list(elems) if (origin or hint) is list else tuple(elems)
    elif origin in (dict, Mapping) or hint in (dict, Mapping):
        ok = isinstance(value, Mapping)
        value = dict(value) if ok else value
    elif isinstance(hint, type):
        ok = isinstance(value, hint)
    else:
        return value
    if not ok:
        raise ValueError(f"{path}: expected {_describe(hint)}, got {type(value).__name__} {value!r}")
    return value


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return f"one of {list(typing.get_args(hint))}"
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _qualname(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
