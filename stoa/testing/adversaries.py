"""Dishonest workers, for testing the trainer's checks (``docs/trust.md``).

Each is a plain :class:`stoa.fleet.worker.Worker` (real MLX engine, real store, sealed uploads)
whose engine is wrapped through the worker's one seam, ``wrap_engine``: an
:class:`~stoa.backends.engine.EngineWrapper` that changes one behaviour (what a cohort returns,
how it samples, which weights it samples with) and leaves the rest of the worker as it is. Run
one with ``stoa worker ... --adversary KIND`` or add one to a local fleet with
``stoa train CONFIG --adversary KIND``:

=====================  ===================================================  =====================
kind                   what it does                                         caught by
=====================  ===================================================  =====================
``flip-rewards``       reward 1 on every wrong answer                       replay (reward)
``forge-metrics``      the task's success metric and every other bool       replay (metrics)
                       metric it declares set to true
``zero-logprobs``      every behaviour log-prob claimed 0                   audit + spot-check
``shuffle-logprobs``   behaviour log-probs shuffled within each episode     audit + spot-check
``other-model``        samples with another (random) model of the same      audit + spot-check
                       shape and tokenizer, claims the run's version
``forge-observations`` the first observation of each episode replaced       replay (observation)
                       by planted text
``copy``               uploads other workers' batches as its own            assigned work
``framer``             re-signs other workers' fresh batches, unchanged,    assigned work (the
                       under its own key (to have the originals struck)     originals are never struck)
``copy-variant``       its own honest groups with one episode replaced by   the sampling check
                       a copy of another (relabelled as that sample)        (repeated tokens)
``cold-sampler``       samples at 0.7x the temperature, claims the run's    the sampling check
                       and reports honest log-probs of what it sampled
``selective``          honest, but withholds each batch with a success and  withholding rate
                       every other one of the rest (a taste of its own);    (flagged, not banned)
                       after 3 withheld in a row it uploads the next
``unenrolled``         honest, but its key is not enrolled                  the roster (an enrolled
                                                                            run; in an open run it
                                                                            is a new worker)
=====================  ===================================================  =====================

They know no task: what a task's metrics are comes from the environment's declared hooks
(``TextEnv.metric_types``, ``success_metric``), found through its registered id. Nothing here
is used by honest code paths.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stoa.backends.engine import EngineWrapper, RolloutEngine, RolloutRequest, SamplingConfig
from stoa.fleet.worker.worker import Worker
from stoa.transport import layout
from stoa.transport.exchange import parse_rollout_key
from stoa.transport.identity import SealError, open_sealed
from stoa.transport.store import StoreError
from stoa.types import Episode, EpisodeError, Segment, decode_episodes

__all__ = ["KINDS", "Adversary", "claim_logprobs", "make_adversary"]

log = logging.getLogger("stoa.adversary")


class Adversary(EngineWrapper):
    """A dishonest worker's engine: the honest one (``self.engine``) with one behaviour changed.
    ``worker`` is the worker it serves (its store, run, id and writer)."""

    kind = ""

    def __init__(self, engine: RolloutEngine, worker: Worker) -> None:
        super().__init__(engine)
        self.worker = worker
        self.rng = np.random.default_rng(list(worker.worker_id.encode()))


class _Forger(Adversary):
    """Generates honestly, then changes the cohort before the worker uploads it."""

    def rollout(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                sampling: SamplingConfig = SamplingConfig()) -> list[Episode]:
        return self.forge(self.engine.rollout(make_env, requests, sampling))

    def forge(self, episodes: list[Episode]) -> list[Episode]:
        return episodes


class FlipRewards(_Forger):
    kind = "flip-rewards"

    def forge(self, episodes: list[Episode]) -> list[Episode]:
        for e in episodes:
            e.reward = max(e.reward, 1.0)
        return episodes


def _declared(env_id: str) -> tuple[dict[str, Any], str | None]:
    """A registered task's declared ``(metric_types, success_metric)``, read from its class."""
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    import stoa.envs  # noqa: F401  (registers the built-in tasks)

    cls = load_env_creator(gymnasium.spec(env_id).entry_point)
    return dict(getattr(cls, "metric_types", {})), getattr(cls, "success_metric", None)


class ForgeMetrics(_Forger):
    kind = "forge-metrics"

    def forge(self, episodes: list[Episode]) -> list[Episode]:
        for e in episodes:
            types, success = _declared(e.env_id)
            forged = {k: True for k, t in types.items() if t is bool or (isinstance(t, tuple) and bool in t)}
            e.metrics = {**e.metrics, **forged, **({success: True} if success else {})}
        return episodes


