"""The driver's spot check: a cohort's stages recomputed from their signed transcript before upload.

The trainer re-derives every episode with the whole model, so a stage that computes wrong
activations gets the pipeline's batch refused, and the refusal counts against the key that
signed the batch: the driver's. The driver cannot hold the whole model (that is why it has
stages), but it can hold one stage's share at a time. :class:`SpotCheck` chooses, after each
cohort and before its upload, which remote stages to recompute:

* every stage whose key has passed fewer than ``probation`` checks (a stage newly connected is
  checked on its first cohorts: a stage that lies from the start never gets a batch uploaded);
* besides, with probability ``rate``, one other stage at random.

Checking stage ``i`` fetches its share at the cohort's version from the run's signed chain
(:class:`~stoa.transport.chain.ShareSubscriber`: every byte verified against the manifest), builds
the stage on it, and replays the transcript (:func:`stoa.fleet.stages.transcript.blame`). Its cost,
for a stage of ``1/N`` of the layers: the bytes of its share (read once a check: nothing is kept,
so the driver's memory stays its own share plus one other while checking), and the compute of
that stage over the whole cohort, prefill and decode, on the driver, before the upload (about
``1/N`` of the cohort's compute, done in one process; decode steps replay one by one as they
were played). docs/pipeline.md gives the figures.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stoa.backends.engine import stage_backend
from stoa.fleet.stages.transcript import Blame, Transcript, blame, keys_of
from stoa.transport.frames import Frame
from stoa.transport.store import ObjectStore

__all__ = ["SpotCheck"]

log = logging.getLogger("stoa.worker")


class SpotCheck:
    """Which stages of a cohort to recompute, and the recomputation (module docstring).

    Args:
        store, run, public_key: the run's chain (the shares).
        model_dir: the run's model files.
        parts, layers, tied: every stage's layers and the model's shape.
        mode: the engine mode the stages compute in (the run's ``rollout.engine_mode``).
        slots, positions: the stages' bounds (as a stage process serves).
        rate: the chance that one stage beyond those on probation is checked, per cohort.
        probation: checks a stage key must pass before it is only sampled.
    """

    def __init__(self, store: ObjectStore, run: str, public_key: Any, model_dir: Path, parts: Sequence[tuple[int, int]],
                 layers: int, tied: bool, mode: str, slots: int, positions: int, rate: float = 0.125,
                 probation: int = 2, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0 or probation < 0:
            raise ValueError(f"a spot-check rate is in [0, 1] and a probation >= 0, not {rate}, {probation}")
        self.store, self.run, self.public_key, self.model_dir = store, run, public_key, Path(model_dir)
        self.parts, self.layers, self.tied, self.mode = list(parts), layers, tied, mode
        self.slots, self.positions = slots, positions
        self.rate, self.probation = rate, probation
        self.passed: dict[str, int] = {}
        """Checks passed, by stage key id."""
        self.checks = 0
        self.bytes_read = 0
        self.rng = random.Random(seed)

    @property
    def keeps_frames(self) -> bool:
        return self.rate > 0 or self.probation > 0

    def due(self, t: Transcript) -> list[int]:
        """The stages of ``t`` to recompute now."""
        ids = keys_of(t)
        out = [i for i in sorted(t.steps) if self.passed.get(ids[i], 0) < self.probation]
        rest = [i for i in sorted(t.steps) if i not in out]
        if rest and self.rng.random() < self.rate:
            out.append(self.rng.choice(rest))
        return sorted(out)

    def service(self, i: int, version: int) -> Callable[[Frame], Frame | None]:
        """A fresh stage ``i`` on its verified share at ``version``: its frame handler."""
        from stoa.transport.chain import ShareSubscriber

        sb = stage_backend()
        sub = ShareSubscriber(self.store, self.run, self.public_key, self.parts[i], self.layers, self.tied)
        r = sub.sync(None, version=version)
        self.bytes_read += r.bytes_read
        return sb.StageService(sb.Stage(self.model_dir, self.parts[i], r.state, self.mode), self.slots,
                               self.positions).handle

    def check(self, t: Transcript, stages: Sequence[int] | None = None) -> Blame | None:
        """Recompute ``stages`` of ``t`` (default :meth:`due`); the first that differs, or None.
        Raises what fetching a share raises (the chain's errors)."""
        todo = self.due(t) if stages is None else list(stages)
        if not todo:
            return None
        assert t.version is not None
        self.checks += 1
        found = blame(t, lambda i: self.service(i, t.version), todo)
        ids = keys_of(t)
        for i in todo:
            if found is None or i < found.stage:
                self.passed[ids[i]] = self.passed.get(ids[i], 0) + 1
        return found
