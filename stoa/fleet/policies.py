"""The trainer's int8 policies: the states workers may still claim, and one engine to run them.

Workers sample from int8 weights of some published version at most ``trainer.max_lag`` behind.
The trainer needs the same int8 policy to evaluate a version, to split the behaviour/trainer
gap into its int8 and staleness parts, to spot-check a worker's claimed log-probs at the version
it claims, and for replay's text codec. :class:`HeldPolicies` keeps the states of the versions
that can still be claimed and one rollout engine (built on first use) that it loads with
whichever of them is asked for; versions never repeat within a run, so a version names one state.
A version it does not hold (after a restart the trainer holds only the version it resumed as) is
rebuilt from the weight chain in the store, verified like a worker's sync, when it is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from stoa.backends.engine import RolloutEngine, TextCodec
    from stoa.fleet.config import RolloutConfig
    from stoa.transport.chain import WeightSubscriber
    from stoa.types import Episode

__all__ = ["HeldPolicies"]

log = logging.getLogger("stoa.trainer")


class HeldPolicies:
    """Args:
        model_dir: the run's Hugging Face folder (config and tokenizer; its weights are not used).
        rollout: the run's ``[rollout]`` (engine backend, mode, batch).
        max_lag: versions behind the newest that a worker may still claim (``trainer.max_lag``).
        chain: the run's weight chain, to rebuild a claimable version that is not held (None: never).
    """

    def __init__(self, model_dir: Path, rollout: RolloutConfig, max_lag: int, directory: Path,
                 chain: WeightSubscriber | None = None):
        from stoa.fleet.heldstates import HeldStates

        self.model_dir, self.rollout, self.max_lag, self.chain = Path(model_dir), rollout, max_lag, chain
        self._states = HeldStates(directory, keep=max_lag + 1)
        self._engine: RolloutEngine | None = None

    def keep(self, version: int, state: dict[str, np.ndarray]) -> None:
        """Hold ``version``'s state; forget the ones more than ``max_lag`` behind it."""
        if version not in self._states:
            self._states.put(version, state)
        self._states.prune(version - self.max_lag)

    def held(self, version: int) -> bool:
        """Whether ``version``'s state is at hand, rebuilding it from the chain if it may still be claimed."""
        if version in self._states:
            return True
        newest = max(self._states.versions(), default=None)
        if self.chain is None or newest is None or not newest - self.max_lag <= version < newest:
            return False
        from stoa.transport.chain import SYNC_ERRORS

        try:
            got = self.chain.sync(None, version=version)
        except SYNC_ERRORS as e:
            log.warning("cannot rebuild version %d from the weight chain: %s", version, e)
            return False
        if got.version != version:
            return False
        self._states.put(version, got.state)
        log.info("rebuilt version %d's int8 state from the weight chain (%d bytes read)", version, got.bytes_read)
        return True

    def engine_at(self, version: int) -> RolloutEngine:
        """The engine holding ``version`` (loaded only when it holds another one). KeyError if not held."""
        if not self.held(version):
            raise KeyError(f"version {version}'s int8 state is not held")
        state = dict(self._states.get(version) or {})  # the engine copies it into its own arrays
        if self._engine is None:
            from stoa.backends.engine import EngineConfig, make_engine

            rc = self.rollout
            self._engine = make_engine(self.model_dir, rc.engine, state=state, version=version, mode=rc.engine_mode,
                                       config=EngineConfig(max_batch=rc.max_batch), worker_id="eval")
        elif self._engine.version != version:
            self._engine.load_state(version, state)
        return self._engine

    def score(self, version: int, episodes: Sequence[Episode]) -> list[np.ndarray] | None:
        """Prefill log-probs of ``version``'s int8 policy, or None when it cannot be had."""
        return self.engine_at(version).score(episodes) if self.held(version) else None

    def sampling_margins(self, version: int, episodes: Sequence[Episode], seeds: Sequence[int]) -> list[np.ndarray] | None:
        """``RolloutEngine.sampling_margins`` under ``version``'s int8 policy, or None when it cannot be had."""
        return self.engine_at(version).sampling_margins(episodes, seeds) if self.held(version) else None

    @property
    def codec(self) -> TextCodec:
        """The engine's text codec (builds the engine from the newest held state on first use)."""
        if self._engine is None:
            self.engine_at(max(self._states.versions()))
        assert self._engine is not None
        return self._engine.codec
