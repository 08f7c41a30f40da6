"""Pipeline-parallel rollouts on the torch engine (CPU): stages of contiguous layers, each holding
only its share of the int8 state, chained in one process, play the same episodes as one engine."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch engine needs torch")

import stoa.envs  # noqa: E402
from stoa.backends.engine import EngineConfig, EngineError, RolloutRequest, SamplingConfig, make_engine  # noqa: E402
from stoa.backends.torch import pipeline as P  # noqa: E402
from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts  # noqa: E402
from stoa.models.tiny import TinyConfig, build_tiny  # noqa: E402

CORPUS = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
MODEL = TinyConfig(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                   intermediate_size=256, seed=0)
SAMPLING = SamplingConfig(max_turn_tokens=12, max_episode_tokens=400, seed=7)
CONFIG = EngineConfig(max_batch=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), list(tokenizer_texts(generate(CORPUS))), MODEL)


@pytest.fixture(scope="module")
def single(tiny):
    return make_engine(tiny, "torch", config=CONFIG, device="cpu")


def make_env():
    return stoa.envs.make("stoa/SyntheticSearch-v0", config=CORPUS)


def requests(n=5, g=3):
    return [RolloutRequest(i, f"q{i}", g) for i in range(n)]


def assert_same_episodes(got, want, tol=1e-4):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert np.array_equal(a.tokens(), b.tokens()) and np.array_equal(a.loss_mask(), b.loss_mask())
        assert (a.group_id, a.sample_index, a.reward, a.policy_version) == (b.group_id, b.sample_index, b.reward,
                                                                          b.policy_version)
        np.testing.assert_allclose(a.behavior_logprobs(), b.behavior_logprobs(), atol=tol, rtol=0)


def test_split_layers_and_stage_names():
    assert P.split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert P.split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(EngineError):
        P.split_layers(3, 4)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.1.mlp.up_proj.scales", "model.layers.10.mlp.up_proj.weight"]
    assert P.stage_names(names, (1, 2), 11, tied=False) == ["model.layers.1.mlp.up_proj.scales"]
    assert P.stage_names(names, (0, 1), 11, tied=True) == ["model.embed_tokens.weight",
                                                           "model.layers.0.mlp.up_proj.weight"]
    assert P.stage_names(names, (2, 11), 11, tied=True) == ["lm_head.weight", "model.embed_tokens.weight",
                                                            "model.layers.10.mlp.up_proj.weight", "model.norm.weight"]


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_plays_the_single_engines_episodes(tiny, single, stages):
    pipe = P.make(tiny, stages, state=single.state, config=CONFIG)
    assert pipe.state_hash() == single.state_hash()
    want = single.rollout(make_env, requests(), SAMPLING)
    got = pipe.rollout(make_env, requests(), SAMPLING)
    assert_same_episodes(got, want)
    assert any(len(e.segments) > 2 for e in got), "the cohort should include multi-turn episodes (prefill of observations)"
    assert pipe.last_stats().decode_steps == single.last_stats().decode_steps


def test_stages_hold_only_their_share(tiny, single):
    pipe = P.make(tiny, [(0, 1), (1, 3), (3, 4)], state=single.state, config=CONFIG)
    first, mid, last = pipe.stages
    assert "model.embed_tokens.weight" in first.names and "model.norm.weight" not in first.names
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in mid.names)
    assert {"model.norm.weight", "model.embed_tokens.weight"} <= set(last.names)  # tied head
    assert sorted(set(first.names) | set(mid.names) | set(last.names)) == sorted(single.state)
    whole = sum(a.nbytes for a in single.state.values())
    m = mid.memory()
    assert m.state == sum(single.state[n].nbytes for n in mid.names) and m.state < whole / 2
    if mid.mode in ("quantized", "int24", "int16"):  # it computes on its int8 share: only the norms are float tensors
        assert 0 < m.weights < m.state / 8
    else:
        assert m.weights > m.state  # float32 weights of record: ~4x the int8 codes
    assert m.kv_per_token == 2 * 2 * MODEL.num_kv_heads * (MODEL.hidden_size // MODEL.num_heads) * 4
    with pytest.raises(EngineError, match="missing"):
        P.Stage(tiny, (1, 3), {n: single.state[n] for n in first.names})
    with pytest.raises(EngineError, match="start where"):
        P.Pipeline(tiny, [last, first])


class _CorruptStage:
    """A stage that adds noise to the residual stream it passes on (a dishonest or broken host)."""

    def __init__(self, stage, scale: float) -> None:
        self.__dict__.update(stage.__dict__)
        self._stage, self._scale = stage, scale

    def forward(self, x, start, longest, rows=None):
        out = self._stage.forward(x, start, longest, rows)
        g = torch.Generator().manual_seed(int(start.sum()) + out.shape[0])
        return out + self._scale * out.std() * torch.randn(out.shape, generator=g)

    def kv(self, slots):
        return self._stage.kv(slots)


def test_a_stage_that_corrupts_activations_is_caught_by_the_trainers_rederivation(tiny, single):
    """Honest pipeline episodes pass the trainer's draw check under the single engine (the weights
    of record); a middle stage that perturbs the activations yields draws the check rejects."""
    from stoa.fleet.trust.audit import AuditConfig

    band = AuditConfig().sampling_band
    pipe = P.make(tiny, 4, state=single.state, config=CONFIG)
    reqs = requests(4, 4)
    honest = pipe.rollout(make_env, reqs, SAMPLING)
    margins = np.concatenate([d.margins for d in single.check_draws(honest, [SAMPLING.seed] * len(honest),
                                                                    drift=band / 2)])
    assert margins.min() > -band / 20
    pipe.stages[2] = _CorruptStage(pipe.stages[2], 0.5)
    pipe._cache = None
    bad = pipe.rollout(make_env, reqs, SAMPLING)
    margins = np.concatenate([d.margins for d in single.check_draws(bad, [SAMPLING.seed] * len(bad),
                                                                    drift=band / 2)])
    assert int((margins < -band).sum()) >= 3


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pipeline_on_the_real_model_matches_the_single_engine(real_model):
    """SmolLM2-135M-Instruct (30 layers, tied 49,152-token head) cut into 2 and 4 stages."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from custom_env import ArithmeticEnv

    config = EngineConfig(max_batch=8)
    eng = make_engine(real_model, "torch", config=config, device="cpu")
    make = lambda: ArithmeticEnv(size=40)  # noqa: E731
    reqs = [RolloutRequest(i, f"g{i}", 2) for i in range(2)]
    s = SamplingConfig(max_turn_tokens=16, max_episode_tokens=100, seed=5)
    want = eng.rollout(make, reqs, s)
    whole = sum(a.nbytes for a in eng.state.values())
    for stages in (2, 4):
        pipe = P.make(real_model, stages, state=eng.state, config=config)
        assert_same_episodes(pipe.rollout(make, reqs, s), want, tol=1e-5)
        mem = [st.memory() for st in pipe.stages]
        print(f"{stages} stages, state MB per stage: {[round(m.state / 1e6, 1) for m in mem]} of {whole / 1e6:.1f}")
        assert sum(m.state for m in mem) > whole  # the tied embeddings sit in the first and the last stage
        assert max((m.state for m in mem[1:-1]), default=0) < whole / stages


