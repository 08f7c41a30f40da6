"""What a worker makes its rollouts with: the weights it follows and the engine on them.

A :class:`Rig` is the one seam for the machinery under a worker's loop, handed to the worker when
it is built (``Worker(..., rig=...)``). :class:`WholeModel`, the default, follows the whole int8
model (:class:`~stoa.fleet.worker.follower.LiveWeights`) and runs it in one engine;
:class:`stoa.fleet.stages.driver.PipelineRig` holds stage 0 of a pipeline and plays each cohort
through stage processes. Keys, numbers, bindings, uploads and the loop are the worker's either
way; a rig asks the worker only through its public methods (``finished``, ``stop_for``, ``beat``,
``sleep``, ``backoff``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from stoa.fleet.parity import join_check
from stoa.fleet.worker.follower import LiveWeights
from stoa.fleet.worker.standing import EXIT_CONFIG, WorkerExit

if TYPE_CHECKING:
    from stoa.backends.engine import RolloutEngine
    from stoa.fleet.config import RunConfig
    from stoa.transport.chain import SyncResult

__all__ = ["Rig", "WholeModel"]

log = logging.getLogger("stoa.worker")


class Worker(Protocol):
    """What a rig may use of its :class:`stoa.fleet.worker.worker.Worker`."""

    store: Any
    run_name: str
    public_key: Any
    worker_id: str
    key_id: str
    cache_dir: Path
    keep_weights: bool
    progress_every: float
    weights: Any
    """The follower :meth:`Rig.weights` made."""

    @property
    def stopped(self) -> bool: ...

    def finished(self) -> bool: ...

    def stop_for(self, reason: str) -> None: ...

    def beat(self, status: str) -> None: ...

    def sleep(self, seconds: float) -> None: ...

    def backoff(self, what: str, e: BaseException) -> None: ...


class Rig(Protocol):
    """The machinery under a worker's loop (see the module docstring)."""

    def weights(self, worker: Worker, cfg: RunConfig, model_dir: Path) -> LiveWeights:
        """The follower of the weight chain the worker joins with (not joined yet)."""
        ...

    def engine(self, worker: Worker, cfg: RunConfig, model_dir: Path, first: SyncResult) -> RolloutEngine:
        """The engine on the joined weights ``first``; raises ``WorkerExit`` when it cannot run
        here. The worker wraps it (``wrap_engine``) and follows the weights into it."""
        ...

    def ready(self, worker: Worker) -> bool:
        """Between cohorts, before the worker's own checks: whether the rig can make one now
        (False after a wait of its own)."""
        ...

    def failed(self, worker: Worker, seq: int, error: OSError) -> bool:
        """Whether ``error``, raised while making the cohort of number ``seq``, was the rig's: the
        cohort is then void (nothing of it is uploaded; the number is made again). False: the
        error is the worker's to handle."""
        ...

    def leave(self, worker: Worker) -> None:
        """On the way out of a session, after the final heartbeat."""
        ...


class WholeModel:
    """The default rig: the whole int8 model in one engine on this machine."""

    def weights(self, worker: Worker, cfg: RunConfig, model_dir: Path) -> LiveWeights:
        return LiveWeights(worker.store, worker.run_name, worker.public_key,
                           keep_dir=worker.cache_dir if worker.keep_weights else None)

    def engine(self, worker: Worker, cfg: RunConfig, model_dir: Path, first: SyncResult) -> RolloutEngine:
        """The int8 engine as the run configures it (``[rollout]``, ``model.prompt_format``),
        checked against the run's model (this machine's framework may read its config otherwise)."""
        from stoa.backends.engine import make_engine

        rc = cfg.rollout
        engine = make_engine(model_dir, rc.engine, state=first.state, version=first.version, mode=rc.engine_mode,
                             config=rc.engine_config(cfg.model.prompt_format), worker_id=worker.worker_id)
        refused = join_check(engine, model_dir)
        if refused:
            raise WorkerExit(EXIT_CONFIG, refused)
        log.info("worker %s (key %s) joined run %s at version %d (%s mode, %d bytes); a progress line every %.0fs",
                 worker.worker_id, worker.key_id, worker.run_name, first.version, engine.mode, first.bytes_read,
                 worker.progress_every)
        return engine

    def ready(self, worker: Worker) -> bool:
        return True

    def failed(self, worker: Worker, seq: int, error: OSError) -> bool:
        return False

    def leave(self, worker: Worker) -> None:
        return None
