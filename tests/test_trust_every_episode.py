"""Every accepted episode is checked (``audit.every_episode``): its sampled tokens re-derived from
the assigned seed and its claimed log mu compared with the int8 re-score, from one forward pass.

With one random episode re-derived per batch (and the learner's audit choosing spot-checks), an
attacker who changed one episode of each batch got through (N-1)/N of the time: hand-written
text carrying honest int8 log-probs, a few forged log-probs, a best-of-K reroll. Each is here,
in every batch of a run of batches, and each batch must be refused with a ban."""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")

from stoa.fleet.trust.gate import TrustGate
from stoa.fleet.trust.section import TrustConfig  # noqa: E402
from stoa.fleet.trust.section import AuditConfig  # noqa: E402
from stoa.transport.signing import generate_private_key  # noqa: E402

from trust_helpers import RUN, AtVersion, Echo, assigned, batch_of  # noqa: E402

GROUPS = 6
"""Batches per attack: one group of 4 episodes each, one episode changed in each."""


def _make_env():
    import stoa.envs

    return stoa.envs.make("stoa/SyntheticSearch-v0", num_entities=20, num_test_facts=5)


def _play(engine, seed: int, prefix: str = "w"):
    from stoa.backends.engine import RolloutRequest, SamplingConfig

    return engine.rollout(_make_env, [RolloutRequest(i, f"{prefix}-{i}", 4) for i in range(GROUPS)],
                          SamplingConfig(max_turn_tokens=12, max_episode_tokens=200, seed=seed))


@pytest.fixture(scope="module")
def engine_and_groups(tiny_model):
    from stoa.backends.engine import EngineConfig, make_engine

    engine = make_engine(tiny_model, "mlx", config=EngineConfig(max_batch=24), worker_id="w")
    eps = _play(engine, 1)
    return engine, [eps[4 * g:4 * g + 4] for g in range(GROUPS)]


def _honest_logprobs(engine, ep):
    """``ep`` with the int8 policy's own log-probs at every model token (what an honest worker reports)."""
    (lp,) = engine.score([ep])
    at = len(ep.prompt_tokens)
    for seg in ep.segments:
        if seg.kind == "model":
            seg.logprobs = np.asarray(lp[at:at + len(seg.tokens)], np.float32)
        at += len(seg.tokens)
    return ep


def _gate(engine, tmp_path, **audit):
    from stoa.transport.store import LocalStore

    return TrustGate(TrustConfig(audit=AuditConfig(random_spot_check=0.0, **audit)), LocalStore(tmp_path), RUN,
                     generate_private_key(), float_scorer=Echo(), int8=AtVersion(engine))


def _judge(gate, batches, kid: str):
    """Each batch under its own key (a ban ends a key): the verdicts."""
    return [gate.review([batch_of(f"{kid}{i}", f"{kid}{i}", b, i)], 0, [assigned(1)])[0]
            for i, b in enumerate(batches)]


def test_honest_batches_pass_and_every_episode_is_checked(engine_and_groups, tmp_path):
    engine, groups = engine_and_groups
    gate = _gate(engine, tmp_path)
    assert _judge(gate, groups, "h") == [None] * GROUPS
    m = gate.metrics()
    assert m["trust/episodes_checked"] == 4 * GROUPS and m["trust/episodes_audited"] == 0
    assert m["trust/sampled_tokens_checked"] == sum(e.num_model_tokens for g in groups for e in g)
    assert m["trust/sampling_violations"] == 0 and m["trust/episode_check_s"] > 0
    assert 0.0 <= m["trust/claim_gap_max"] < AuditConfig().spot_check_tolerance  # an honest engine's numerics
    # so the intake takes no group prints of a sealed batch (a repeated group is refused here unless
    # it is the draws); an unsealed one, or with every_episode off, keeps them
    assert gate.checks.draws_every_episode("h0") and not gate.checks.draws_every_episode("")
    assert not _gate(engine, tmp_path, every_episode=False).checks.draws_every_episode("h0")


def test_one_hand_written_episode_per_batch_with_honest_log_probs_is_banned(engine_and_groups, tmp_path):
    """One episode per batch whose model turns are text of the attacker's choosing (a gold
    answer), with the int8 policy's honest log-probs of that text: the log-probs re-score."""
    engine, groups = engine_and_groups
    rng = np.random.default_rng(0)
    batches = []
    for g in groups:
        b = copy.deepcopy(g)
        i = int(rng.integers(len(b)))
        seg = [s for s in b[i].segments if s.kind == "model"][-1]
        seg.tokens = np.array(engine.encode("<answer> Kavorin </answer>"), np.int32)
        seg.logprobs = np.zeros(len(seg.tokens), np.float32)
        b[i] = _honest_logprobs(engine, b[i])
        batches.append(b)
    verdicts = _judge(_gate(engine, tmp_path), batches, "gold")
    assert all(v is not None and v.category == "sampling" and v.ban for v in verdicts), verdicts


def test_a_few_forged_log_probs_in_one_episode_per_batch_are_banned(engine_and_groups, tmp_path):
    """One episode per batch with its likeliest 4% of tokens (at least one) claimed 3 nats less
    likely: a 20x importance weight where the learner trusts the claim most."""
    engine, groups = engine_and_groups
    rng = np.random.default_rng(1)
    batches = []
    for g in groups:
        b = copy.deepcopy(g)
        e = b[int(rng.integers(len(b)))]
        model = [s for s in e.segments if s.kind == "model"]
        flat = np.concatenate([s.logprobs for s in model])
        flat[np.argsort(flat)[::-1][:max(1, int(0.04 * flat.size))]] -= 3.0
        at = 0
        for s in model:
            s.logprobs = flat[at:at + len(s.tokens)].astype(np.float32)
            at += len(s.tokens)
        batches.append(b)
    verdicts = _judge(_gate(engine, tmp_path), batches, "few")
    assert all(v is not None and v.category == "audit" and v.ban and "do not match" in v.reason
               for v in verdicts), verdicts


def test_a_best_of_k_episode_per_batch_is_banned(engine_and_groups, tmp_path):
    """One episode per batch is the best of several rerolls (other seeds, the same item), relabelled
    as the assigned sample: a genuine draw of the policy with honest log-probs, of the wrong noise."""
    engine, groups = engine_and_groups
    rerolls = [_play(engine, seed) for seed in (2, 3, 4)]
    batches = []
    for g, group in enumerate(groups):
        b = copy.deepcopy(group)
        best = max((r[4 * g + k] for r in rerolls for k in range(4)), key=lambda e: (e.reward, e.num_model_tokens))
        twin = copy.deepcopy(best)
        twin.group_id, twin.sample_index = b[0].group_id, b[0].sample_index
        b[0] = twin
        batches.append(b)
    verdicts = _judge(_gate(engine, tmp_path), batches, "best")
    assert all(v is not None and v.category == "sampling" and v.ban for v in verdicts), verdicts


def test_with_every_episode_off_one_random_episode_is_rederived(engine_and_groups, tmp_path):
    """``every_episode = false``: the learner's audit and ``sampling_episodes`` random episodes
    (the cheaper, weaker configuration) still run."""
    engine, groups = engine_and_groups
    gate = _gate(engine, tmp_path, every_episode=False)
    assert _judge(gate, groups[:2], "h") == [None, None]
    m = gate.metrics()
    assert m["trust/episodes_checked"] == 0 and m["trust/episodes_audited"] == 2
    assert 0 < m["trust/sampled_tokens_checked"] < sum(e.num_model_tokens for g in groups[:2] for e in g)
