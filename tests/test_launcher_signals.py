"""``stoa train`` stopped by SIGTERM (kill, systemd, Docker, Kubernetes, a CI cancellation) or
killed by SIGKILL leaves no process of its run behind, within the stop bound, even while its
trainer is busy in a long phase (here the warm start, which has no safe point to stop at)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoa.fleet.lifetime import STOP_BOUND_S

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "arithmetic_tiny.toml"


def run_processes(mark: str) -> dict[int, str]:
    """Every live process whose command line contains ``mark``: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark in cmd and state != "Z":
            found[int(entry.name)] = cmd
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_process_of_the_run_outlives_the_launcher(tmp_path, sig):
    runs = tmp_path / "runs"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "stoa", "train", str(CONFIG), "--runs", str(runs), "--workers", "1",
         "--set", "warmstart.practice_steps=100000", "--set", "trainer.steps=2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 240
        metrics = runs / "arithmetic-tiny" / "metrics.jsonl"
        while not metrics.exists() or len(run_processes(str(runs))) < 3:  # the trainer is past its start
            assert launcher.poll() is None and time.time() < deadline, "the run did not start"
            time.sleep(0.5)
        children = {pid: cmd for pid, cmd in run_processes(str(runs)).items() if pid != launcher.pid}
        assert any(" trainer " in c for c in children.values()) and any(" worker " in c for c in children.values())
        time.sleep(2)  # the worker is past its start too
        t0 = time.time()
        launcher.send_signal(sig)
        bound = STOP_BOUND_S + 10
        while run_processes(str(runs)) and time.time() - t0 < bound + 30:
            time.sleep(0.2)
        took = time.time() - t0
        print(f"{sig.name}: no process of the run left {took:.1f} s after the signal")
        left = run_processes(str(runs))
        assert not left, f"still running {took:.0f} s after {sig.name}: {left}"
        assert took < bound, f"the run's processes took {took:.1f} s to exit after {sig.name}"
        if sig == signal.SIGTERM:
            assert launcher.wait(timeout=5) == 128 + signal.SIGTERM  # stopped as by Ctrl-C
            assert "stopping" in (runs / "arithmetic-tiny" / "trainer.log").read_text()
    finally:
        _kill_everything(runs, launcher)


STEPS_SIGTERM = 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_stoa_train_stops_the_fleet_with_a_checkpoint_and_resume_finishes(tmp_path):
    """SIGTERM is Ctrl-C: the trainer stops after its step with a checkpoint, the run is not
    finished, and ``stoa train --resume`` trains exactly the remaining steps. 30 steps: with the C
    decode step a 6-step run could end before the signal landed."""
    runs = tmp_path / "runs"
    sets = ["--set", "warmstart.practice_steps=2", "--set", "warmstart.steps=2", "--set", "warmstart.batch_size=8",
            "--set", "warmstart.check_every=0", "--set", f"trainer.steps={STEPS_SIGTERM}",
            "--set", "trainer.checkpoint_every=2", "--set", "eval.num_questions=4"]
    cmd = [sys.executable, "-m", "stoa", "train", str(CONFIG), "--runs", str(runs), "--workers", "1", *sets]
    run_dir = runs / "arithmetic-tiny"
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 2):
            assert launcher.poll() is None and time.time() < deadline, "no two RL steps"
            time.sleep(0.3)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=STOP_BOUND_S + 10) == 128 + signal.SIGTERM
        assert not run_processes(str(runs))
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        stopped = [r for r in rows if r.get("event") == "stopped"]
        assert len(stopped) == 1 and 2 <= stopped[0]["rl_step"] < STEPS_SIGTERM, stopped
        assert (run_dir / "checkpoints" / f"v{stopped[0]['version']:012d}").is_dir()
        resumed = subprocess.run(cmd + ["--resume"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        assert resumed.returncode == 0, resumed.stdout.decode(errors="replace")[-3000:]
        ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
        trained = [g for e in ledger for g in e.get("trained", [])]
        assert len([e for e in ledger if "trained" in e]) == STEPS_SIGTERM and len(trained) == len(set(trained))
    finally:
        _kill_everything(runs, launcher)


def _kill_everything(runs, launcher: subprocess.Popen) -> None:
    """Whatever a failed test left of the run: its processes, then the launcher."""
    for pid in run_processes(str(runs)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if launcher.poll() is None:
        launcher.kill()
    launcher.wait()
