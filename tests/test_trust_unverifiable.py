"""A scorer that times out is nobody's forgery (issue 56): episodes of a reasoning-gym task played
by a real engine, replayed by the trainer's real Replayer inside the real gate. When the worker's
scorer timed out and the trainer's did not, or the other way round, the episode is unverifiable:
its group is not trained, its key is not struck, and the report counts it; a forged reward still
strikes."""

from __future__ import annotations

import copy

import pytest

from stoa.fleet.trust.gate import TrustGate
from stoa.fleet.trust.replay import Replayer, Unverifiable
from stoa.fleet.trust.section import AuditConfig, TrustConfig
from stoa.transport.signing import generate_private_key

from trust_helpers import RUN, batch_of

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install 'stoa[reasoning-gym]'")
pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")

KW = dict(seed=0, train_size=8, test_size=2, system_prompt="", score_wall_seconds=30.0)
CAPS = dict(max_turn_tokens=12, max_episode_tokens=400)


def _env(timing_out: bool = False):
    """The task; with ``timing_out`` its scorer answers as a sandbox killed at its limit does."""
    import stoa.envs

    env = stoa.envs.make("reasoning_gym:basic_arithmetic", **KW)
    if timing_out:
        env.unwrapped.score = lambda answer, entry: (0.0, "timeout")
    return env


@pytest.fixture(scope="module")
def played(tiny_model):
    """Two groups of two episodes each: group ``a`` played by a worker whose scorer timed out,
    group ``b`` by one whose scorer worked; and the engine's codec."""
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine

    engine = make_engine(tiny_model, "mlx", config=EngineConfig(max_batch=4), worker_id="w")
    sampling = SamplingConfig(**CAPS, seed=1)
    a = engine.rollout(lambda: _env(timing_out=True), [RolloutRequest(0, "a", 2)], sampling)
    b = engine.rollout(_env, [RolloutRequest(1, "b", 2)], sampling)
    assert all(e.metrics["score_error"] == "timeout" for e in a)
    assert all(e.metrics["score_error"] == "" for e in b)
    return a, b, engine.codec


def _gate(codec, trainer_times_out: bool = False) -> TrustGate:
    replayer = Replayer(lambda: _env(timing_out=trainer_times_out), codec, **CAPS)
    return TrustGate(TrustConfig(audit=AuditConfig(enabled=False), ban_after=1), None, RUN, generate_private_key(),
                     replayer=replayer)


def test_the_task_declares_which_outcomes_depend_on_the_machine():
    from stoa.envs.sandbox import INDETERMINATE

    assert _env().unwrapped.indeterminate_metrics == {"score_error": INDETERMINATE}


def test_a_worker_whose_scorer_timed_out_is_not_struck_and_that_group_is_not_trained(played):
    a, b, codec = played
    gate = _gate(codec)
    bad, unverifiable = gate.checks.replayer.triage(a + b)
    assert bad == [] and [i for i, _ in unverifiable] == [0, 1]
    assert all(isinstance(w, Unverifiable) and "score_error='timeout'" in w for _, w in unverifiable)
    batch = batch_of("k", "w", copy.deepcopy(a + b))
    untrained: dict[str, set[str]] = {}
    assert gate.review([batch], 0, untrained=untrained) == [None]  # the rest of the batch is verified and admitted
    assert untrained == {batch.key: {"a"}}  # the intake pools only group b
    rec = gate.records["k"]
    assert (rec.strikes, rec.rejected_batches, rec.unverifiable_episodes, rec.accepted_episodes) == (0, 0, 2, 2)
    assert gate.metrics()["trust/unverifiable_episodes"] == 2.0
    assert gate.report(0).workers["k"].unverifiable_episodes == 2
    # A batch of nothing but unverifiable episodes is refused as such, without a strike.
    (verdict,) = gate.review([batch_of("k", "w", copy.deepcopy(a), seq=1)], 0)
    assert verdict is not None and verdict.category == "unverifiable" and not verdict.ban
    assert "cannot be verified" in verdict.reason
    gate.refused(None, "k", "w", verdict.category, verdict.reason, 2)
    assert gate.records["k"].strikes == 0 and not gate.members.is_banned("k")


def test_a_trainer_whose_scorer_timed_out_strikes_no_honest_worker(played):
    _, b, codec = played
    gate = _gate(codec, trainer_times_out=True)
    (verdict,) = gate.review([batch_of("k", "w", copy.deepcopy(b))], 0)
    assert verdict is not None and verdict.category == "unverifiable" and "replay's outcome" in verdict.reason
    assert gate.records["k"].strikes == 0 and gate.records["k"].unverifiable_episodes == 2


def test_a_forged_reward_still_strikes(played):
    a, b, codec = played
    gate = _gate(codec)
    forged = copy.deepcopy(a + b)
    forged[2].reward = 1.0  # group b: its scorer gave 0
    (verdict,) = gate.review([batch_of("k", "w", forged)], 0)
    assert verdict is not None and verdict.category == "replay" and "reward" in verdict.reason
    gate.refused(None, "k", "w", verdict.category, verdict.reason, len(forged))
    assert gate.records["k"].strikes == 1 and gate.members.is_banned("k")  # ban_after = 1
    # Claiming a timeout hides nothing: such an episode is never trained either.
    claimed = copy.deepcopy(b)
    for e in claimed:
        e.metrics["score_error"], e.reward = "timeout", 1.0
    _, unverifiable = _gate(codec).checks.replayer.triage(claimed)
    assert len(unverifiable) == 2 and "claimed outcome" in unverifiable[0][1]
