"""The trainer's int8 policies: the states workers may still claim, and one engine to run them.

Workers sample from int8 weights of some published version at most ``trainer.max_lag`` behind.
The trainer needs the same int8 policy to evaluate a version, to split the behaviour/trainer
gap into its int8 and staleness parts, to spot-check a worker's claimed log-probs at the version
it claims, and for replay's text codec. :class:`HeldPolicies` keeps the states of the versions
that can still be claimed and one rollout engine (built on first use) that it loads with
whichever of them is asked for; versions never repeat within a run, so a version names one state.
A version it does not hold (after a restart the trainer holds only the version it resumed as) is
rebuilt from the weight chain in the store, verified like a worker's sync, when it is asked for.

Scoring (:meth:`HeldPolicies.score`, :meth:`HeldPolicies.check_draws`: the check of every episode,
spot-checks, sampling checks, the mismatch split) runs on the rollout engine (the default on a CPU
learner whose engine is torch's with the int8 kernel) or, with ``trainer.int8_scorer = "torch"``
(the default on a CUDA learner, and on another CPU learner for a model whose float32 copy fits in
:data:`SMALL_CPU_SCORER_BYTES`), on the int8 scorer of that name (:mod:`stoa.backends.scorer`; torch's
dequantizes the state into a torch model) on the learner's device: the same dequantized weights, and agreement with the engine measured in
docs/scale.md. Evaluation generates, so it always runs on the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stoa.backends.scorer import SCORERS, Int8StateScorer, make_scorer, scorer_device
from stoa.fleet.worker.section import RolloutConfig

if TYPE_CHECKING:
    from stoa.backends.engine import RolloutEngine, TextCodec
    from stoa.backends.sampling import Draws
    from stoa.transport.chain import WeightSubscriber
    from stoa.types import Episode

__all__ = ["SMALL_CPU_SCORER_BYTES", "HeldPolicies"]

log = logging.getLogger("stoa.trainer")

SMALL_CPU_SCORER_BYTES = 1 << 30
"""On a CPU learner, ``int8_scorer = "auto"`` scores on torch when the model's float32 weights fit in this."""


