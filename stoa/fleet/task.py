"""The run's task, ``[env]``: which registered environment, with which keyword arguments and splits,
and the code that registers it on every machine (:func:`import_env_module`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stoa.fleet.sections import ConfigError

__all__ = ["EnvConfig", "import_env_module"]


@dataclass(frozen=True)
class EnvConfig:
    """The task (``[env]``)."""

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

    def make(self, split: str, **over: Any) -> Any:
        """A new instance of the task on ``split`` (``stoa.envs.make`` with :attr:`kwargs`, ``over`` winning).
        Call :func:`import_env_module` first when the id comes from ``module``."""
        import stoa.envs

        return stoa.envs.make(self.id, split=split, **{**self.kwargs, **over})


def import_env_module(env: EnvConfig) -> None:
    """Make ``env.id`` available: check that the installed package is the version the run names
    (``env.package``), then import ``env.module`` (a module name or a ``.py`` path), which
    registers the id.

    Raises:
        ConfigError: the package is missing or another version, or the module is not there.
    """
    from stoa.envs import provider
    from stoa.plugins import import_module_or_file

    if env.package:
        found = provider(env.id)
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
