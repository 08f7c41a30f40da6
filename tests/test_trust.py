"""Untrusted workers, piece by piece: sealed batches, the roster, the reader's identity and
duplicate checks, the trainer's gate (copies, strikes, bans, share cap), and the log-prob audit
with spot-checks on a real MLX engine and a real torch learner."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import replace

import numpy as np
import pytest

from stoa.fleet.trust.audit import AuditConfig, LogprobAudit, TokenStats, episode_stats, spot_check
from stoa.fleet.trust import TrustConfig
from stoa.fleet.intake.copies import group_prints
from stoa.fleet.trust import TrustGate, Verdict, read_trust_report, scoped
from stoa.transport.exchange import Batch, RolloutReader, RolloutWriter, rollout_key
from stoa.transport.identity import (
    SealError,
    ban_worker,
    public_hex,
    enroll_worker,
    open_sealed,
    read_roster,
    roster_key,
    seal_batch,
)
from stoa.transport.signing import SignatureError, generate_private_key, key_id
from stoa.types import Episode, Segment, encode_episodes

RUN = "runs/t"


def episodes(worker: str, version: int = 0, group: str = "g", n: int = 2, seed: int = 0) -> list[Episode]:
    rng = np.random.default_rng(seed)
    return [Episode(rng.integers(0, 50, 5), [Segment("model", rng.integers(0, 50, 4), -rng.random(4))],
                    reward=float(i), policy_version=version, worker_id=worker, group_id=group, sample_index=i)
            for i in range(n)]


# -- sealed batches -----------------------------------------------------------------------------


def test_a_seal_binds_bytes_key_worker_run_seq_and_version():
    key = generate_private_key()
    payload = encode_episodes(episodes("w"))
    blob = seal_batch(payload, run=RUN, worker_id="w", seq=3, version=7, private_key=key)
    seal, got = open_sealed(blob)
    assert got == payload and (seal.run, seal.worker_id, seal.seq, seal.version) == (RUN, "w", 3, 7)
    assert seal.key_id == key_id(key.public_key())
    other = encode_episodes(episodes("w", seed=1))
    header = blob[: len(blob) - len(payload)]
    for bad, needle in [(payload, "not a sealed batch"), (header + other, "altered"), (blob[:20], "truncated"),
                        (blob.replace(b'\\"seq\\":3', b'\\"seq\\":4'), "bad ed25519 signature"),
                        (blob[:9] + b"{}" + blob[11:], "public key")]:
        with pytest.raises(SealError, match=needle):
            open_sealed(bad)


def test_the_reader_checks_seals_against_names_and_the_roster(store):
    me, other = generate_private_key(), generate_private_key()
    w = RolloutWriter(store, RUN, "w", private_key=me)
    good = w.upload(episodes("w"), 0)
    blob = store.get(good)
    store.put(rollout_key(RUN, "x", 0, 0), blob)  # a genuine batch copied under another worker's name
    store.put(rollout_key(RUN, "w", 5, 0), encode_episodes(episodes("w", seed=2)))  # unsigned
    RolloutWriter(store, RUN, "z", private_key=other).upload(episodes("z"), 0)  # a key the policy refuses
    allowed = {w.key_id}
    def screen(s):  # the intake's rule (an enrolled roster), as the reader's caller gives it
        if s is None:
            return "unsigned", "unsigned batch"
        return None if s.key_id in allowed else ("refused", f"key {s.key_id} unknown")

    reader = RolloutReader(store, RUN, screen=screen)
    (batch,) = reader.poll()
    assert batch.key == good and batch.key_id == w.key_id and len(batch.sha256) == 64
    why = {r.key.split("/")[-2]: (r.category, r.reason) for r in reader.last_report.rejected}
    assert why["x"][0] == "signature" and "copied or renamed" in why["x"][1]
    assert why["w"][0] == "unsigned" and why["z"][0] == "refused" and "unknown" in why["z"][1]
    reasons = [json.loads(store.get(k))["reason"] for k in store.list(f"{RUN}/quarantine/") if k.endswith(".json")]
    assert len(reasons) == 3


# -- the roster -----------------------------------------------------------------------------------


def test_enroll_and_ban_edit_the_signed_roster(tmp_path):
    from stoa.transport.store import LocalStore

    store, run_key = LocalStore(tmp_path), generate_private_key()
    a, b = generate_private_key(), generate_private_key()
    assert read_roster(store, RUN, run_key.public_key()).enrolled == {}
    enroll_worker(store, RUN, run_key, a, "alice")
    r = enroll_worker(store, RUN, run_key, b.public_key(), "bob", note="lab mac")
    assert r.revision == 2 and r.key_for("bob") == key_id(b.public_key()) and r.enrolled[r.key_for("bob")].note == "lab mac"
    with pytest.raises(ValueError, match="already bound"):
        enroll_worker(store, RUN, run_key, generate_private_key(), "alice")
    ban_worker(store, RUN, run_key, "alice", "forged rewards")
    r = read_roster(store, RUN, run_key.public_key())
    assert r.banned[key_id(a.public_key())].reason == "forged rewards" and r.banned[key_id(a.public_key())].worker_id == "alice"
    with pytest.raises(ValueError, match="banned"):
        enroll_worker(store, RUN, run_key, a, "alice2")
    blob = store.get(roster_key(RUN))
    store.put(roster_key(RUN), blob.replace(b"forged rewards", b"just kidding!!"))
    with pytest.raises(SignatureError):
        read_roster(store, RUN, run_key.public_key())


def _seal(key, worker: str):
    return open_sealed(seal_batch(b"x", run=RUN, worker_id=worker, seq=0, version=0, private_key=key))[0]


def test_the_gate_admits_by_mode_roster_and_first_use(tmp_path):
    from stoa.transport.store import LocalStore

    store, run_key = LocalStore(tmp_path), generate_private_key()
    alice, bob, eve = generate_private_key(), generate_private_key(), generate_private_key()
    enroll_worker(store, RUN, run_key, alice, "alice")
    closed = TrustGate(TrustConfig(mode="enrolled"), store, RUN, run_key)
    closed.refresh(force=True)
    assert closed.admit(_seal(alice, "alice")) is None
    assert "not enrolled" in closed.admit(_seal(bob, "bob"))
    assert "impersonation" in closed.admit(_seal(eve, "alice"))
    assert "bound to worker id 'alice'" in closed.admit(_seal(alice, "mallory"))
    assert "--id alice" in closed.admit(_seal(alice, "mallory"))  # the way out, in the refusal itself
    opened = TrustGate(TrustConfig(mode="open"), store, RUN, run_key)
    opened.refresh(force=True)
    assert opened.admit(_seal(bob, "bob")) is None  # reviewed ...
    assert opened.admit(_seal(eve, "bob")) is None  # ... and so is a second key under the same id,
    assert opened.review([_sealed_batch(bob, "bob", episodes("bob"))], 0) == [None]  # until one is accepted:
    assert "impersonation" in opened.admit(_seal(eve, "bob"))  # then nobody else can be bob
    opened.refresh(force=True)  # the binding is written to the signed roster
    roster = read_roster(store, RUN, run_key.public_key())
    assert roster.enrolled[key_id(bob.public_key())].source == "first-use"
    ban_worker(store, RUN, run_key, "bob", "by hand")  # `stoa ban` while the run is live
    opened.refresh(force=True)
    assert "banned" in opened.admit(_seal(bob, "bob"))


def _sealed_batch(key, worker: str, eps: list[Episode], seq: int = 0) -> Batch:
    pub = public_hex(key.public_key())
    return Batch(f"{RUN}/rollouts/{worker}/s{seq:012d}-v000000000000.episodes", worker, 0, eps, seq,
                 key_id(key.public_key()), "", pub)


def test_an_id_is_bound_only_by_accepted_work_so_junk_squats_nothing(tmp_path):
    """A sealed junk batch under a victim's id used to bind that id to the attacker for good,
    although the batch was refused: the roster bound ids when the seal was read."""
    from stoa.transport.store import LocalStore

    store, run_key = LocalStore(tmp_path), generate_private_key()
    squatter, owner = generate_private_key(), generate_private_key()
    gate = TrustGate(TrustConfig(), store, RUN, run_key)
    gate.refresh(force=True)
    assert gate.admit(_seal(squatter, "alice")) is None
    junk = _sealed_batch(squatter, "alice", episodes("alice"))
    gate.reject(junk.key_id, "alice", "invalid", "junk")  # what the intake does with a batch failing its checks
    honest = episodes("alice", group="own", seed=3)
    copied = _sealed_batch(squatter, "alice", honest, 1)
    mine = _sealed_batch(owner, "alice", copy.deepcopy(honest), 1)
    gate.review([mine], 0)  # the owner's work is accepted and binds the id ...
    (verdict,) = gate.review([copied], 0)  # (the trainer's intake refuses it earlier: not the squatter's assigned work)
    assert verdict.category == "refused" and "by its accepted work first" in verdict.reason
    gate.refresh(force=True)
    roster = read_roster(store, RUN, run_key.public_key())
    assert roster.key_for("alice") == key_id(owner.public_key()) and key_id(squatter.public_key()) not in roster.enrolled
    assert "impersonation" in gate.admit(_seal(squatter, "alice"))  # ... and the squatter is shut out of it


# -- the gate's review ------------------------------------------------------------------------------


def _batch(kid: str, worker: str, eps: list[Episode], seq: int = 0) -> Batch:
    return Batch(f"{RUN}/rollouts/{worker}/s{seq:012d}-v000000000000.episodes", worker, 0, eps, seq, kid)


class _ListLedger:
    def __init__(self, entries: list[dict]):
        self.entries = entries

    def write(self, **entry):
        self.entries.append(entry)


def test_strikes_ban_a_key_and_the_ban_survives_a_checkpoint(tmp_path):
    from stoa.transport.store import LocalStore

    ledger: list[dict] = []
    gate = TrustGate(TrustConfig(ban_after=2), LocalStore(tmp_path), RUN, generate_private_key(),
                     ledger=_ListLedger(ledger))
    honest = [episodes("h", group=f"h{i}", seed=i) for i in range(3)]
    assert gate.review([_batch("hk", "h", honest[0]), _batch("hk", "h", honest[1], 1)], 0) == [None, None]
    copy_reason = "duplicate: repeats a group this key uploaded in an earlier batch"
    gate.reject("ck", "c", "duplicate", copy_reason, episodes=2)  # what the intake does with a copy
    assert not gate.is_banned("ck") and gate.records["ck"].strikes == 1
    gate.reject("ck", "c", "duplicate", copy_reason, episodes=2)
    assert gate.is_banned("ck") and gate.take_new_bans() == [("ck", "c", gate.records["ck"].banned)]
    assert ledger[-1]["banned"] == "ck" and gate.take_new_bans() == []
    assert gate.review([_batch("ck", "c", honest[2], 2)], 0) == [Verdict("refused", "key ck is banned")]
    assert gate.records["hk"].accepted_batches == 2 and gate.records["hk"].rejected_batches == 0
    gate.write_report(3, force=True)
    report = read_trust_report(gate.store, RUN, gate.key.public_key())
    assert report.workers["ck"].banned and report.workers["ck"].rejected == {"duplicate": 2}
    assert report.workers["ck"].rejected_episodes == 4 and report.version == 3
    state = json.loads(json.dumps(gate.state()))
    fresh = TrustGate(TrustConfig(), gate.store, RUN, gate.key)
    fresh.restore(state)
    assert fresh.is_banned("ck") and fresh.records["hk"].accepted_batches == 2


def test_identical_samples_are_no_copy_and_groups_live_in_their_senders_namespace():
    same = episodes("a", n=1) * 3
    assert group_prints(same) == []  # a near-deterministic group may repeat itself
    assert group_prints(episodes("a")) == group_prints(episodes("b", group="other"))
    assert scoped("k1", "g") != scoped("k2", "g") and scoped("", "g") == "g"
    gate = TrustGate(TrustConfig(max_worker_share=0.5), None, RUN, generate_private_key())
    assert gate.max_groups(8) == 4 and gate.max_groups(1) == 1


def test_which_episodes_are_audited_is_not_predictable_from_the_run_config():
    """Audit picks and random spot-checks used to come from an RNG seeded by the run's seed, which
    is in the world-readable config: a forger could forge exactly the episodes never scored."""

    class Picks:  # an honest-looking scorer that remembers what it was asked to score
        def __init__(self):
            self.asked: list[tuple[str, int]] = []

        def logprobs(self, eps, temperature=1.0):  # no model_only: the gate scores every token then
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
            assert gate.review([_batch("k", "w", episodes("w", group=f"g{i}", n=8, seed=i), i)], 0) == [None]
        runs.append(scorer.asked)
    assert len(runs[0]) == len(runs[1]) == 40 and runs[0] != runs[1]


def test_a_full_ban_list_never_crashes_the_trainer(tmp_path):
    from stoa.transport.identity import _MAX_ROSTER, Ban
    from stoa.transport.store import LocalStore

    gate = TrustGate(TrustConfig(), LocalStore(tmp_path), RUN, generate_private_key())
    for i in range(_MAX_ROSTER):
        gate.roster = gate.roster.with_ban(f"{i:016x}", Ban("x", "old", 0.0, 0))
    cheat = generate_private_key()
    kid = key_id(cheat.public_key())
    gate.ban(kid, "forged log-probs")  # raised ValueError("the ban list is full") out of the trainer before
    assert gate.is_banned(kid) and "banned" in gate.admit(_seal(cheat, "cheat"))


# -- the audit -----------------------------------------------------------------------------------


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


mlx = pytest.importorskip("mlx.core", reason="spot-checks re-score with the MLX engine")


@pytest.fixture(scope="module")
def engine_and_episodes(tiny_model):
    import stoa.envs
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine

    engine = make_engine(tiny_model, "mlx", config=EngineConfig(max_batch=16), worker_id="w")
    make_env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", num_entities=20, num_test_facts=5)  # noqa: E731
    eps = engine.rollout(make_env, [RolloutRequest(i, f"w-{i}", 4) for i in range(4)],
                         SamplingConfig(max_turn_tokens=8, max_episode_tokens=160, seed=1))
    return engine, eps


def _forged(eps: list[Episode], how: str) -> list[Episode]:
    out = copy.deepcopy(eps)
    rng = np.random.default_rng(0)
    for e in out:
        for s in e.segments:
            if s.kind == "model":
                s.logprobs = np.zeros_like(s.logprobs) if how == "zero" else rng.permutation(s.logprobs)
    return out


def test_spot_checks_pass_honest_episodes_and_confirm_forged_log_probs(engine_and_episodes):
    engine, eps = engine_and_episodes
    ok = spot_check(engine.score, eps)
    assert not ok.confirmed and ok.worst < 1e-3, ok
    for how in ("zero", "shuffle"):
        bad = spot_check(engine.score, _forged(eps, how))
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
    floor = gate.calibrate(eps, learner.logprobs(eps, temperature=None))
    assert 0 < floor < 0.05  # int8 rounding only: the same weights, float and int8
    for kid, how, part in (("zk", "zero", eps[:8]), ("sk", "shuffle", eps[8:])):
        (verdict,) = gate.review([_batch(kid, kid, _forged(part, how), 2)], 0)
        assert verdict.category == "audit" and "spot-check" in verdict.reason and gate.is_banned(kid), (how, verdict)
    honest = [_batch("hk", "w", eps[:8]), _batch("hk2", "v", eps[8:], 1)]
    assert gate.review(honest, 0) == [None, None]
    stats = episode_stats(learner.logprobs([eps[0]], temperature=None)[0], eps[0])
    assert stats.tokens == eps[0].num_model_tokens and stats.implausible == 0
    assert not gate.is_banned("hk") and gate.records["zk"].spot_check_failures == 1
    assert gate.metrics()["trust/banned_workers"] == 2.0


def test_keygen_enroll_and_ban_from_the_command_line(tmp_path):
    import subprocess
    import sys

    from stoa.transport.signing import load_private_key
    from stoa.transport.store import LocalStore

    def stoa(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "stoa", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    keys, store = tmp_path / "keys", tmp_path / "store"
    stoa("keygen", str(keys))
    assert "stoa worker --key" in stoa("keygen", str(keys), "--worker", "--name", "alice")
    common = ["--store", str(store), "--run", RUN, "--key", str(keys / "run.key")]
    stoa("enroll", str(keys / "alice.pub"), *common, "--worker-id", "alice")
    assert "banned alice" in stoa("ban", "alice", *common, "--reason", "forged rewards")
    roster = read_roster(LocalStore(store), RUN, load_private_key(keys / "run.key").public_key())
    kid = key_id(load_private_key(keys / "alice.key").public_key())
    assert roster.enrolled[kid].worker_id == "alice" and roster.banned[kid].reason == "forged rewards"


def test_every_adversary_keeps_the_workers_method_signatures():
    # The worker loop calls its hooks with their own arguments (``_sync(version)`` since the forced
    # lag); an adversary overriding one with an older signature crashed, under load, before it
    # uploaded anything, and the fleet test then found no record of it.
    import inspect

    from stoa.fleet.worker import Worker
    from stoa.testing.adversaries import KINDS

    for kind, cls in KINDS.items():
        for name, fn in vars(cls).items():
            base = getattr(Worker, name, None)
            if callable(fn) and callable(base) and not name.startswith("__"):
                params = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
                assert params(fn) == params(base), (kind, name)


def test_after_a_restart_a_claimed_version_is_rebuilt_from_the_chain_or_the_batch_refused(tiny_model, tmp_path):
    """After --resume the trainer held no int8 state of the versions before the restart, and a
    flagged batch claiming one was accepted unchecked: forged log-probs trained after every restart."""
    import stoa.envs
    from stoa.backends.engine import RolloutRequest, SamplingConfig, make_engine
    from stoa.fleet.config import RolloutConfig
    from stoa.fleet.policies import HeldPolicies
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
    restarted = HeldPolicies(tiny_model, RolloutConfig(), max_lag=2, directory=tmp_path / "held", chain=pub.subscriber)
    restarted.keep(3, states[3])
    for a, b in zip(restarted.score(1, eps), at1.score(eps)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert restarted.score(0, eps) is None  # older than max_lag: not claimable, never rebuilt

    forged = _forged(eps, "zero")
    for e in forged:
        e.policy_version = 0
    gate = TrustGate(TrustConfig(audit=AuditConfig(random_spot_check=1.0)), LocalStore(tmp_path / "s2"), RUN,
                     generate_private_key(), float_scorer=_Echo(), int8=restarted)
    (verdict,) = gate.review([_batch("fk", "f", forged, 1)], 3)
    assert verdict is not None and verdict.category == "unverifiable" and not verdict.ban, verdict
    gate.reject("fk", "f", verdict.category, verdict.reason, episodes=len(forged))  # what the intake does with a verdict
    assert not gate.is_banned("fk") and gate.records["fk"].strikes == 0  # refused, not struck: maybe not its fault


class _Echo:
    """A float policy that agrees with every claim (so only the spot-check decides)."""

    def logprobs(self, eps, temperature=1.0, model_only=False):
        out = []
        for e in eps:
            lp = np.zeros(len(e.tokens()), np.float32)
            lp[e.loss_mask()] = e.behavior_logprobs()[e.loss_mask()]
            out.append(lp)
        return out


# -- trust v2: assigned work, every sampled token checkable, withholding ---------------------------


def test_a_batch_is_its_keys_assignment_and_nobody_elses():
    """Framing and copies: a victim's batch re-signed under another key is not that key's work,
    whatever its contents, so the copier is refused and the victim is never compared with it."""
    from stoa.fleet.trust.assign import assignment, assignment_problem

    a = assignment(7, "aaaa", 3, n_items=100, groups=2)
    assert a == assignment(7, "aaaa", 3, n_items=100, groups=2)  # public and deterministic
    assert a != assignment(7, "bbbb", 3, n_items=100, groups=2) and a != assignment(7, "aaaa", 4, 100, 2)
    eps = [Episode(np.arange(5), [Segment("model", np.arange(3), -np.ones(3))], 0.0, group_id=g, sample_index=s,
                   item_index=i) for g, i in zip(a.group_ids, a.items) for s in range(4)]
    assert assignment_problem(eps, a, 4) is None
    assert "not one this batch was assigned" in assignment_problem(eps, assignment(7, "bbbb", 3, 100, 2), 4)
    easy = copy.deepcopy(eps)
    easy[0].item_index = (easy[0].item_index + 1) % 100  # a prompt of its own choosing
    assert "assigned item" in assignment_problem(easy, a, 4)
    assert "of its 4 samples" in assignment_problem(eps[1:], a, 4)  # a group cut short
    twice = copy.deepcopy(eps)
    twice[1].sample_index = 0
    assert "appears twice" in assignment_problem(twice, a, 4)


class _AtVersion:
    """The int8 policy of one version (what these episodes claim)."""

    def __init__(self, engine, version=0):
        self.engine, self.version = engine, version

    def score(self, version, eps):
        return self.engine.score(eps) if version == self.version else None

    def sampling_margins(self, version, eps, seeds):
        return self.engine.sampling_margins(eps, seeds) if version == self.version else None


def _assigned(seed):
    from stoa.fleet.trust.assign import Assignment

    return lambda b: Assignment((), (), seed)


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
    assert all((m > 0).all() for m in margins)  # every honest token is the rule's draw
    gate = TrustGate(TrustConfig(audit=AuditConfig(random_spot_check=0.0)), LocalStore(tmp_path), RUN,
                     generate_private_key(), float_scorer=_Echo(), int8=_AtVersion(engine), assign=_assigned(1))
    assert gate.review([_batch("hk", "h", honest)], 0) == [None]
    (verdict,) = gate.review([_batch("ck", "c", cold, 1)], 0)
    assert verdict.category == "sampling" and "sampling rule does not draw" in verdict.reason and gate.is_banned("ck"), verdict
    assert gate.counts["sampled_tokens_checked"] > 0 and gate.metrics()["trust/sampling_s"] >= 0


def test_a_variant_copy_is_caught_by_its_repeated_tokens(engine_and_episodes, tmp_path):
    """One sample of a group replaced by another's tokens under its index: a new group
    fingerprint from genuine episodes, so replay, audit and fingerprints all passed it."""
    from stoa.transport.store import LocalStore

    engine, honest = engine_and_episodes
    variant = copy.deepcopy(honest[:4])  # one group of 4 samples
    twin = copy.deepcopy(variant[0])
    twin.sample_index = variant[2].sample_index
    variant[2] = twin
    gate = TrustGate(TrustConfig(audit=AuditConfig(random_spot_check=0.0, sampling_episodes=0)), LocalStore(tmp_path),
                     RUN, generate_private_key(), float_scorer=_Echo(), int8=_AtVersion(engine), assign=_assigned(1))
    assert gate.review([_batch("hk", "h", honest[4:8])], 0) == [None]  # nothing repeated: nothing re-derived
    (verdict,) = gate.review([_batch("vk", "v", variant, 1)], 0)
    assert verdict.category == "sampling" and gate.is_banned("vk"), verdict


def test_gaps_in_a_keys_sequence_numbers_are_counted_and_a_withholder_flagged():
    gate = TrustGate(TrustConfig(), None, RUN, generate_private_key())
    for kid in ("h1", "h2", "h3"):
        for seq in range(20):
            gate.saw(kid, kid, seq)
    for seq in range(0, 20, 3):  # uploads one number in three
        gate.saw("sel", "sel", seq)
    held = gate.withholding()
    assert gate.records["sel"].withheld == 12 and held["sel"][1]
    assert all(gate.records[k].withheld == 0 and not held[k][1] for k in ("h1", "h2", "h3"))
    assert gate.metrics()["trust/withheld_batches"] == 12 and gate.metrics()["trust/withholding_flagged"] == 1


def test_a_stale_roster_put_back_while_the_trainer_is_down_undoes_no_ban(tmp_path):
    """A correctly signed but older workers.json put back during a restart used to un-ban a key
    banned after the trainer's newest checkpoint: the restarted trainer read the store as is."""
    from stoa.transport.identity import roster_key
    from stoa.transport.store import LocalStore

    store, run_key, kept = LocalStore(tmp_path / "store"), generate_private_key(), tmp_path / "run" / "roster"
    cheat = generate_private_key()
    kid = key_id(cheat.public_key())
    first = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=kept)
    first.refresh(force=True)
    assert first.admit(_seal(cheat, "cheat")) is None
    assert first.review([_sealed_batch(cheat, "cheat", episodes("cheat"))], 0) == [None]  # bound by accepted work
    first.refresh(force=True)
    stale = store.get(roster_key(RUN))  # a signed roster from before the ban
    first.ban(kid, "forged log-probs")
    banned_rev = read_roster(store, RUN, run_key.public_key()).revision
    store.put(roster_key(RUN), stale)  # put back while the trainer is down
    restarted = TrustGate(TrustConfig(), store, RUN, run_key, roster_copy=kept)  # no checkpoint state
    restarted.refresh(force=True)
    assert "banned" in restarted.admit(_seal(cheat, "cheat"))
    now = read_roster(store, RUN, run_key.public_key())
    assert kid in now.banned and now.revision > banned_rev  # rewritten, and revisions never go back


