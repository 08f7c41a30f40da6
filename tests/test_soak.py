"""A short fleet run with worker churn (stoa.testing.soak): workers leave (SIGTERM or SIGKILL) and
others join (the same identity again or a new one), then the trainer is stopped and resumed to
finish. What must hold whatever the machine's speed: nothing lost or trained twice, no process's
open descriptors growing with the churn, and every kind of store object within its retention."""

from __future__ import annotations

import pytest

from stoa.fleet.config import load_config
from stoa.testing.chaos import verify
from stoa.testing.soak import SoakRun, fit_slope, store_kind, summary
from stoa.transport.signing import generate_private_key, load_public_key, save_keypair

from helpers import tiny_fleet_config


def test_store_kinds_and_slopes():
    assert store_kind("r", "r/weights/000000000004/anchor.safetensors") == "weights/anchor"
    assert store_kind("r", "r/weights/000000000005/delta.pulse") == "weights/delta"
    assert store_kind("r", "r/workers/w-1.json") == "heartbeats"
    assert store_kind("r", "r/rollouts/w-1/s000000000003-v000000000002.episodes") == "rollouts"
    assert store_kind("r", "r/tickets/0123456789abcdef/000000000001.json") == "tickets"
    assert store_kind("r", "r/current.json") == "control" and store_kind("r", "r/stray.bin") == "other"
    assert fit_slope([(0.0, 1.0), (1800.0, 2.0), (3600.0, 3.0)]) == pytest.approx(2.0)  # per hour
    assert fit_slope([(0.0, 1.0), (1.0, 1.0)]) is None


@pytest.mark.slow
def test_a_churned_fleet_loses_nothing_and_stays_within_its_bounds(tmp_path):
    config = tmp_path / "soak.toml"
    config.write_text(tiny_fleet_config("soak-test", trainer={"steps": 10**6}))
    key, pub = save_keypair(generate_private_key(), tmp_path / "keys", "run")
    run = SoakRun(config, tmp_path / "fleet", load_config(config).name, key, str(pub), 3,
                  env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}, seed=1,
                  seconds=24.0, calm_s=4.0, churn_s=6.0, sample_s=1.0)
    wall = run.run(timeout=900)
    got = verify(run, load_public_key(pub))
    res = summary(run.samples)
    print(f"soak: {wall:.0f} s, churns {run.churns}, {got}, store {res['store']}")
    # four churns whatever the speed (a worker still leaving is not churned again, so at most
    # one churn is skipped per slot when the machine is slow)
    assert 2 <= len(run.churns) <= 4, run.churns
    assert got["finished"] and got["groups_lost"] == 0 and got["trained_twice"] == 0, got
    assert got["resumed"] == 1, got
    for wid, w in got["workers"].items():
        assert w["strikes"] == 0 and not w["banned"], (wid, w)
    # open descriptors: the long-lived processes end where the calm baseline was (+2 for a file
    # being written at the moment of a sample), and no process ever holds many
    procs = res["procs"]
    for p in procs:
        assert p["fds_max"] <= 32, p
        if p["fds_calm"] is not None:
            assert p["fds_last"] <= p["fds_calm"] + 2, p
    assert {p["name"] for p in procs if p["fds_calm"] is not None} >= {"trainer", "worker-0"}, procs
    # every kind of store object within its retention
    ids = len(run.identities)
    mo = load_config(config).rollout.max_outstanding
    for row in run.samples:
        s = row["store"]
        assert "other" not in s and "error" not in s, row
        assert s.get("quarantine", 0) == 0 and s.get("bans", 0) == 0, row  # an honest fleet
        assert s.get("tickets", 0) <= 2 * ids, row  # at most two waiting per key
        assert s.get("heartbeats", 0) <= ids and s.get("salts", 0) <= ids, row
        assert s.get("control", 0) <= 8 and s.get("model", 0) <= 5, row
    # after the finish: each identity's newest batch (its numbering), and what a worker uploaded
    # past the trainer's last take (at most max_outstanding each); everything else was pruned
    assert res["store"]["rollouts"]["end"] <= ids * (1 + mo), res["store"]
