"""The review (stoa.fleet.trust.review and stoa.fleet.trust.audit, through the gate): the log-prob
audit and its fleet statistics, spot-checks on a real MLX engine, the whole audit path with a real
torch learner, the sampling check, and what is not a copy."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from stoa.fleet.trust.audit import LogprobAudit, TokenStats, episode_stats, spot_check
from stoa.fleet.trust.gate import TrustGate
from stoa.fleet.trust.section import TrustConfig
from stoa.fleet.trust.section import AuditConfig
from stoa.transport.signing import generate_private_key

from trust_helpers import AtVersion, Echo, RUN, assigned, batch_of, episodes, forge_logprobs


def test_which_episodes_are_audited_is_not_predictable_from_the_run_config():
    """Audit picks and random spot-checks used to come from an RNG seeded by the run's seed, which
    is in the world-readable config: a forger could forge exactly the episodes never scored."""

    class Picks:  # an honest-looking scorer that remembers what it was asked to score
        def __init__(self):
            self.asked: list[tuple[str, int]] = []

        def logprobs(self, eps, temperature=1.0, *, model_only=False):  # as FloatScorer declares it
            out = []
            for e in eps:
                self.asked.append((e.group_id, e.sample_index))
                lp = np.zeros(len(e.tokens()), np.float32)
                lp[e.loss_mask()] = e.behavior_logprobs()[e.loss_mask()]
                out.append(lp)
            return out

    runs = []
    for _ in range(2):  # two trainers of one run, built as the intake builds its gate
        scorer = Picks()
        gate = TrustGate(TrustConfig(), None, RUN, generate_private_key(), float_scorer=scorer)
        for i in range(20):
            assert gate.review([batch_of("k", "w", episodes("w", group=f"g{i}", n=8, seed=i), i)], 0) == [None]
        runs.append(scorer.asked)
    assert len(runs[0]) == len(runs[1]) == 40 and runs[0] != runs[1]


def test_the_honest_range_comes_from_the_fleet():
    audit = LogprobAudit(AuditConfig(episode_factor=8, worker_mads=6, min_tokens=100))
    assert audit.calibrate([TokenStats(1, 10, 0.01 * (1 + i % 3), 0.0) for i in range(100)]) == pytest.approx(0.003)
    for w, level in (("a", 0.02), ("b", 0.025), ("c", 0.03), ("d", 0.5)):
        for _ in range(5):
            audit.observe(w, 1, TokenStats(1, 40, 40 * level, 0.0))
    med, mad = audit.fleet("1")
    assert med == pytest.approx(0.0275) and mad == pytest.approx(0.005)
    assert [w for w in "abcd" if audit.worker_verdict(w)] == ["d"]
    assert audit.episode_verdict(1, TokenStats(1, 20, 20 * 0.1, 0.0)) is None
    assert "over 8x" in audit.episode_verdict(1, TokenStats(1, 20, 20 * 0.5, 0.0))
    assert "implausible" in audit.episode_verdict(0, TokenStats(1, 20, 0.0, 0.0, implausible=1))
    # Staleness buckets without fleet data fall back to the floor, grown with staleness.
    assert audit.reference("3+") == pytest.approx(4 * 0.003)
    back = LogprobAudit(audit.config)
    back.restore(json.loads(json.dumps(audit.state())))
    assert back.fleet("1") == audit.fleet("1") and back.floor == audit.floor


@pytest.fixture(scope="module")
def engine_and_episodes(tiny_model):
    import stoa.envs
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine

    engine = make_engine(tiny_model, "mlx", config=EngineConfig(max_batch=16), worker_id="w")
    make_env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", num_entities=20, num_test_facts=5)  # noqa: E731
    eps = engine.rollout(make_env, [RolloutRequest(i, f"w-{i}", 4) for i in range(4)],
                         SamplingConfig(max_turn_tokens=8, max_episode_tokens=160, seed=1))
    return engine, eps


def test_spot_checks_pass_honest_episodes_and_confirm_forged_log_probs(engine_and_episodes):
    engine, eps = engine_and_episodes
    ok = spot_check(engine.score, eps)
    assert not ok.confirmed and ok.worst < 1e-3, ok
    for how in ("zero", "shuffle"):
        bad = spot_check(engine.score, forge_logprobs(eps, how))
        assert bad.confirmed and bad.failed >= len(eps) // 2 and "do not match" in bad.detail, (how, bad)


def test_no_share_of_an_episodes_tokens_may_carry_forged_log_probs(engine_and_episodes):
    """A forger who rewrites under 5% of an episode's behaviour log-probs (the likeliest tokens,
    claimed 3 nats less likely: a 20x importance weight on each) used to pass: an episode failed
    only when more than 5% of its tokens were off."""
    import stoa.envs
    from stoa.backends.engine import RolloutRequest, SamplingConfig

    engine, _ = engine_and_episodes
    make_env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", num_entities=20, num_test_facts=5)  # noqa: E731
    long = [e for e in engine.rollout(make_env, [RolloutRequest(i, f"l-{i}", 4) for i in range(6)],
                                      SamplingConfig(max_turn_tokens=40, max_episode_tokens=400, seed=3))
            if e.num_model_tokens >= 40]
    assert len(long) >= 4
    forged = copy.deepcopy(long)
    for e in forged:
        model = [s for s in e.segments if s.kind == "model"]
        flat = np.concatenate([s.logprobs for s in model])
        k = max(1, int(0.04 * len(flat)))
        flat[np.argsort(flat)[::-1][:k]] -= 3.0
        at = 0
        for s in model:
            s.logprobs = flat[at:at + len(s.tokens)].astype(np.float32)
            at += len(s.tokens)
        assert k < 0.05 * len(flat)
    assert not spot_check(engine.score, forged, AuditConfig(spot_check_max_frac=0.05)).confirmed  # the old rule
    result = spot_check(engine.score, forged)
    assert result.confirmed and result.failed == len(forged), result.detail
    assert not spot_check(engine.score, long).confirmed  # honest episodes still pass, token by token


def test_the_gate_bans_forged_log_probs_before_any_is_trained(engine_and_episodes, tiny_model, tmp_path):
    """The whole audit path with a real learner (float log pi) and the int8 engine (spot-checks)."""
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.transport.store import LocalStore

    engine, eps = engine_and_episodes
    learner = make_learner("torch", tiny_model, LearnerConfig(threads=1))
    class Version0:  # the int8 policy of version 0 only (the one these episodes claim)
        def score(self, version, eps):
            return engine.score(eps) if version == 0 else None

    gate = TrustGate(TrustConfig(audit=AuditConfig(fraction=0.5, random_spot_check=0.0)), LocalStore(tmp_path), RUN,
                     generate_private_key(), float_scorer=learner, int8=Version0())
    floor = gate.calibrate(eps)  # scored by the learner it was given
    assert 0 < floor < 0.05  # int8 rounding only: the same weights, float and int8
    for kid, how, part in (("zk", "zero", eps[:8]), ("sk", "shuffle", eps[8:])):
        (verdict,) = gate.review([batch_of(kid, kid, forge_logprobs(part, how), 2)], 0)
        assert verdict.category == "audit" and "spot-check" in verdict.reason and gate.members.is_banned(kid), (how, verdict)
    honest = [batch_of("hk", "w", eps[:8]), batch_of("hk2", "v", eps[8:], 1)]
    assert gate.review(honest, 0) == [None, None]
    stats = episode_stats(learner.logprobs([eps[0]], temperature=None)[0], eps[0])
    assert stats.tokens == eps[0].num_model_tokens and stats.implausible == 0
    assert not gate.members.is_banned("hk") and gate.records["zk"].spot_check_failures == 1
    assert gate.metrics()["trust/banned_workers"] == 2.0


def test_after_a_restart_a_claimed_version_is_rebuilt_from_the_chain_or_the_batch_refused(tiny_model, tmp_path):
    """After --resume the trainer held no int8 state of the versions before the restart, and a
    flagged batch claiming one was accepted unchecked: forged log-probs trained after every restart."""
    import stoa.envs
    from stoa.backends.engine import RolloutRequest, SamplingConfig, make_engine
    from stoa.fleet.config import RolloutConfig
    from stoa.fleet.trainer.policies import HeldPolicies
    from stoa.testing.synthetic import perturb_codes
    from stoa.transport.chain import WeightPublisher
    from stoa.transport.store import LocalStore

    store, key, rng = LocalStore(tmp_path / "store"), generate_private_key(), np.random.default_rng(0)
    states = {0: {k: v.copy() for k, v in make_engine(tiny_model, "mlx").state.items()}}
    pub = WeightPublisher(store, RUN, key, anchor_every=50)
    pub.publish(0, states[0])
    for v in (1, 2, 3):
        states[v] = perturb_codes(states[v - 1], 0.05, rng)
        pub.publish(v, states[v])
    at1 = make_engine(tiny_model, "mlx", state=states[1], version=1)
    make_env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", num_entities=20, num_test_facts=5)  # noqa: E731
    eps = at1.rollout(make_env, [RolloutRequest(i, f"w-{i}", 2) for i in range(4)],
                      SamplingConfig(max_turn_tokens=8, max_episode_tokens=160, seed=2))
    # The restarted trainer holds only the version it resumed as.
    restarted = HeldPolicies(tiny_model, RolloutConfig(engine="mlx"), max_lag=2, directory=tmp_path / "held", chain=pub.subscriber)
    restarted.keep(3, states[3])
    for a, b in zip(restarted.score(1, eps), at1.score(eps)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert restarted.score(0, eps) is None  # older than max_lag: not claimable, never rebuilt

    forged = forge_logprobs(eps, "zero")
    for e in forged:
        e.policy_version = 0
    gate = TrustGate(TrustConfig(audit=AuditConfig(random_spot_check=1.0)), LocalStore(tmp_path / "s2"), RUN,
                     generate_private_key(), float_scorer=Echo(), int8=restarted)
    (verdict,) = gate.review([batch_of("fk", "f", forged, 1)], 3)
    assert verdict is not None and verdict.category == "unverifiable" and not verdict.ban, verdict
    gate.refused(None, "fk", "f", verdict.category, verdict.reason, episodes=len(forged))  # what the intake does with a verdict
    assert not gate.members.is_banned("fk") and gate.records["fk"].strikes == 0  # refused, not struck: maybe not its fault


def test_every_batch_has_its_draws_rederived_and_a_cold_sampler_is_banned(engine_and_episodes, tmp_path):
    """A worker sampling at a lower temperature while reporting honest log-probs (at the run's
    temperature) of what it drew passed every check: its log-probs re-score exactly."""
    import dataclasses

    import stoa.envs
    from stoa.backends.engine import RolloutRequest, SamplingConfig
    from stoa.transport.store import LocalStore

    engine, honest = engine_and_episodes  # sampled with seed 1
    make_env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", num_entities=20, num_test_facts=5)  # noqa: E731
    cold = engine.rollout(make_env, [RolloutRequest(i, f"w-{i}", 4) for i in range(4)],
                          SamplingConfig(temperature=0.7, max_turn_tokens=8, max_episode_tokens=160, seed=1))
    cold = [dataclasses.replace(e, temperature=1.0) for e in cold]
    for e, lp in zip(cold, engine.score(cold)):  # honest log-probs, at the claimed temperature, of what it drew
        at = len(e.prompt_tokens)
        for seg in e.segments:
            if seg.kind == "model":
                seg.logprobs = np.asarray(lp[at:at + len(seg.tokens)], np.float32)
            at += len(seg.tokens)
    assert not spot_check(engine.score, cold).confirmed  # the log-prob check alone cannot see it
    margins = engine.sampling_margins(honest, [1] * len(honest))
    assert all((m > -1e-5).all() for m in margins)  # every honest token is the rule's draw
    gate = TrustGate(TrustConfig(audit=AuditConfig(random_spot_check=0.0)), LocalStore(tmp_path), RUN,
                     generate_private_key(), float_scorer=Echo(), int8=AtVersion(engine))
    assert gate.review([batch_of("hk", "h", honest)], 0, [assigned(1)]) == [None]
    (verdict,) = gate.review([batch_of("ck", "c", cold, 1)], 0, [assigned(1)])
    assert verdict.category == "sampling" and "sampling rule does not draw" in verdict.reason and gate.members.is_banned("ck"), verdict
    assert gate.checks.counts["sampled_tokens_checked"] > 0 and gate.metrics()["trust/sampling_s"] >= 0


def test_a_variant_copy_is_caught_by_its_repeated_tokens(engine_and_episodes, tmp_path):
    """One sample of a group replaced by another's tokens under its index: a new group
    fingerprint from genuine episodes, so replay, audit and fingerprints all passed it."""
    from stoa.transport.store import LocalStore

    engine, honest = engine_and_episodes
    variant = copy.deepcopy(honest[:4])  # one group of 4 samples
    twin = copy.deepcopy(variant[0])
    twin.sample_index = variant[2].sample_index
    variant[2] = twin
    gate = TrustGate(TrustConfig(audit=AuditConfig(random_spot_check=0.0, sampling_episodes=0, every_episode=False)),
                     LocalStore(tmp_path),
                     RUN, generate_private_key(), float_scorer=Echo(), int8=AtVersion(engine))
    assert gate.review([batch_of("hk", "h", honest[4:8])], 0, [assigned(1)]) == [None]  # nothing repeated: nothing re-derived
    (verdict,) = gate.review([batch_of("vk", "v", variant, 1)], 0, [assigned(1)])
    assert verdict.category == "sampling" and gate.members.is_banned("vk"), verdict


def test_two_keys_whose_converged_policy_plays_alike_are_not_struck_for_copying(engine_and_episodes, tmp_path):
    """A converged (near-deterministic) policy gives two honest workers assigned the same item the
    same group; the group fingerprint struck the later one as a copier (seen in the demo at
    version 57). With assigned work a copy is the assignment's and the sampling check's business."""
    from stoa.transport.store import LocalStore

    engine, honest = engine_and_episodes
    gate = TrustGate(TrustConfig(audit=AuditConfig(random_spot_check=0.0)), LocalStore(tmp_path), RUN,
                     generate_private_key(), float_scorer=Echo(), int8=AtVersion(engine))
    alike = copy.deepcopy(honest[:4])
    for e in alike:
        e.worker_id = "b"
    assert gate.review([batch_of("ak", "a", honest[:4])], 0, [assigned(1)]) == [None]
    assert gate.review([batch_of("bk", "b", alike, 1)], 0, [assigned(1)]) == [None]  # later: no "copied" strike
    again = copy.deepcopy(alike)
    assert gate.review([batch_of("ak", "a", honest[:4], 2), batch_of("bk", "b", again, 3)], 0,
                       [assigned(1)] * 2) == [None, None]  # one poll
    assert gate.records["bk"].strikes == 0 and gate.records["ak"].strikes == 0


def test_repeated_episodes_share_a_forward_pass_but_keep_their_own_draws(engine_and_episodes):
    """Repeated episodes are scored as one row, and each still gets the margins of its own noise
    (as if scored alone)."""
    engine, honest = engine_and_episodes
    twins = [copy.deepcopy(honest[0]) for _ in range(3)]
    for i, e in enumerate(twins):
        e.sample_index = i + 7
    batch = [honest[1], *twins, honest[2]]
    together = engine.sampling_margins(batch, [1] * len(batch))
    alone = [engine.sampling_margins([e], [1])[0] for e in batch]
    assert all(np.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(together, alone))
    assert not np.array_equal(together[1], together[2])  # other sample indices, other noise
