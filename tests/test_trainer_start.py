"""A start that would clobber a live run is refused before it writes anything to the store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from stoa.fleet.config import load_config
from stoa.fleet.run import publish_run
from stoa.transport.chain import WeightPublisher
from stoa.transport.quant import quantize_state
from stoa.transport.signing import generate_private_key, save_keypair
from stoa.transport.store import LocalStore

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "arithmetic_tiny.toml"


def test_a_refused_trainer_start_leaves_the_runs_signed_config_byte_identical(tiny_model, tmp_path):
    store_dir = tmp_path / "store"
    store, cfg = LocalStore(store_dir), load_config(CONFIG)
    run_key = generate_private_key()
    save_keypair(run_key, tmp_path / "keys", "run")
    save_keypair(generate_private_key(), tmp_path / "keys", "other")
    publish_run(store, cfg.name, cfg, tiny_model, run_key)  # a live run: its config and one published version
    state = quantize_state({"model.w.weight": np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)})
    WeightPublisher(store, cfg.name, run_key).publish(0, state)
    before = {k: store.get(k) for k in store.list(f"{cfg.name}/")}

    def start(key: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "stoa", "trainer", str(CONFIG), "--store", str(store_dir),
                               "--key", str(tmp_path / "keys" / f"{key}.key"), "--run-dir", str(tmp_path / key),
                               *extra], capture_output=True, text=True, timeout=300, cwd=tmp_path)

    other = start("other")  # another key: every later worker would have died on a signature error
    assert other.returncode != 0 and "did not sign" in other.stderr and "Traceback" not in other.stderr, other.stderr
    changed = start("run", "--set", "trainer.steps=99")  # the same key, other settings, no --resume
    assert changed.returncode != 0 and "already has published weights" in changed.stderr, changed.stderr
    assert {k: store.get(k) for k in store.list(f"{cfg.name}/")} == before  # nothing written, nothing removed