def test_a_stage_reads_only_its_share_of_an_anchor_and_applies_deltas_to_it(tiny, single):
    from stoa.transport import pulse

    state = single.state
    anchor = pulse.encode_state(state)
    reads = []

    def read(a, b):
        reads.append((a, b))
        return anchor[a:b]

    parts = P.split_layers(MODEL.num_layers, 4)
    shares = [P.read_share(read, len(anchor), p, MODEL.num_layers, tied=True) for p in parts]
    mid, layout, got = shares[1]
    assert sorted(mid) == P.stage_names(list(state), parts[1], MODEL.num_layers, True)
    assert got < len(anchor) / 3 and got == sum(a.nbytes for a in mid.values()) + (reads[0][1] + reads[1][1] - 8)
    assert pulse.state_hash(mid) == pulse.state_hash({n: state[n] for n in mid})
    pipe = P.Pipeline(tiny, [P.Stage(tiny, p, sh[0]) for p, sh in zip(parts, shares)], config=CONFIG)
    assert pipe.state_hash() == single.state_hash()

    new = {k: v.copy() for k, v in state.items()}
    rng = np.random.default_rng(0)
    for n in ("model.layers.0.mlp.up_proj.weight", "model.layers.2.self_attn.q_proj.weight"):
        flat = new[n].reshape(-1)
        at = rng.choice(flat.size, 200, replace=False)
        flat[at] = (flat[at].astype(np.int16) + 1).clip(0, 255).astype(np.uint8)
    blob = pulse.encode_delta(state, new)
    with pytest.raises(pulse.PulseError, match="nothing was written"):
        pipe.stages[2].apply_delta(blob, layout, expect_hash="0" * 64)
    assert pipe.state_hash() == single.state_hash()
    changed = [st.apply_delta(blob, layout, pulse.state_hash({n: new[n] for n in st.names})) for st in pipe.stages]
    assert changed == [["model.layers.0.mlp.up_proj.weight"], [], ["model.layers.2.self_attn.q_proj.weight"], []]
    assert pipe.state_hash() == pulse.state_hash(new)
    other = make_engine(tiny, "torch", state=new, config=CONFIG, device="cpu")
    assert_same_episodes(pipe.rollout(make_env, requests(3, 2), SAMPLING), other.rollout(make_env, requests(3, 2),
                                                                                         SAMPLING))