class ZeroLogprobs(_Forger):
    kind = "zero-logprobs"

    def forge(self, episodes: list[Episode]) -> list[Episode]:
        for e in episodes:
            for s in e.segments:
                if s.kind == "model":
                    s.logprobs = np.zeros_like(s.logprobs)
        return episodes


class ShuffleLogprobs(_Forger):
    kind = "shuffle-logprobs"

    def forge(self, episodes: list[Episode]) -> list[Episode]:
        for e in episodes:
            model = [s for s in e.segments if s.kind == "model"]
            flat = self.rng.permutation(np.concatenate([s.logprobs for s in model]))
            k = 0
            for s in model:
                s.logprobs = flat[k:k + len(s.tokens)].astype(np.float32)
                k += len(s.tokens)
        return episodes


class OtherModel(Adversary):
    """Samples with a random model of the run's shape and tokenizer; follows the version numbers only."""

    kind = "other-model"

    def __init__(self, engine: RolloutEngine, worker: Worker) -> None:
        from stoa.transport.quant import dequantize_state, quantize_state

        super().__init__(engine, worker)
        self._honest = {k: np.array(v, copy=True) for k, v in engine.state.items()}
        floats = dequantize_state(self._honest)
        rng = np.random.default_rng(12345)
        dtype = lambda k, v: self._honest.get(k[: -len(".weight")] + ".scales", v).dtype  # noqa: E731 - as stored
        other = {k: (rng.normal(0.0, float(v.std()) or 0.02, v.shape).astype(dtype(k, v)) if v.ndim == 2 else v)
                 for k, v in floats.items()}
        engine.load_state(engine.version, quantize_state(other))

    def update_inplace(self, write: Callable[[dict[str, np.ndarray]], tuple[int, Sequence[str]]]) -> list[str]:
        def claim(_live: dict[str, np.ndarray]) -> tuple[int, list[str]]:  # the chain goes into a copy
            version, _ = write(self._honest)
            return version, []

        return self.engine.update_inplace(claim)


class ForgeObservations(_Forger):
    kind = "forge-observations"

    def forge(self, episodes: list[Episode]) -> list[Episode]:
        planted = np.array(self.engine.codec.encode("\n\nThe answer is whatever you said.\n\n"), np.int32)
        for e in episodes:  # the first observation becomes planted text
            for j, s in enumerate(e.segments):
                if s.kind == "env":
                    e.segments[j] = Segment("env", planted)
                    break
        return episodes


class Copy(Adversary):
    """Generates nothing: uploads the batches of workers the trainer trusts (its public report says
    whose batches it accepts), at its own policy version, under its own id and key."""

    kind = "copy"

    def __init__(self, engine: RolloutEngine, worker: Worker) -> None:
        super().__init__(engine, worker)
        self._copied: set[str] = set()

    def rollout(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                sampling: SamplingConfig = SamplingConfig()) -> list[Episode]:
        time.sleep(0.2)
        return self.copied()

    def copied(self) -> list[Episode]:
        from stoa.fleet.trust.records import read_trust_report

        w = self.worker
        report = read_trust_report(w.store, w.run_name)
        trusted = {r.worker_id for r in (report.workers.values() if report else ())
                   if r.accepted_batches and not r.banned} - {w.worker_id}
        stolen = self._steal(lambda worker: worker in trusted)
        for e in stolen:
            e.group_id = f"{w.worker_id}-copy-{len(self._copied)}-{e.group_id}"[:200]
        return stolen

    def _steal(self, whose: Callable[[str], bool]) -> list[Episode]:
        """The newest batch at our version of a worker ``whose(worker id)`` accepts, relabelled as ours."""
        w = self.worker
        for key in reversed(w.store.list(layout.rollouts(w.run_name))):
            parsed = parse_rollout_key(w.run_name, key)
            if parsed is None or not whose(parsed[0]) or key in self._copied or parsed[2] != self.version:
                continue
            self._copied.add(key)
            try:
                _, payload = open_sealed(w.store.get(key))
                stolen = decode_episodes(payload)
            except (SealError, StoreError, EpisodeError):
                continue
            for e in stolen:
                e.worker_id = w.worker_id
            log.info("copied %s (%d episodes)", key, len(stolen))
            return stolen
        return []


class Framer(Copy):
    """Re-signs other workers' fresh batches unchanged (their group ids, items and draws) under its
    own key and name, hoping the trainer takes its copy and strikes the original."""

    kind = "framer"

    def copied(self) -> list[Episode]:
        return self._steal(lambda worker: worker != self.worker.worker_id)


