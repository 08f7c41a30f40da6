"""What the built-in rollout engines share, written once: :class:`EngineBase` (every engine, the
torch pipelines included) and :class:`SingleEngineBase` (an engine that holds the whole model: the
MLX and torch engines). The contract they implement is :mod:`stoa.backends.engine`'s
:class:`~stoa.backends.engine.RolloutEngine`; a backend keeps only what differs (its arrays, its
forward pass, its sampler).
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stoa.backends.engine import (
    EngineBusyError,
    EngineConfig,
    EngineError,
    RolloutRequest,
    RolloutStats,
    SamplingConfig,
    TextCodec,
)
from stoa.backends.packing import by_length

if TYPE_CHECKING:
    from stoa.backends.sampling import Draws
    from stoa.types import Episode

__all__ = ["EngineBase", "SingleEngineBase"]


class EngineBase:
    """What every built-in engine holds alike: the single engines (:class:`SingleEngineBase`) and
    the torch pipelines (whose weights live in their stages).

    A backend builds its model and its text side (:class:`stoa.backends.text.TokenizerText`),
    then calls this ``__init__``. The properties are :class:`RolloutEngine`'s; :attr:`state` is
    ``_state``, which a backend sets (a pipeline overrides :attr:`state` instead). Also:
    ``hf_dir``, ``config`` (an :class:`EngineConfig`, replaceable between cohorts; its
    ``prompt_format`` is resolved once, at construction), ``prompt_format`` (``"chat"`` or
    ``"plain"``), ``eos_ids`` (token ids that end an episode).
    """

    _state: dict[str, np.ndarray]

    def __init__(self, hf_dir: Path, config: EngineConfig, version: int, worker_id: str, *, mode: str,
                 vocab_size: int, tokenizer: Any, codec: TextCodec, built: dict[str, Any]) -> None:
        self.hf_dir, self.config, self.version, self._worker_id = hf_dir, config, int(version), str(worker_id)
        self._mode, self._vocab, self._tok, self._codec, self._built = mode, int(vocab_size), tokenizer, codec, built
        self.prompt_format = codec.prompt_format
        self.eos_ids = codec.eos_ids
        self._stats = RolloutStats()

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @property
    def built_config(self) -> dict[str, Any]:
        return dict(self._built)

    @property
    def tokenizer(self) -> Any:
        return self._tok

    @property
    def state(self) -> dict[str, np.ndarray]:
        return self._state

    @property
    def codec(self) -> TextCodec:
        return self._codec

    def last_stats(self) -> RolloutStats:
        return self._stats

    def state_hash(self) -> str:
        from stoa.transport import pulse

        return pulse.state_hash(self.state)

    def encode(self, text: str) -> list[int]:
        """Observation tokens: no BOS/EOS added, special-token strings not parsed as control tokens."""
        return self._codec.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self._codec.decode(tokens)

    def prompt_tokens(self, prompt: str) -> list[int]:
        return self._codec.prompt_tokens(prompt)

    def stop_candidates(self, stops: tuple[str, ...]) -> frozenset[int]:
        return self._codec.stop_candidates(stops)


class _Cohort(Protocol):
    """What :meth:`SingleEngineBase.rollout` needs of a backend's cohort loop."""

    @property
    def stats(self) -> RolloutStats: ...

    @property
    def free_envs(self) -> list[Any]: ...

    def run(self) -> list[Episode]: ...