def test_a_flood_of_throwaway_keys_neither_fills_the_roster_nor_locks_a_newcomer_out(tmp_path, monkeypatch):
    """4,096 throwaway keys used to fill an open roster on first use and refuse every later
    volunteer. Now a key binds only by accepted work, fresh keys are reviewed a few per poll (at
    random), records of keys that never did accepted work are forgotten, and a full roster makes
    room from idle bindings or takes the newcomer's work unbound."""
    import stoa.fleet.trust.records as records_mod
    from stoa.transport.identity import _MAX_ROSTER, WorkerEntry
    from stoa.transport.store import LocalStore

    monkeypatch.setattr(records_mod, "MAX_RECORDS", 300)
    store, run_key = LocalStore(tmp_path), generate_private_key()
    gate = TrustGate(TrustConfig(newcomers_per_poll=4), store, RUN, run_key)
    gate.refresh(force=True)
    veteran = generate_private_key()
    assert gate.review([_sealed_batch(veteran, "vet", episodes("vet", seed=1))], 0) == [None]
    flood = [generate_private_key() for _ in range(400)]
    newcomer = generate_private_key()
    waiting = [_sealed_batch(k, f"x{i}", episodes(f"x{i}", group=f"g{i}", seed=i), 0) for i, k in enumerate(flood)]
    waiting.append(_sealed_batch(newcomer, "new", episodes("new", group="n", seed=999)))
    polls = 0
    while True:  # each poll: the veteran's batch always, four fresh keys' at random; junk is struck
        polls += 1
        vet = _sealed_batch(veteran, "vet", episodes("vet", group=f"v{polls}", seed=10_000 + polls), polls)
        now, waiting = gate.pace_newcomers([vet, *waiting])
        assert vet in now and len(now) == 5 and len({b.key_id for b in now}) == 5
        junk = [b for b in now if b.worker_id.startswith("x")]
        for b in junk:
            gate.reject(b.key_id, b.worker_id, "replay", "junk")
        verdicts = gate.review([b for b in now if b not in junk], polls)
        assert all(v is None for v in verdicts)
        if any(b.worker_id == "new" for b in now):
            break
    assert polls <= len(flood) // 4 + 1  # never locked out: its turn comes before the flood is through
    assert gate.established(key_id(newcomer.public_key()))
    gate.refresh(force=True)
    assert set(read_roster(store, RUN, run_key.public_key()).enrolled) == {key_id(veteran.public_key()),
                                                                           key_id(newcomer.public_key())}
    assert len(gate.records) <= 300  # strangers' records forgotten, the workers' kept
    assert gate.records[key_id(veteran.public_key())].accepted_batches == polls + 1

    # A full roster: an idle binding makes room; with none idle, the work is taken, the id left unbound.
    keys = [generate_private_key().public_key() for _ in range(_MAX_ROSTER - 2)]
    old = {key_id(k): WorkerEntry(public_hex(k), f"old{i}", 0.0, "first-use") for i, k in enumerate(keys)}
    gate.roster = replace(gate.roster, enrolled={**gate.roster.enrolled, **old})
    late = generate_private_key()
    assert gate.review([_sealed_batch(late, "late", episodes("late", group="l", seed=5))], 99) == [None]
    assert key_id(late.public_key()) in gate.roster.enrolled and len(gate.roster.enrolled) == _MAX_ROSTER
    gate.refresh(force=True)
    assert len(read_roster(store, RUN, run_key.public_key()).enrolled) == _MAX_ROSTER
    for k in old:
        gate.records.touch(k, "old").last_accepted = time.time()
    later = generate_private_key()
    assert gate.review([_sealed_batch(later, "later", episodes("later", group="m", seed=6))], 99) == [None]
    assert key_id(later.public_key()) not in gate.roster.enrolled and gate.established(key_id(later.public_key()))


