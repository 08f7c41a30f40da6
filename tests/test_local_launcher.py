"""``stoa train``'s launcher stops, with the reason, when no worker is left (banned, refused at
start, failed) instead of waiting for rollouts forever; it leaves a finished run alone."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from pathlib import Path

from rich.console import Console

from stoa.fleet.config import load_config
from stoa.fleet.operator.launcher import _watch
from stoa.transport.store import LocalStore

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "arithmetic_tiny.toml"


def proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_the_launcher_stops_with_the_reason_when_every_worker_has_exited(tmp_path):
    trainer = proc("import time; time.sleep(120)")  # a trainer waiting for rollouts that cannot come
    workers = {"worker-0": proc("raise SystemExit(3)"), "worker-1": proc("raise SystemExit(2)")}
    try:
        for p in workers.values():
            p.wait(timeout=60)
        out: dict = {}

        def watch() -> None:
            try:
                _watch(load_config(CONFIG), tmp_path, LocalStore(tmp_path / "store"), {"trainer": trainer, **workers},
                       Console(file=io.StringIO()), 0.0)
                out["returned"] = True
            except Exception as e:  # noqa: BLE001 - what it raised is the result
                out["raised"] = e

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        t.join(timeout=60)  # a guard only: the launcher answers on its first look
        assert not t.is_alive(), "the launcher kept waiting with no worker left"
        err = out.get("raised")
        assert type(err).__name__ == "FleetGone", out
        assert "no worker is left" in str(err) and "worker-0 exited 3 (banned)" in str(err)
        assert "worker-1 exited 2 (configuration error)" in str(err) and "--resume" in str(err)
    finally:
        trainer.kill()
        trainer.wait()


def test_a_finished_run_or_a_live_worker_is_not_a_fleet_gone():
    from stoa.fleet.operator.launcher import no_worker_left

    trainer, alive, done = proc("import time; time.sleep(120)"), proc("import time; time.sleep(120)"), proc("pass")
    try:
        done.wait(timeout=60)
        assert no_worker_left({"trainer": trainer, "w0": done, "w1": alive}, lambda: False) is None
        assert no_worker_left({"trainer": trainer, "w0": done}, lambda: True) is None  # workers leave a finished run
        assert no_worker_left({"trainer": trainer}, lambda: False) is None  # a trainer alone (workers join elsewhere)
        assert "w0 exited 0 (stopped)" in no_worker_left({"trainer": trainer, "w0": done}, lambda: False)
    finally:
        for p in (trainer, alive):
            p.kill()
            p.wait()
