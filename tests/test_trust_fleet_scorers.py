"""The trust layer with each of the trainer's int8 scorers (``trainer.int8_scorer``: ``"torch"``,
the default for this tiny model on a CPU learner, and the MLX ``"engine"``): a real fleet of two
honest workers and two forgers. The check of every episode (draws and log-probs) and the mismatch
split run on the chosen scorer; honest workers lose nothing and both forgers are banned. The test stops the run
(SIGTERM: report, checkpoint) once 5 steps are trained and both forgers are banned (30 steps a cap):
a forger whose first batch comes late would otherwise race a fixed run length."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stoa.fleet.metrics import read_metrics
from stoa.transport.signing import generate_private_key, save_keypair
from stoa.transport.store import LocalStore

from helpers import tiny_fleet_config

pytestmark = pytest.mark.slow

FORGERS = {"zero-logprobs": "do not match their log mu", "cold-sampler": "sampling rule does not draw"}
"""Adversary kind -> what its ban reason says."""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


@pytest.mark.parametrize("scorer", ["torch", "engine"])
def test_spot_and_sampling_checks_on_either_scorer_pass_honest_workers_and_ban_forgers(scorer, tmp_path):
    config = tmp_path / "torch-trust.toml"
    config.write_text(tiny_fleet_config(
        "torch-trust", warmstart={"mix": {"oracle": 0.5, "guess": 0.5}, "practice_answer_only": 0},
        trainer={"steps": 30, "skip_zero_variance_groups": False, "int8_scorer": scorer, "mismatch_every": 1},
        learner={"lr": 1e-5}, trust={"max_worker_share": 0.5, "audit": {"random_spot_check": 1.0}}))
    store_dir, run_dir, run = tmp_path / "store", tmp_path / "run", "torch-trust"
    key, pub = save_keypair(generate_private_key(), tmp_path / "keys", "run")
    workers = {"honest-0": None, "honest-1": None, **{f"adv-{k}": k for k in FORGERS}}
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, args: list[str]) -> None:
        procs[name] = subprocess.Popen([sys.executable, "-m", "stoa", *args], env=_env(),
                                       stdout=open(tmp_path / f"{name}.log", "ab"), stderr=subprocess.STDOUT)

    try:
        spawn("trainer", ["trainer", str(config), "--store", str(store_dir), "--key", str(key), "--run-dir", str(run_dir)])
        for w, kind in workers.items():
            spawn(w, ["worker", "--store", str(store_dir), "--run", run, "--public-key", str(pub), "--id", w,
                      "--cache", str(tmp_path / "cache" / w), *(["--adversary", kind] if kind else [])])
        deadline = time.monotonic() + 480
        while procs["trainer"].poll() is None and time.monotonic() < deadline:
            train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
            if len(train) >= 5 and train[-1]["trust/banned_workers"] >= len(FORGERS):
                procs["trainer"].send_signal(signal.SIGTERM)
                break
            time.sleep(1.0)
        assert procs["trainer"].wait(timeout=120) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    log = (tmp_path / "trainer.log").read_text()
    assert ("int8 scoring on torch: cpu" in log) == (scorer == "torch"), log[-3000:]
    store = LocalStore(store_dir)
    report = json.loads(json.loads(store.get(f"{run}/trust.json"))["body"])
    by_name = {rec["worker_id"]: rec for rec in report["workers"].values()}
    for w in ("honest-0", "honest-1"):
        rec = by_name[w]
        assert rec["rejected_batches"] == 0 and not rec["banned"] and rec["accepted_batches"] >= 1, rec
    for kind, needle in FORGERS.items():
        rec = by_name[f"adv-{kind}"]
        assert rec["banned"] and needle in (rec["banned"] + rec["last_reason"]), (kind, rec)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    last = train[-1]
    assert any(r.get("event") == "stopped" for r in read_metrics(run_dir / "metrics.jsonl"))
    assert len(train) >= 5 and last["trust/episodes_checked"] >= 8 and last["trust/sampled_tokens_checked"] > 0
    assert last["trust/banned_workers"] == len(FORGERS)
    assert all({"mismatch/kl_int8", "mismatch/kl_stale"} <= set(r) for r in train)
