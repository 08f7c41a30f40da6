"""`stoa status`: JSON with everything it knows, a layout that fits 80 columns, worker-written
strings escaped, and a clear error for a store or run that is not there."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console, Group

from stoa.fleet.operator.status import clean, fleet_status, render
from stoa.fleet.run import Heartbeat, write_heartbeat
from stoa.transport.signing import generate_private_key, sign_document
from stoa.transport.store import LocalStore

EVIL = "w\x1b]0;pwned\x07\x1b[2J[bold red]x[/bold red]\u202e"
LONG_REASON = ("spot-check failed: the worker's log-probs differ from the trainer's recomputation by 0.91 nats "
               "on 12 of 16 sampled episodes (tolerance 0.05); first at version 7")


def _run(tmp_path: Path) -> tuple[LocalStore, str]:
    store, run, key = LocalStore(tmp_path / "store"), "demo", generate_private_key()
    store.put(f"{run}/config.json", sign_document("run-config", {"config": {"name": run}}, key))
    store.put(f"{run}/current.json", sign_document("pointer", {"version": 9}, key))
    now = time.time()
    for wid, status in (("worker-0", "generating"), ("mac-studio-of-a-volunteer", "ok")):
        write_heartbeat(store, run, Heartbeat(wid, 7, status, 120, 6, 3.5, 812.0, "int8", "host\x1b[0m", now))
    # A heartbeat's key is checked by the store; the id inside it is whatever the worker wrote.
    evil = Heartbeat(EVIL, 7, "waiting\x1b[31m", 120, 6, 3.5, 812.0, "int8", "host\x1b[0m", now)
    store.put(f"{run}/workers/evil.json", evil.to_json())
    report = {"run": run, "version": 9, "mode": "enrolled", "workers": {
        "a" * 16: {"worker_id": "worker-0", "accepted_batches": 6, "trained_episodes": 96, "rejected": {},
                   "spot_checks": 1, "spot_check_failures": 0, "banned": ""},
        "b" * 16: {"worker_id": EVIL, "accepted_batches": 0, "trained_episodes": 0,
                   "rejected": {"audit": 3, "replay": 2}, "spot_checks": 2, "spot_check_failures": 2,
                   "banned": LONG_REASON + " [link=http://x]click[/link]"}},
        "anonymous": {"anon\x1b[5m": {"unsigned": 4}}}
    store.put(f"{run}/trust.json", sign_document("trust-report", report, key))
    return store, run


def test_json_has_every_worker_with_its_trust_record_and_full_reason(tmp_path):
    store, run = _run(tmp_path)
    s = fleet_status(store, run)
    assert s["state"] == "running" and s["head"] == 9 and len(s["workers"]) == 3
    w = {x["worker_id"]: x for x in s["workers"]}
    assert w["worker-0"]["trust"]["accepted_batches"] == 6 and w["worker-0"]["lag"] == 2
    assert w[EVIL]["trust"]["banned"].startswith(LONG_REASON)
    assert w["mac-studio-of-a-volunteer"]["trust"] is None
    json.dumps(s)  # all plain data


def test_the_layout_fits_80_columns_and_shows_no_worker_markup(tmp_path):
    store, run = _run(tmp_path)
    con = Console(width=80, record=True, force_terminal=False, color_system=None)
    con.print(Group(*render(fleet_status(store, run))))
    text = con.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for header in ("worker", "state", "ver", "lag", "seen", "ep/s", "tok/s", "episodes", "accepted", "trained",
                   "rejected", "checks"):
        assert f" {header}" in text or text.startswith(header)
    assert "…" not in text  # nothing cut
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "[bold red]x[/bold red]" in text and "[link=http://x]click[/link]" in text  # shown, not obeyed
    flat = " ".join(text.split())
    assert " ".join(LONG_REASON.split()) in flat  # the whole reason, however it folds


def test_clean_escapes_control_and_format_characters():
    assert clean("a\x1b[31mb\x07\u202ec") == "a\\x1b[31mb\\x07\\u202ec"
    assert clean("x" * 10, limit=5) == "xxxx…"


def _stoa(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stoa", *args], capture_output=True, text=True, timeout=120)


def test_cli_json_and_missing_store_or_run(tmp_path):
    store, run = _run(tmp_path)
    r = _stoa("status", "--store", str(store.root), "--run", run, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["workers"][0]["worker_id"] == "mac-studio-of-a-volunteer"
    r = _stoa("status", "--store", str(store.root), "--run", run)  # piped: rich's 80 columns
    assert r.returncode == 0 and max(len(line) for line in r.stdout.splitlines()) <= 80
    assert "\x1b" not in r.stdout
    gone = tmp_path / "no-such-store"
    r = _stoa("status", "--store", str(gone), "--run", run)
    assert r.returncode == 2 and "no store at" in r.stderr and not gone.exists()
    r = _stoa("status", "--store", str(store.root), "--run", "demo2")
    assert r.returncode == 1 and "no run 'demo2'" in r.stderr and "runs there: demo" in r.stderr
    assert "Traceback" not in r.stderr


def test_watch_streams_json_lines_until_the_run_finishes(tmp_path):
    store, run = _run(tmp_path)
    store.put(f"{run}/finished.json", b"{}")  # unverified read: any marker counts for display
    r = _stoa("status", "--store", str(store.root), "--run", run, "--json", "--watch", "--every", "0.1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["state"] == "finished"


def _no_nan(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_unsigned_documents_are_marked_unverified_and_a_forged_report_never_passes_the_key(tmp_path):
    """Without --public-key, status showed an unsigned trust.json and evaluations as facts: a banned
    cheater shown clean, ESC bytes and rich markup from eval names reaching the screen, and --json
    emitting NaN. Now every store document is verified with the key (a forgery is not shown), and
    without one it is marked unverified; the JSON is strict and every string escaped."""
    store, run = _run(tmp_path)
    run_key = generate_private_key()
    real = {"run": run, "version": 9, "mode": "enrolled", "workers": {
        "c" * 16: {"worker_id": "cheater", "accepted_batches": 0, "banned": "audit: spot-check: forged"}}}
    store.put(f"{run}/trust.json", sign_document("trust-report", real, run_key))
    forged = {"run": run, "version": 9, "mode": "enrolled", "workers": {
        "c" * 16: {"worker_id": "cheater", "accepted_batches": 50, "banned": ""}}}
    store.put(f"{run}/trust.json", json.dumps({"body": json.dumps(forged)}).encode())  # unsigned: the cheater clean
    store.put(f"{run}/eval/v000000000009.json", json.dumps({"body": json.dumps(
        {"version": 9, "metrics": {"eval/pass@1": float("nan"), "eval/[link=http://x]click[/link]\x1b[2J": 0.5,
                                   "eval/searched": "\x1b]0;pwned\x07"}})}).encode())
    store.put(f"{run}/current.json", json.dumps({"body": json.dumps({"version": "9\x1b[2J[blink]"})}).encode())

    r = _stoa("status", "--store", str(store.root), "--run", run, "--json")
    assert r.returncode == 0, r.stderr
    s = _no_nan(r.stdout)
    assert s["verified"] is False and set(s["unverified"]) >= {"trust", "evals"} and "public key" in s["unverified_why"]
    assert s["head"] is None and s["evals"][0]["eval/pass@1"] is None and "eval/searched" not in s["evals"][0]
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    r = _stoa("status", "--store", str(store.root), "--run", run)
    assert r.returncode == 0 and "UNVERIFIED" in r.stdout and "unverified: read without the run's public key" in r.stdout
    assert "\x1b" not in r.stdout and "[link=http://x]click" in r.stdout  # shown as text, not obeyed
    pub = run_key.public_key().public_bytes_raw().hex()
    store.delete(f"{run}/current.json")  # (a pointer that does not verify stops a verified status, as it should)
    r = _stoa("status", "--store", str(store.root), "--run", run, "--public-key", pub, "--json")
    assert r.returncode == 0, r.stderr
    s = _no_nan(r.stdout)
    assert s["verified"] is True and s["unverified"] == [] and s["trust"] is None and s["evals"] == []  # forgeries not shown
    store.put(f"{run}/trust.json", sign_document("trust-report", real, run_key))
    s = _no_nan(_stoa("status", "--store", str(store.root), "--run", run, "--public-key", pub, "--json").stdout)
    assert s["trust"]["workers"]["c" * 16]["banned"] == "audit: spot-check: forged"


def test_a_worker_retrying_a_failure_says_what_fails(tmp_path):
    store, run = _run(tmp_path)
    disk = "cache: OSError: [Errno 28] No space left on device"
    write_heartbeat(store, run, Heartbeat("worker-9", 7, "generating", 1, 1, 1.0, 1.0, "int8", "h", time.time(),
                                          store_retries=3, trouble=disk))
    s = fleet_status(store, run)
    assert {w["worker_id"]: w["store_retries"] for w in s["workers"]}["worker-9"] == 3
    con = Console(width=80, record=True, force_terminal=False, color_system=None)
    con.print(Group(*render(s)))
    assert f"worker-9 is retrying: {disk}" in " ".join(con.export_text().split())