class SingleEngineBase(EngineBase, abc.ABC):
    """An engine that holds the whole weight state in one process, changes it between cohorts and
    re-scores episodes: all of :class:`RolloutEngine`. A backend brings ``_check_state(state)``
    (:class:`EngineError` unless ``state`` fits :attr:`state`'s names, shapes and dtypes),
    ``_rebuild(names)`` (recompute what the model computes with from the state entries ``names``,
    just written in place), ``_cohort(...)`` (its cohort loop: ``run``, ``stats``, ``free_envs``),
    ``_score_batch`` / ``_draws_batch`` (one batched forward pass of :meth:`score` /
    :meth:`check_draws`) and, where its device needs them, ``_drain()`` (wait until no queued work
    reads the state's buffers, before they are written) and ``_computing()`` (the context of every
    forward pass). Every call below holds the engine's lock (:class:`EngineBusyError` if another
    holds it): one weight version per cohort.
    """

    def __init__(self, hf_dir: Path, config: EngineConfig, version: int, worker_id: str, *, mode: str,
                 vocab_size: int, tokenizer: Any, codec: TextCodec, built: dict[str, Any]) -> None:
        super().__init__(hf_dir, config, version, worker_id, mode=mode, vocab_size=vocab_size, tokenizer=tokenizer,
                         codec=codec, built=built)
        self._lock = threading.Lock()
        self._envs: tuple[Any, list[Any]] = (None, [])  # (factory, idle instances) kept across cohorts

    # -- what a backend brings ------------------------------------------------------------------
    @abc.abstractmethod
    def _check_state(self, state: dict[str, np.ndarray]) -> None: ...

    @abc.abstractmethod
    def _rebuild(self, names: Sequence[str]) -> None: ...

    @abc.abstractmethod
    def _cohort(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest], sampling: SamplingConfig,
                envs: list[Any]) -> _Cohort: ...

    @abc.abstractmethod
    def _score_batch(self, eps: Sequence[Episode], temperature: float | None) -> list[np.ndarray]: ...

    @abc.abstractmethod
    def _draws_batch(self, eps: Sequence[Episode], seeds: Sequence[int], top_k: int, drift: float) -> list[Draws]: ...

    def _drain(self) -> None:
        return None

    def _computing(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    # -- weights --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError(f"{what} while a rollout is running: weights change only between cohorts")
        try:
            yield
        finally:
            self._lock.release()

    def load_state(self, version: int, state: dict[str, np.ndarray]) -> None:
        with self._exclusive("load_state"):
            self._check_state(state)
            self._drain()
            for k, v in state.items():
                np.copyto(self._state[k], v)
            self._rebuild(list(self._state))
            self.version = int(version)

    def apply_delta(self, version: int, blob: bytes) -> list[str]:
        from stoa.transport import pulse

        return self.update_inplace(lambda state: (version, pulse.apply_delta_inplace(state, blob)))

    def update_inplace(self, write: Callable[[dict[str, np.ndarray]], tuple[int, Sequence[str]]]) -> list[str]:
        with self._exclusive("update_inplace"):
            self._drain()  # nothing may still be reading the buffers written below
            version, changed = write(self._state)
            names = list(changed)
            if names:
                self._rebuild(names)
            self.version = int(version)
            return names

    # -- episodes -------------------------------------------------------------------------------
    def rollout(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                sampling: SamplingConfig = SamplingConfig()) -> list[Episode]:
        if not callable(make_env):
            raise EngineError("make_env must be a zero-argument callable returning an environment")
        for r in requests:
            if not isinstance(r, RolloutRequest):
                raise EngineError(f"requests must be RolloutRequest objects, got {type(r).__name__}")
        if not isinstance(sampling, SamplingConfig):
            raise EngineError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        with self._exclusive("rollout"):
            factory, idle = self._envs
            cohort = self._cohort(make_env, requests, sampling, idle if factory is make_env else [])
            try:
                with self._computing():
                    return cohort.run()
            finally:
                self._stats = cohort.stats
                self._envs = (make_env, cohort.free_envs)

    def score(self, episodes: Sequence[Episode], temperature: float | None = None,
              max_tokens: int = 8192) -> list[np.ndarray]:
        """See the protocol. ``max_tokens`` bounds the tokens of one batched forward pass."""
        if temperature is not None and not temperature > 0:
            raise EngineError(f"temperature={temperature} must be > 0")
        with self._exclusive("score"), self._computing():
            return by_length([len(e) for e in episodes], max_tokens,
                             lambda b: self._score_batch([episodes[i] for i in b], temperature))

    def sampling_margins(self, episodes: Sequence[Episode], seeds: Sequence[int], top_k: int = 0,
                         drift: float = 0.0, max_tokens: int = 8192) -> list[np.ndarray]:
        """See the protocol. ``max_tokens`` bounds the tokens of one batched forward pass."""
        return [d.margins for d in self.check_draws(episodes, seeds, top_k, drift, max_tokens)]

    def check_draws(self, episodes: Sequence[Episode], seeds: Sequence[int], top_k: int = 0,
                    drift: float = 0.0, max_tokens: int = 8192) -> list[Draws]:
        """See the protocol. ``max_tokens`` bounds the tokens of one batched forward pass."""
        if len(seeds) != len(episodes):
            raise EngineError("one seed per episode")
        with self._exclusive("check_draws"), self._computing():
            return by_length([len(e) for e in episodes], max_tokens, lambda b: self._draws_batch(
                [episodes[i] for i in b], [int(seeds[i]) for i in b], top_k, drift))