class CopyVariant(_Forger):
    """In each group of its own honest work, one sample is replaced by a copy of another sample's
    tokens relabelled with the replaced sample's index: every episode is genuine, the group is new."""

    kind = "copy-variant"

    def forge(self, episodes: list[Episode]) -> list[Episode]:
        by_group: dict[str, list[int]] = {}
        for i, e in enumerate(episodes):
            by_group.setdefault(e.group_id, []).append(i)
        for idx in by_group.values():
            if len(idx) >= 2:
                twin = _copy.deepcopy(episodes[idx[0]])
                twin.sample_index = episodes[idx[1]].sample_index
                episodes[idx[1]] = twin
        return episodes


class ColdSampler(Adversary):
    """Samples at 0.7x the run's temperature (sharper, more exploitative) and reports, at the run's
    temperature, the honest log-probs of the tokens it drew: every claimed log-prob re-scores."""

    kind = "cold-sampler"

    def rollout(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                sampling: SamplingConfig = SamplingConfig()) -> list[Episode]:
        cold = dataclasses.replace(sampling, temperature=sampling.temperature * 0.7)
        episodes = self.engine.rollout(make_env, requests, cold)
        if not episodes:
            return episodes
        claimed = episodes[0].temperature / 0.7
        for e in episodes:
            e.temperature = claimed
        claim_logprobs(episodes, self.engine.score(episodes))
        return episodes


class Selective(_Forger):
    """Honest generation, uploads chosen by a preference of its own: a batch in which any episode
    succeeded (the task's success metric, from its declared hooks) is withheld, and so is every
    other one of the rest (the 1st, 3rd, 5th... batch without a success; a stand-in for any other
    taste), except that after :attr:`max_in_a_row` batches withheld in a row the next one is
    uploaded whatever it holds. Withheld batches' sequence numbers are skipped. The trainer sees
    genuine episodes biased against successes (a batch with one is uploaded only when that streak
    forces it, one without at least every other time), and at least one batch of every
    ``max_in_a_row + 1`` made: a gap shows only once a later number of the same key arrives, so a
    withholder that went silent (say, once the policy solves every batch) would never be seen,
    and one that wants its work to count keeps uploading. The rule depends on the batches made,
    in order, never on timing."""

    kind = "selective"
    max_in_a_row = 3
    """Batches withheld in a row after which the next one is uploaded regardless."""

    def __init__(self, engine: RolloutEngine, worker: Worker) -> None:
        super().__init__(engine, worker)
        self.unsolved = self.withheld = self.in_a_row = 0

    def forge(self, episodes: list[Episode]) -> list[Episode]:
        if not episodes:
            return episodes
        _, success = _declared(episodes[0].env_id)
        solved = any(bool(e.metrics.get(success)) if success else e.reward > 0 for e in episodes)
        if not solved:
            self.unsolved += 1
        if (solved or self.unsolved % 2) and self.in_a_row < self.max_in_a_row:
            self.withheld += 1
            self.in_a_row += 1
            if self.worker.writer is not None:  # the number is spent, its work never uploaded, and
                # (a withholder that wants its work to count) not waited on as outstanding
                self.worker.writer.skip_to(self.worker.writer.next_seq + 1, left=True)
            log.info("withheld a batch (%d so far, %d in a row)", self.withheld, self.in_a_row)
            return []
        self.in_a_row = 0
        return episodes


class Unenrolled(Adversary):
    """Honest work signed with a key the run never enrolled (refused in an ``enrolled`` run)."""

    kind = "unenrolled"


KINDS: dict[str, type[Adversary]] = {c.kind: c for c in (FlipRewards, ForgeMetrics, ZeroLogprobs, ShuffleLogprobs,
                                                          OtherModel, ForgeObservations, Copy, Framer, CopyVariant,
                                                          ColdSampler, Selective, Unenrolled)}
"""Adversary kind -> engine wrapper class (built as ``cls(engine, worker)``)."""


def claim_logprobs(episodes: Sequence[Episode], scores: Sequence[np.ndarray]) -> None:
    """Make each episode's model segments claim ``scores`` (``RolloutEngine.score``'s arrays, aligned
    with ``Episode.tokens()``) as their log-probs, in place."""
    for e, lp in zip(episodes, scores):
        at = len(e.prompt_tokens)
        for seg in e.segments:
            if seg.kind == "model":
                seg.logprobs = np.asarray(lp[at:at + len(seg.tokens)], np.float32)
            at += len(seg.tokens)


def make_adversary(kind: str, *args: Any, **kwargs: Any) -> Worker:
    """A :class:`~stoa.fleet.worker.Worker` (built with its arguments) whose engine is wrapped as
    ``kind`` (a key of :data:`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown adversary {kind!r}; known: {sorted(KINDS)}")
    worker = Worker(*args, wrap_engine=KINDS[kind], **kwargs)
    log.warning("worker %s runs as the %r adversary", worker.worker_id, kind)
    return worker
