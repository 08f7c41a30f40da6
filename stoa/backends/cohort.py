"""A backend's cohort loop, its framework-free half: the engine members every loop reads and the
episode book it keeps (:class:`stoa.backends.episodes.Cohort`). A backend's loop
(:mod:`stoa.backends.mlx.rollout`, :mod:`stoa.backends.torch.rollout`) subclasses
:class:`CohortLoop` and brings the model's side: the batch, the KV cache, ``run``.

Every loop times its parts into a :class:`~stoa.backends.episodes.RolloutProfile` (a few
``perf_counter`` sums a step, nothing else changes); :func:`profiled` hands them to a caller."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from stoa.backends import episodes
from stoa.backends.engine import EngineConfig, RolloutRequest, RolloutStats, SamplingConfig, TextCodec
from stoa.backends.episodes import RolloutProfile
from stoa.types import Episode

__all__ = ["CohortHost", "CohortLoop", "RolloutProfile", "profiled"]

_PROFILE: contextvars.ContextVar[RolloutProfile | None] = contextvars.ContextVar("stoa_rollout_profile", default=None)


@contextlib.contextmanager
def profiled(profile: RolloutProfile | None = None) -> Iterator[RolloutProfile]:
    """Where the time of every cohort started in this block goes (this thread's cohorts only)::

        with profiled() as prof:
            episodes = engine.rollout(make_env, requests, sampling)
        print(prof.decode_s, prof.other_s)

    Yields ``profile`` (a fresh :class:`RolloutProfile` when None), to which each cohort adds."""
    prof = profile if profile is not None else RolloutProfile()
    token = _PROFILE.set(prof)
    try:
        yield prof
    finally:
        _PROFILE.reset(token)


class CohortHost(Protocol):
    """What every cohort loop reads of the engine that plays it."""

    config: EngineConfig
    version: int

    @property
    def worker_id(self) -> str: ...

    @property
    def codec(self) -> TextCodec: ...


class CohortLoop:
    """One cohort of requests, played to completion by :meth:`run` (see
    :meth:`stoa.backends.engine.RolloutEngine.rollout`): ``e`` the engine, ``s`` the sampling
    settings, ``cfg`` the engine's config, ``book`` the episodes, :attr:`profile` where the
    time goes (the active :func:`profiled` one, or the book's own)."""

    def __init__(self, engine: CohortHost, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                 sampling: SamplingConfig, envs: list[Any]) -> None:
        self.e, self.s, self.cfg = engine, sampling, engine.config
        self.book = episodes.Cohort(engine.codec, make_env, requests, sampling, envs, version=engine.version,
                                    worker_id=engine.worker_id, kv_reuse=engine.config.kv_reuse,
                                    profile=_PROFILE.get())

    @property
    def profile(self) -> RolloutProfile:
        return self.book.profile

    @property
    def stats(self) -> RolloutStats:
        return self.book.stats

    @property
    def free_envs(self) -> list[Any]:
        return self.book.free_envs

    def run(self) -> list[Episode]:
        """Every episode, in request order, then sample order."""
        raise NotImplementedError