def test_two_keys_whose_converged_policy_plays_alike_are_not_struck_for_copying(engine_and_episodes, tmp_path):
    """A converged (near-deterministic) policy gives two honest workers assigned the same item the
    same group; the group fingerprint struck the later one as a copier (seen in the demo at
    version 57). With assigned work a copy is the assignment's and the sampling check's business."""
    from stoa.transport.store import LocalStore

    engine, honest = engine_and_episodes
    gate = TrustGate(TrustConfig(audit=AuditConfig(random_spot_check=0.0)), LocalStore(tmp_path), RUN,
                     generate_private_key(), float_scorer=_Echo(), int8=_AtVersion(engine), assign=_assigned(1))
    alike = copy.deepcopy(honest[:4])
    for e in alike:
        e.worker_id = "b"
    assert gate.review([_batch("ak", "a", honest[:4])], 0) == [None]
    assert gate.review([_batch("bk", "b", alike, 1)], 0) == [None]  # later: no "copied" strike
    again = copy.deepcopy(alike)
    assert gate.review([_batch("ak", "a", honest[:4], 2), _batch("bk", "b", again, 3)], 0) == [None, None]  # one poll
    assert gate.records["bk"].strikes == 0 and gate.records["ak"].strikes == 0


def test_repeated_episodes_share_a_forward_pass_but_keep_their_own_draws(engine_and_episodes):
    """The sampling check re-derives every repeated episode; they are scored as one row, and each
    still gets the margins of its own uniforms (as if scored alone)."""
    engine, honest = engine_and_episodes
    twins = [copy.deepcopy(honest[0]) for _ in range(3)]
    for i, e in enumerate(twins):
        e.sample_index = i + 7
    batch = [honest[1], *twins, honest[2]]
    together = engine.sampling_margins(batch, [1] * len(batch))
    alone = [engine.sampling_margins([e], [1])[0] for e in batch]
    assert all(np.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(together, alone))
    assert not np.array_equal(together[1], together[2])  # other sample indices, other uniforms
