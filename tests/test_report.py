"""`stoa report RUN_DIR` (plots and summary for any run folder, trust included, worker strings
escaped), the piped progress log (one record a line, no wrapping at 80 columns) and optional W&B."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from stoa.fleet.config import RunConfig
from stoa.fleet.metrics import MetricsSink
from stoa.fleet.operator.launcher import _plain_line
from stoa.transport.signing import generate_private_key, sign_document
from stoa.transport.store import LocalStore

EVIL = "mallory\x1b[2J<img src=x onerror=alert(1)>|*x*"


def _trainer_only_run(tmp_path: Path) -> Path:
    """A run folder as a lone `stoa trainer` leaves it: config.json and metrics.jsonl, no summary."""
    run_dir = tmp_path / "runs" / "solo"
    sink = MetricsSink(run_dir, tensorboard=False, wandb=False)
    (run_dir / "config.json").write_text(RunConfig(name="solo").to_json())
    sink.log("event", 0, event="started", headline=["searched"])
    sink.log("eval", 0, **{"eval/pass@1": 0.1, "eval/searched": 0.2, "eval/questions": 50, "eval/seconds": 1.0})
    for v in range(1, 11):
        sink.log("train", v, **{"reward/mean": 0.1 * v, "rollout/searched": 0.5, "gate/masked_frac": 0.001,
                                "staleness/mean": 0.5, "staleness/lag0": 8, "staleness/lag1": 8,
                                "pulse/bytes": 1234 + v, "pulse/full_bytes": 100000, "fleet/workers_alive": 3,
                                "memory/peak_rss_gib": 1.5 + 0.1 * min(v, 4)})
    sink.log("event", 10, event="banned", worker=EVIL, reason="spot-check failed\x07 " + "x" * 200)
    sink.log("eval", 10, **{"eval/pass@1": 0.6, "eval/searched": 0.9, "eval/questions": 50, "eval/seconds": 1.0})
    sink.close()
    return run_dir


def test_report_of_a_trainer_only_run_with_trust(tmp_path):
    run_dir = _trainer_only_run(tmp_path)
    store = LocalStore(tmp_path / "store")
    report = {"run": "solo", "version": 10, "mode": "open", "workers": {
        "k" * 16: {"worker_id": EVIL, "accepted_batches": 2, "trained_episodes": 32, "rejected": {"audit": 4},
                   "banned": "spot-check failed [b]x[/b]"},
        "j" * 16: {"worker_id": "worker-1", "accepted_batches": 9, "trained_episodes": 144, "rejected": {},
                   "banned": ""}}}
    store.put("solo/trust.json", sign_document("trust-report", report, generate_private_key()))
    r = subprocess.run([sys.executable, "-m", "stoa", "report", str(run_dir), "--store", str(store.root)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    md = (run_dir / "summary.md").read_text()
    assert r.stdout == md
    assert "| pass@1 | 10.0% | 60.0% | +50.0 points |" in md and "3 int8 workers" in md
    assert "trainer peak memory 1.9 GiB" in md
    assert "## Trust (mode open, as of version 10)" in md and "2 worker keys, 1 banned." in md
    assert "| worker-1 | 9 | 144 | - | - |" in md
    assert "\x1b" not in md and "<img" not in md and "&lt;img" in md and "\\|\\*x\\*" in md
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["delta_bytes.png", "gate_fraction.png",
                                                                    "pass_at_1.png"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trust"]["workers"][0]["banned"] == "spot-check failed [b]x[/b]"


def test_report_refuses_a_folder_that_is_no_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "stoa", "report", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "is not a run folder" in r.stderr and "Traceback" not in r.stderr


def test_piped_progress_log_is_one_record_a_line(tmp_path):
    run_dir = _trainer_only_run(tmp_path)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in (_plain_line(r, ["searched"]) for r in rows) if line]
    assert len(lines) == 6  # two evals, versions 1, 5 and 10 (the first and every fifth), the ban event
    plain = [_plain_line(r, []) for r in rows if r["kind"] in ("train", "eval")]
    assert all(len(line) <= 80 for line in plain if line)  # a task's headline metrics may add a few words
    event = next(line for line in lines if " event " in line)
    assert "banned" in event and "\x1b" not in event and "\x07" not in event and "\\x1b[2J" in event
    out = io.StringIO()
    con = Console(file=out, width=80, force_terminal=False)
    for line in lines:
        con.out(line, highlight=False)
    assert out.getvalue().splitlines() == lines  # nothing wrapped, however long


def test_wandb_logs_offline_when_installed(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (optional): W&B logging not tested")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "stoa-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(tmp_path / "run", tensorboard=False)
    assert sink._wandb is not None
    sink.log("train", 1, **{"reward/mean": 0.5})
    sink.close()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_metrics_without_wandb_project_stay_local(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    sink = MetricsSink(tmp_path / "run", tensorboard=False)
    assert sink._wandb is None
    sink.log("train", 1, **{"reward/mean": 0.5, "t": time.time()})
    sink.close()
    assert not (tmp_path / "run" / "wandb").exists()


def test_report_verifies_the_stores_trust_report_or_says_it_is_unverified(tmp_path):
    """`stoa report` showed an unsigned trust.json as the trainer's: a banned cheater shown clean.
    Now it reads the trainer's own copy in the run folder, else verifies the store's with the run's
    key (keys/run.pub, or --public-key), and without a key says plainly the report is unverified."""
    from stoa.transport.signing import save_keypair

    run_dir = _trainer_only_run(tmp_path)
    store = LocalStore(tmp_path / "store")
    forged = {"run": "solo", "version": 10, "mode": "open", "workers": {
        "c" * 16: {"worker_id": "cheater", "accepted_batches": 50, "trained_episodes": 800, "rejected": {},
                   "banned": ""}}}
    store.put("solo/trust.json", json.dumps({"body": json.dumps(forged)}).encode())

    def report(*extra: str) -> str:
        r = subprocess.run([sys.executable, "-m", "stoa", "report", str(run_dir), "--store", str(store.root), *extra],
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        json.loads((run_dir / "summary.json").read_text(), parse_constant=lambda c: 1 / 0)  # strict JSON
        return (run_dir / "summary.md").read_text()

    assert "**Unverified**: read from the store without the run's public key" in report()
    key, pub = save_keypair(generate_private_key(), run_dir / "keys", "run")
    md = report()  # keys/run.pub in the run folder: the forgery does not verify, and is not shown
    assert "does not verify" in md and "cheater" not in md
    real = {"run": "solo", "version": 10, "mode": "open", "workers": {
        "c" * 16: {"worker_id": "cheater", "accepted_batches": 0, "trained_episodes": 0, "rejected": {"audit": 1},
                   "banned": "audit: spot-check: forged <img src=x>"}}}
    store.put("solo/trust.json", sign_document("trust-report", real, key))
    md = report("--public-key", str(pub))
    assert "| cheater | 0 | 0 | audit 1 | audit: spot-check: forged &lt;img src=x&gt; |" in md and "Unverified" not in md
    (run_dir / "roster").mkdir()
    (run_dir / "roster" / "trust.json").write_text(json.dumps({**real, "workers": {}, "operator": True}))
    assert "0 worker keys" in report()  # the trainer's own copy comes first
