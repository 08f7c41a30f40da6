"""A short fleet run under seeded faults (workers SIGKILLed and restarted under the same identity,
one asleep mid-cohort, the trainer SIGKILLed and resumed) finishes with no group trained twice
and no honest worker struck or banned."""

from __future__ import annotations

import pytest

from stoa.fleet.config import load_config
from stoa.testing.chaos import ChaosRun, plan, verify
from stoa.transport.signing import generate_private_key, load_public_key, save_keypair

from helpers import tiny_fleet_config

pytestmark = pytest.mark.slow


def test_a_run_under_faults_finishes_with_nothing_lost_or_trained_twice(tmp_path):
    config = tmp_path / "chaos.toml"
    config.write_text(tiny_fleet_config("chaos-test", trainer={"steps": 10}))
    key, pub = save_keypair(generate_private_key(), tmp_path / "keys", "run")
    faults = plan(seed=0, steps=10, workers=3, worker_kills=2, pauses=1, trainer_kills=1)
    run = ChaosRun(config, tmp_path / "fleet", load_config(config).name, key, str(pub), 3, faults,
                   env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    wall = run.run(timeout=300)
    got = verify(run, load_public_key(pub))
    print(f"chaos: {len(run.fired)} faults in {wall:.0f} s: {got}")
    assert [f["kind"] for f in run.fired] == [f.kind for f in faults], run.fired  # every fault fired
    assert got["finished"] and got["groups_trained"] == 10 * 2, got
    assert got["trained_twice"] == 0 and got["groups_lost"] == 0, got
    assert got["resumed"] == 1, got
    assert set(got["workers"]) == {"worker-0", "worker-1", "worker-2"}, got
    for wid, w in got["workers"].items():
        assert w["strikes"] == 0 and not w["banned"], (wid, w)