def _num_params(model_dir: Path) -> float:
    """The parameter count of the model folder's config (infinite when it cannot be told)."""
    import json

    from stoa.models.presets import num_params

    try:
        return num_params(json.loads((Path(model_dir) / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return float("inf")


class HeldPolicies:
    """Args:
        model_dir: the run's Hugging Face folder (config and tokenizer; its weights are not used).
        rollout: the run's ``[rollout]`` (engine backend, mode, batch).
        max_lag: versions behind the newest that a worker may still claim (``trainer.max_lag``).
        chain: the run's weight chain, to rebuild a claimable version that is not held (None: never).
        scorer: what scores (``trainer.int8_scorer``): ``"engine"``, a scorer of
            :data:`stoa.backends.scorer.SCORERS` (``"torch"``), or ``"auto"`` (torch when
            ``device`` resolves to CUDA or the model is small, else the engine).
        device: the learner's ``device`` setting; the torch scorer runs there.
        dtype: the torch scorer's compute dtype (the state's, ``pulse.dtype``).
        prompt_format: the run's ``model.prompt_format`` (the engine's prompts, replay's codec).
    """

    def __init__(self, model_dir: Path, rollout: RolloutConfig, max_lag: int, directory: Path,
                 chain: WeightSubscriber | None = None, scorer: str = "engine", device: str = "cpu",
                 dtype: str = "float32", prompt_format: str = "auto"):
        from stoa.fleet.trainer.heldstates import HeldStates

        if scorer not in ("auto", "engine", *SCORERS):
            raise ValueError(f"scorer={scorer!r} must be auto, engine or {' or '.join(sorted(SCORERS))}")
        self.model_dir, self.rollout, self.max_lag, self.chain = Path(model_dir), rollout, max_lag, chain
        self._states = HeldStates(directory, keep=max_lag + 1)
        self._engine: RolloutEngine | None = None
        self._scorer: Int8StateScorer | None = None  # the named scorer, built on first use
        self._device, self._dtype, self._prompt_format = device, dtype, prompt_format
        if scorer == "auto":
            scorer = self._auto(device)
        self.scorer = scorer
        """What scores: ``"engine"`` or a key of :data:`~stoa.backends.scorer.SCORERS` (``"auto"`` resolved)."""

    def _auto(self, device: str) -> str:
        """Torch on a CUDA learner. On a CPU learner: the engine when it is torch's with the int8
        kernel (it computes on the int8 codes and keeps no float copy); otherwise torch while its
        float32 copy stays under :data:`SMALL_CPU_SCORER_BYTES` (the trainer keeps the engine for
        evaluation), else the engine. The measured speeds behind the choice: docs/scale.md."""
        if device != "cpu":
            device = scorer_device("torch", device)  # the learner has imported torch
            if device.startswith("cuda"):
                return "torch"
        if device == "cpu":
            if self._engine_is_int8_kernel():
                return "engine"
            if 4 * _num_params(self.model_dir) <= SMALL_CPU_SCORER_BYTES:
                return "torch"
        return "engine"  # a large model on a CPU learner; any other device (Apple's mps: MLX runs on Metal)

    def _engine_is_int8_kernel(self) -> bool:
        """Whether the run's engine here is torch's on the int8 kernel (``int24``, ``int16`` or
        ``quantized`` mode, CPUs)."""
        from stoa.backends.engine import EngineError, engine_mode, resolve_backend

        if resolve_backend(self.rollout.engine) != "torch":  # asking MLX would import it
            return False
        try:
            return engine_mode("torch", self.rollout.engine_mode) in ("int24", "int16", "quantized")
        except EngineError:  # a kernel mode where it cannot run: the engine itself will say so
            return False

    def keep(self, version: int, state: dict[str, np.ndarray], state_hash: str | None = None) -> None:
        """Hold ``version``'s state (call it once the version is published; ``state_hash`` is the
        published one); forget the ones more than ``max_lag`` behind it. A held state of that
        version is replaced unless both carry the same hash: a spot-check must run the weights
        the store serves under that label."""
        if version in self._states and (state_hash is None or self._states.state_hash(version) != state_hash):
            self._states.drop(version)
            for scorer in (self._engine, self._scorer):
                if scorer is not None and scorer.version == version:
                    scorer.load_state(version, dict(state))
        if version not in self._states:
            self._states.put(version, state, state_hash)
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
            from stoa.backends.engine import make_engine

            rc = self.rollout
            self._engine = make_engine(self.model_dir, rc.engine, state=state, version=version, mode=rc.engine_mode,
                                       config=rc.engine_config(self._prompt_format), worker_id="eval")
        elif self._engine.version != version:
            self._engine.load_state(version, state)
        return self._engine

    def scorer_at(self, version: int) -> RolloutEngine | Int8StateScorer:
        """What scores ``version`` (see :attr:`scorer`), holding its state. KeyError if not held."""
        if self.scorer == "engine":
            return self.engine_at(version)
        if not self.held(version):
            raise KeyError(f"version {version}'s int8 state is not held")
        if self._scorer is None:
            self._scorer = make_scorer(self.scorer, self.model_dir, self._device, self._dtype)
            log.info("int8 scoring on %s: %s, %s", self.scorer, self._scorer.device, self._dtype)
        if self._scorer.version != version:
            self._scorer.load_state(version, self._states.get(version) or {})  # mapped: read tensor by tensor
        return self._scorer

    def score(self, version: int, episodes: Sequence[Episode]) -> list[np.ndarray] | None:
        """Prefill log-probs of ``version``'s int8 policy, or None when it cannot be had."""
        return self.scorer_at(version).score(episodes) if self.held(version) else None

    def sampling_margins(self, version: int, episodes: Sequence[Episode], seeds: Sequence[int],
                         drift: float = 0.0) -> list[np.ndarray] | None:
        """``RolloutEngine.sampling_margins`` under ``version``'s int8 policy, or None when it cannot be had."""
        return self.scorer_at(version).sampling_margins(episodes, seeds, drift=drift) if self.held(version) else None

    def check_draws(self, version: int, episodes: Sequence[Episode], seeds: Sequence[int],
                    drift: float = 0.0) -> list[Draws] | None:
        """``RolloutEngine.check_draws`` under ``version``'s int8 policy, or None when it cannot be had."""
        return self.scorer_at(version).check_draws(episodes, seeds, drift=drift) if self.held(version) else None

    @property
    def codec(self) -> TextCodec:
        """The engine's text codec (builds the engine from the newest held state on first use)."""
        if self._engine is None:
            self.engine_at(max(self._states.versions()))
        assert self._engine is not None
        return self._engine.codec
