"""A volunteer's path, end to end: the operator writes an invite (enrolling a worker key), the
volunteer runs `stoa worker --invite FILE`, stops, starts again, and keeps its identity (key, id,
sequence numbers, kept weights caught up by deltas); the trainer accepts its batches and the run
finishes with the worker told so (docs/volunteer.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import tiny_fleet_config
from stoa.transport.signing import generate_private_key, key_id, load_private_key, save_keypair
from stoa.transport.store import LocalStore

pytestmark = pytest.mark.slow


def _env(home) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", HOME=str(home))
    for var in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        env.pop(var, None)
    return env


def test_a_volunteer_joins_from_an_invite_restarts_and_keeps_its_identity(tmp_path):
    pytest.importorskip("mlx.core", reason="the worker's engine needs mlx")
    run, store_dir, home = "vol", tmp_path / "store", tmp_path / "home"
    config = tmp_path / "vol.toml"
    config.write_text(tiny_fleet_config(run, trainer={"steps": 5, "checkpoint_every": 5},
                                        pulse={"anchor_every": 50}, trust={"mode": "enrolled"}))
    run_key, _ = save_keypair(generate_private_key(), tmp_path / "keys", "run")
    stoa = [sys.executable, "-m", "stoa"]
    r = subprocess.run([*stoa, "invite", str(tmp_path / "invite.json"), "--store", str(store_dir), "--run", run,
                        "--key", str(run_key), "--enroll", "vol1"], capture_output=True, text=True, env=_env(home))
    assert r.returncode == 0 and "stoa worker --invite invite.json" in r.stdout, r.stderr
    invite = json.loads((tmp_path / "invite.json").read_text())
    kid = key_id(load_private_key(invite["worker_key"]).public_key())

    trainer = subprocess.Popen([*stoa, "trainer", str(config), "--store", str(store_dir), "--key", str(run_key),
                                "--run-dir", str(tmp_path / "run")], env=_env(home),
                               stdout=open(tmp_path / "trainer.log", "ab"), stderr=subprocess.STDOUT)
    try:
        worker = [*stoa, "worker", "--invite", str(tmp_path / "invite.json"), "--threads", "1"]
        first = subprocess.run([*worker, "--max-batches", "2"], capture_output=True, text=True, env=_env(home),
                               timeout=300)
        assert first.returncode == 0, first.stderr[-3000:]
        assert f"worker vol1 (key {kid}) joined run vol" in first.stderr
        kept = re.search(r"weights of version (\d+) kept in (\S+) for a quick restart", first.stderr)
        assert "2 batches" in first.stderr and kept, first.stderr[-2000:]
        assert kept.group(2).startswith(str(home / ".cache" / "stoa" / run / "vol1"))

        second = subprocess.run(worker, capture_output=True, text=True, env=_env(home), timeout=300)
        assert second.returncode == 0, second.stderr[-3000:]
        resumed = re.search(r"resumed from the weights kept at version (\d+): (.*) \((\d+) bytes\)", second.stderr)
        assert resumed and resumed.group(1) == kept.group(1), second.stderr[-3000:]
        assert "anchor" not in resumed.group(2)  # caught up by deltas (or already current)
        assert "the run finished" in second.stderr and f"as vol1 (key {kid})" in second.stderr
        assert trainer.wait(timeout=300) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()

    store = LocalStore(store_dir)
    n2 = int(re.search(r"the run finished: (\d+) batches", second.stderr).group(1))
    newest = max(int(re.search(r"/s(\d{12})-", k).group(1))
                 for k in store.list(f"{run}/rollouts/vol1/") + store.list(f"{run}/quarantine/vol1/"))
    assert newest == 2 + n2 - 1  # one sequence across both sessions, none reused
    report = json.loads(json.loads(store.get(f"{run}/trust.json"))["body"])
    rec = report["workers"][kid]
    assert rec["worker_id"] == "vol1" and rec["accepted_batches"] >= 3 and rec["rejected_batches"] == 0, rec
    assert re.search(r"trainer: \d+ accepted, 0 rejected", second.stderr)