def test_stages_follow_the_signed_chain_for_their_layers_only(tiny, single, tmp_path):
    from stoa.transport import pulse
    from stoa.transport.chain import ShareSubscriber, WeightPublisher
    from stoa.transport.signing import generate_private_key
    from stoa.transport.store import LocalStore

    store, key, state = LocalStore(tmp_path), generate_private_key(), single.state
    pub = WeightPublisher(store, "run", key)
    pub.publish(1, state)
    new = {k: v.copy() for k, v in state.items()}
    flat = new["model.layers.2.mlp.up_proj.weight"].reshape(-1)
    flat[:300] = (flat[:300].astype(np.int16) + 1).clip(0, 255).astype(np.uint8)
    pub.publish(2, new)
    parts = P.split_layers(MODEL.num_layers, 4)
    subs = [ShareSubscriber(store, "run", key.public_key(), p, MODEL.num_layers, tied=True) for p in parts]
    pipe = P.make(tiny, parts, state={k: np.zeros_like(v) for k, v in state.items()}, config=CONFIG)
    for st, sub in zip(pipe.stages, subs):
        r = st.sync(sub, version=1)
        assert r.applied == [(1, "anchor")] and r.bytes_read < 0.6 * store.size("run/weights/000000000001/anchor.safetensors")
    assert pipe.state_hash() == single.state_hash()
    held = [st.state for st in pipe.stages]
    results = [st.sync(sub) for st, sub in zip(pipe.stages, subs)]
    assert [r.applied for r in results] == [[(2, "delta")]] * 4 and [r.changed_names for r in results] == [
        [], [], ["model.layers.2.mlp.up_proj.weight"], []]
    assert all(st.state is h for st, h in zip(pipe.stages, held))  # written in place
    assert pipe.state_hash() == pulse.state_hash(new)
    other = make_engine(tiny, "torch", state=new, config=CONFIG, device="cpu")
    assert_same_episodes(pipe.rollout(make_env, requests(3, 2), SAMPLING), other.rollout(make_env, requests(3, 2),
                                                                                         SAMPLING))
    with pytest.raises(EngineError, match="follows layers"):
        pipe.stages[0].sync(subs[1])
