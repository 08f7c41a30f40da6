"""Several trainers of one run with real processes in a real local store (docs/outer.md): outer
steps merge and publish, workers follow, no group is trained twice; a killed trainer is dropped,
the run goes on, and the trainer rejoins. CPU, the fleet tests' tiny model and task."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stoa.fleet.metrics import read_metrics
from stoa.fleet.operator.status import fleet_status
from stoa.fleet.outer.exchange import make_secret
from stoa.transport.chain import WeightSubscriber
from stoa.transport.pulse import state_hash
from stoa.transport.store import LocalStore

from helpers import tiny_fleet_config
from test_fleet import Fleet, check_accounting, env, trained_groups

pytestmark = pytest.mark.slow


def outer_config(tmp: Path, name: str, steps: int, **outer) -> Path:
    p = tmp / f"{name}.toml"
    p.write_text(tiny_fleet_config(name, trainer={"steps": steps, "groups_per_step": 1, "max_lag": 6,
                                                  "checkpoint_every": 100},
                                   outer={"trainers": 2, "inner_steps": 2, **outer}))
    return p


def test_two_trainers_train_one_run_through_the_store(tmp_path):
    """`stoa train` with [outer] trainers = 2: every version is a merge of both trainers' two inner
    steps, the workers follow the chain to the end, and each group is trained by one trainer once."""
    steps = 4
    config = outer_config(tmp_path, "outer2", steps)
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--runs", str(tmp_path / "runs")],
                       env=env(), capture_output=True, text=True, timeout=600)
    run = tmp_path / "runs" / "outer2"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + (run / "trainer-1.log").read_text()[-2000:]
    rows = read_metrics(run / "metrics.jsonl")
    train = [x for x in rows if x["kind"] == "train"]
    assert [x["version"] for x in train] == list(range(1, steps + 1))
    for x in train:
        assert x["outer/included"] == 2 and x["outer/dropped"] == 0, x
        assert 0 < x["outer/update_bytes"] < x["outer/fp32_update_bytes"] / 3  # int8 + scales, not float32
        assert x["outer/fp32_per_step_bytes"] == 2 * 1 * x["outer/fp32_update_bytes"] * 2
    inner = read_metrics(run / "trainer-1" / "metrics.jsonl")
    assert len([x for x in inner if x["kind"] == "inner"]) == steps * 2  # rank 1 took H steps per version
    assert len([x for x in inner if x["kind"] == "outer_update"]) == steps
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    trained = trained_groups(ledger)
    assert len(trained) == len(set(trained)) == steps * 2 * 2  # 2 trainers x H = 2 x 1 group, once each
    assert all(e["outer"]["included"] == [0, 1] for e in ledger if "trained" in e)
    status = fleet_status(LocalStore(run / "store"), "outer2", public_key=run / "keys" / "run.pub")
    assert status["finished"] and status["head"] == steps
    assert {w["status"] for w in status["workers"]} == {"stopped"}
    sub = WeightSubscriber(LocalStore(run / "store"), "outer2", run / "keys" / "run.pub")
    res = sub.sync(None)
    assert res.version == steps and state_hash(res.state) == sub.manifest(steps).state_hash
    assert "2 trainers" in r.stdout


def test_a_killed_trainer_is_dropped_the_run_goes_on_and_it_rejoins(tmp_path):
    """kill -9 rank 1 mid-run: it is dropped (silent), the coordinator merges alone, its items go back to
    the pool and are trained once; started again, it joins from the newest base and counts again."""
    fleet = Fleet(tmp_path, outer_config(tmp_path, "outer-kill", 100_000, silent_s=3.0, deadline_s=20.0,
                                         base_every=3))
    secret = make_secret(tmp_path / "keys" / "outer.secret")
    try:
        _kill_and_rejoin(fleet, secret)
    finally:
        fleet.close()


def _kill_and_rejoin(fleet: Fleet, secret: Path) -> None:
    def inner() -> subprocess.Popen:
        return fleet._spawn(["trainer", str(fleet.config), "--store", str(fleet.store_dir), "--run-dir",
                             str(fleet.tmp / "rank1"), "--outer-rank", "1", "--outer-secret", str(secret),
                             "--public-key", str(fleet.pub)], "trainer-1.log")

    def joins() -> list[dict]:
        p = fleet.tmp / "rank1" / "metrics.jsonl"
        return [r for r in read_metrics(p) if r.get("event") == "outer_joined"] if p.exists() else []

    trainer = fleet.trainer("--outer-secret", str(secret))
    rank1 = inner()
    workers = [fleet.worker("w0"), fleet.worker("w1")]
    fleet.wait_for(lambda: len(fleet.rows("train")) >= 3, what="three outer steps")
    assert all(r["outer/included"] == 2 for r in fleet.rows("train"))
    rank1.send_signal(signal.SIGKILL)
    rank1.wait()
    fleet.wait_for(lambda: any(r.get("event") == "outer_trainer_dropped" for r in fleet.rows("event")),
                   what="the killed trainer dropped")
    killed_at = max(r["version"] for r in fleet.rows("train"))
    fleet.wait_for(lambda: max(r["version"] for r in fleet.rows("train")) >= killed_at + 2,
                   what="outer steps without it")
    rank1 = inner()  # it comes back: joins from the newest base, then counts in the merges again
    fleet.wait_for(lambda: len(joins()) >= 2, what="the trainer to rejoin", timeout=400)
    back = joins()[-1]["version"]
    fleet.wait_for(lambda: any(r["version"] > back and r["outer/included"] == 2 for r in fleet.rows("train")),
                   what="a merge with the rejoined trainer")
    for p in workers:  # stop the fleet: the workers' last uploads, then the trainer's checkpoint
        p.send_signal(signal.SIGTERM)
        assert fleet.wait(p, 120) == 0
    trainer.send_signal(signal.SIGTERM)
    assert fleet.wait(trainer, 120) == 0, fleet.log("trainer.log")[-3000:]
    rank1.send_signal(signal.SIGTERM)
    assert fleet.wait(rank1, 60) == 0, fleet.log("trainer-1.log")[-3000:]
    train = fleet.rows("train")
    assert [r["version"] for r in train] == list(range(1, len(train) + 1))
    assert any(r["outer/included"] == 1 for r in train), [(r["version"], r["outer/included"]) for r in train]
    dropped = [r for r in fleet.rows("event") if r.get("event") == "outer_trainer_dropped"]
    assert dropped[0]["rank"] == 1 and dropped[0]["reason"].startswith("silent")
    trained = trained_groups(fleet.ledger())
    assert len(trained) == len(set(trained)), "a group was trained twice"
    check_accounting(fleet, ("w0", "w1"))  # the killed trainer's items went back and were trained once
