"""User code a run config names: ``package.module``, ``path/to/file.py``, and environments
installed as packages.

* :func:`import_module_or_file` imports a dotted module name, or a ``.py`` file by path (once per
  file, under a name derived from its absolute path). Objectives (``kind = "my_obj.py:loss"``)
  and ``env.module`` both go through it.
* Environments can ship as ordinary Python packages that declare their ids in the entry-point
  group ``stoa.envs``; ``import stoa.envs`` registers every installed one (the code itself loads
  when the env is made). A package's ``pyproject.toml``::

      [project.entry-points."stoa.envs"]
      "mylab/Arithmetic-v0" = "mylab_envs.arithmetic:ArithmeticEnv"

  :func:`installed_env` says which distribution (and version) provides an id, which the run
  config records so that every worker loads the same code.

These functions run imports: feed them only what the operator's own config names, never anything
read from the object store.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = ["ENTRY_POINT_GROUP", "InstalledEnv", "import_module_or_file", "installed_env", "installed_envs"]

ENTRY_POINT_GROUP = "stoa.envs"


def import_module_or_file(spec: str) -> ModuleType:
    """The module ``spec`` names: a dotted module name, or a path ending in ``.py``.

    Raises:
        ModuleNotFoundError: no such module or file (``name`` is ``spec``'s module or file).
    """
    if not spec.endswith(".py"):
        return importlib.import_module(spec)
    path = Path(spec).expanduser().resolve()
    name = f"stoa_file_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.util.spec_from_file_location(name, path)
    if loader is None or loader.loader is None or not path.is_file():
        raise ModuleNotFoundError(f"no such file: {path}", name=spec)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    try:
        loader.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@dataclass(frozen=True)
class InstalledEnv:
    """An environment id declared by an installed distribution."""

    id: str
    entry_point: str
    """``"module:attr"`` of the env class or factory."""
    distribution: str
    """The distribution's name, as pip knows it."""
    version: str

    @property
    def requirement(self) -> str:
        """``"name==version"``: what the run config records and a worker must have."""
        return f"{self.distribution}=={self.version}"


@functools.lru_cache(maxsize=1)
def installed_envs() -> dict[str, InstalledEnv]:
    """Every id of the ``stoa.envs`` entry-point group, by id (read once per process)."""
    from importlib.metadata import entry_points

    out: dict[str, InstalledEnv] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        out.setdefault(ep.name, InstalledEnv(ep.name, ep.value, dist.name if dist else "?",
                                             dist.version if dist else "?"))
    return out


def installed_env(env_id: str) -> InstalledEnv | None:
    """The installed distribution that declares ``env_id``, or None."""
    return installed_envs().get(env_id)
