"""Making environments by id: gymnasium's registry, plus families of ids registered on demand
(:data:`ID_PREFIXES`). ``stoa.envs`` re-exports all of it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gymnasium

if TYPE_CHECKING:
    from stoa.plugins import InstalledEnv

__all__ = ["ID_PREFIXES", "IdFamily", "family", "make", "provider", "register", "resolve"]


@dataclass(frozen=True)
class IdFamily:
    """Ids that start with one prefix, registered when first made or checked."""

    handler: str
    """``"module:function"`` called with the id; it registers the id or raises ``ValueError`` saying why not."""
    distribution: str
    """The package whose version every machine of a run must share (recorded as ``env.package``)."""


ID_PREFIXES: dict[str, IdFamily] = {
    "reasoning_gym:": IdFamily("stoa.envs.rgym:register_id", "reasoning-gym"),
    "verifiers:": IdFamily("stoa.envs.vf:register_id", "verifiers"),
}
"""Id prefixes and the families they name: the only place that knows them all."""


def family(id: str) -> IdFamily | None:
    """The family whose prefix ``id`` starts with, or None."""
    return next((f for prefix, f in ID_PREFIXES.items() if id.startswith(prefix)), None)


def resolve(id: str) -> bool:
    """Whether ``id`` is registered, registering it first if it belongs to a family of
    :data:`ID_PREFIXES`.

    Raises:
        ValueError: the id's family cannot make it (the message says why).
    """
    if id in gymnasium.registry:
        return True
    found = family(id)
    if found is None:
        return False
    module, _, fn = found.handler.partition(":")
    getattr(importlib.import_module(module), fn)(id)
    return id in gymnasium.registry


def provider(id: str) -> InstalledEnv | None:
    """The installed distribution that provides ``id`` (what a run records as ``env.package``): the
    package that declares it in the entry-point group ``stoa.envs``, or its family's distribution;
    None for an id registered by code (``env.module``) or whose family is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    from stoa.plugins import InstalledEnv, installed_env

    found = installed_env(id)
    fam = family(id)
    if found is not None or fam is None:
        return found
    try:
        return InstalledEnv(id, fam.handler, fam.distribution, version(fam.distribution))
    except PackageNotFoundError:
        return None


def register(id: str, entry_point: Any, **kwargs: Any) -> None:
    """``gymnasium.register(id=id, entry_point=entry_point, **kwargs)``; ``entry_point`` is a class,
    a factory, or a ``"module:attr"`` string. Re-registering an id replaces it."""
    gymnasium.register(id=id, entry_point=entry_point, **kwargs)


def make(id: str, **kwargs: Any) -> gymnasium.Env:
    """``gymnasium.make(id, **kwargs)`` (an id of :data:`ID_PREFIXES` is registered first); reach
    the environment itself with ``env.unwrapped``."""
    resolve(id)
    # By its spec: gymnasium.make reads "module:name" as "import module, then make name".
    return gymnasium.make(gymnasium.registry.get(id, id), **kwargs)
