"""A worker's weight sync: deltas written at once, their hash checked beside generation, and a
cohort made with weights that fail the check dropped, never uploaded (docs/transport.md)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="the worker's engine needs mlx")

import stoa.envs  # noqa: E402
from stoa.backends.engine import RolloutRequest, SamplingConfig, make_engine  # noqa: E402
from stoa.fleet.worker.follower import LiveWeights  # noqa: E402
from stoa.testing.synthetic import perturb_codes  # noqa: E402
from stoa.transport import pulse  # noqa: E402
from stoa.transport.chain import WeightPublisher  # noqa: E402
from stoa.transport.signing import generate_private_key  # noqa: E402
from stoa.transport.store import LocalStore  # noqa: E402


def test_weights_that_fail_their_background_check_are_repaired_and_their_cohort_dropped(tiny_model, tmp_path):
    store, key, rng = LocalStore(tmp_path / "store"), generate_private_key(), np.random.default_rng(0)
    states = {1: {k: v.copy() for k, v in make_engine(tiny_model, "mlx").state.items()}}
    pub = WeightPublisher(store, "run", key, anchor_every=50)
    pub.publish(1, states[1])
    w = LiveWeights(store, "run", key.public_key())  # as a worker follows the chain into its engine
    engine = w.live = make_engine(tiny_model, "mlx", state=w.join().state, version=1)

    states[2] = perturb_codes(states[1], 0.01, rng)
    pub.publish(2, states[2])
    assert w.follow() == 2
    assert engine.version == 2 and w.pending is not None  # written at once, hashed beside
    assert w.verified() and engine.state_hash() == pulse.state_hash(states[2])

    name = next(k for k, a in states[2].items() if a.dtype == np.uint8)

    def rot(state: dict) -> tuple[int, list[str]]:  # a bit flips in the live weights
        state[name].reshape(-1)[0] ^= 1
        return engine.version, [name]

    engine.update_inplace(rot)
    states[3] = perturb_codes(states[2], 0.01, rng)
    pub.publish(3, states[3])
    w.catch_up()
    assert engine.version == 3 and w.pending is not None
    assert not w.verified()  # the cohort made meanwhile is not uploaded
    assert w.pending is None and engine.state_hash() == pulse.state_hash(states[3])  # repaired from the store
    assert not w.damaged
    # The live model computes with the repaired weights, not just holds them.
    fresh = make_engine(tiny_model, "mlx", state=states[3], version=3)
    make_env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", num_entities=20, num_test_facts=5)  # noqa: E731
    eps = fresh.rollout(make_env, [RolloutRequest(0, "g0", 2)], SamplingConfig(max_turn_tokens=8, max_episode_tokens=160,
                                                                               seed=1))
    for a, b in zip(engine.score(eps), fresh.score(eps)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
