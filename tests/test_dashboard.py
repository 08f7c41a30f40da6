"""`stoa dashboard`: the JSON and the page over plain HTTP, the page in a real headless Chromium
(a worker's row, a ban reason, curves with the right number of points, a volunteer's link), a
worker's HTML shown as text and never run, and what a refresh costs the store."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from stoa.fleet.operator.dashboard import CSP, Dashboard, start  # noqa: E402
from stoa.fleet.run import Heartbeat  # noqa: E402
from stoa.testing.showrun import CountingStore, show_run  # noqa: E402

EVIL_ID = "<img src=x onerror=\"document.title='pwned';document.body.appendChild(document.createElement('pwned'))\">"
EVIL_REASON = ("audit: spot-check: <script>document.title='pwned'</script><b id=pwned>bold</b> "
               "log-probs differ by 0.9 nats")
CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (scripts/setup.sh installs Debian's)")


def _run(tmp_path: Path, workers: int = 3):
    now = time.time()
    evil = Heartbeat(EVIL_ID, 1, "generating", 8, 1, 1.0, 99.0, "int8", "<b>host</b>", now)
    trust = {
        "e" * 16: {"worker_id": EVIL_ID, "accepted_batches": 0, "rejected": {"audit": 3}, "strikes": 3,
                   "banned": EVIL_REASON, "last_reason": EVIL_REASON},
        "f" * 16: {"worker_id": "gone-cheater", "rejected": {"replay": 2}, "strikes": 2,
                   "banned": "replay: the same episodes twice"},
        "d" * 16: {"worker_id": "slow-mac", "accepted_batches": 3, "rejected": {"duplicate": 1}, "strikes": 1,
                   "last_reason": "duplicate: batch 4 repeats batch 3", "withheld": 5, "withheld_rate": 0.5,
                   "withholding_flagged": True, "max_seq": 9, "batches_seen": 5},
        "c" * 16: {"worker_id": "newcomer", "accepted_batches": 2, "probation_batches": 2},
    }
    return show_run(tmp_path, workers=workers, versions=5, extra_workers=[evil], trust_extra=trust)


@contextmanager
def serving(dash: Dashboard):
    server, sock, url = start(dash, "127.0.0.1", 0)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        t.join(10)


def _get(url: str, host: str | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_json_endpoint_and_page_over_plain_http(tmp_path):
    r = _run(tmp_path)
    with serving(Dashboard(r.store, r.run, r.public_key, r.run_dir)) as url:
        assert url.startswith("http://127.0.0.1:")
        code, headers, page = _get(url)
        assert code == 200 and headers["Content-Security-Policy"] == CSP and "'unsafe-inline'" not in CSP
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert re.findall(rb"<script[^>]*>[^<]*", page) == [b'<script src="dashboard.js" defer>']  # no inline script
        code, headers, js = _get(url + "dashboard.js")
        assert code == 200 and headers["Content-Type"].startswith("text/javascript")
        assert b"innerHTML" not in js and b"insertAdjacentHTML" not in js and b"eval(" not in js
        code, headers, body = _get(url + "api/state")
        assert code == 200 and headers["Content-Type"] == "application/json"
        s = json.loads(body, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert s["verified"] and s["head"] == r.head and s["state"] == "running" and s["steps"] == r.train_steps
    w = {x["worker_id"]: x for x in s["workers"]}
    assert w[EVIL_ID]["banned"] == EVIL_REASON and w[EVIL_ID]["standing"][0] == "banned"  # data, as it is
    assert w["gone-cheater"]["status"] is None and "no heartbeat" in w["gone-cheater"]["standing"]
    assert w["slow-mac"]["standing"][:2] == ["withholding?", "struck"] and w["newcomer"]["standing"][0] == "probation"
    assert w["worker-1"]["lag"] == 1 and w["worker-0"]["tokens_per_s"] == 400.0
    charts = {c["id"]: c for c in s["charts"]}
    assert [len(x["points"]) for x in charts["eval"]["series"]] == [len(r.evals)] * 2
    assert len(charts["pulse"]["series"][0]["points"]) == r.train_steps and charts["pulse"]["log"]
    assert s["store"]["rollouts_waiting"] == 3 and s["store"]["quarantined"] == 1
    assert s["store"]["last_publish"] == {"version": r.head, "time": pytest.approx(time.time(), abs=60),
                                          "how": "metrics.jsonl"}
    assert s["fleet"]["alive"] == 4 and s["fleet"]["banned"] == 2


def test_loopback_refuses_other_host_names_and_every_write(tmp_path):
    """A page on another site cannot read a loopback dashboard by pointing its own name at 127.0.0.1."""
    r = _run(tmp_path)
    with serving(Dashboard(r.store, r.run, r.public_key)) as url:
        assert _get(url + "api/state", host="evil.example")[0] == 400
        assert _get(url + "api/state", host="localhost")[0] == 200
        req = urllib.request.Request(url + "api/state", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=20)
        assert e.value.code == 405


def test_store_only_curves_and_a_failing_store_keep_the_last_data(tmp_path):
    r = _run(tmp_path)
    dash = Dashboard(r.store, r.run, r.public_key, refresh_s=0.05)
    s = dash.snapshot()
    charts = {c["id"]: c for c in s["charts"]}
    assert s["source"] == "store" and [p[0] for p in charts["eval"]["series"][0]["points"]] == r.evals
    assert charts["signal"]["series"][0]["points"] == [[r.head, pytest.approx(0.8)]]
    assert charts["pulse"]["series"] == [] and "--run-dir" in charts["pulse"]["note"]
    r.store.put(f"{r.run}/eval/v000000000099.json", b'{"body": "{}"}')  # forged: not verified, reported
    time.sleep(0.06)
    s = dash.snapshot()
    assert len(s["charts"][0]["series"][0]["points"]) == len(r.evals)
    assert any("v000000000099" in e for e in s["store"]["read_errors"])

    def broken(*a, **kw):
        raise OSError("the store is unreachable")

    dash.store = type("Broken", (), {"__getattr__": lambda self, name: broken})()
    time.sleep(0.06)
    s2 = dash.snapshot()
    assert "unreachable" in s2["error"] and s2["read_failures"] == 1 and s2["workers"] == s["workers"]


def test_store_reads_per_refresh_at_100_workers_and_many_viewers(tmp_path):
    """The page's cost on the store: one read of each heartbeat and a dozen more per refresh, however
    many browsers poll (benchmarks/dashboard.py prints the table)."""
    r = show_run(tmp_path, workers=100, versions=5)
    store = CountingStore(r.store)
    dash = Dashboard(store, r.run, r.public_key, refresh_s=60)
    dash.snapshot()
    store.reads.clear()
    dash._at = 0.0  # the next snapshot reads again
    for _ in range(20):  # 20 browsers in one refresh interval
        dash.snapshot()
    reads = sum(store.reads.values())
    # 100 heartbeats; the pointer, the head's manifest, the trust report, the last evaluations (at most
    # 5), the finished marker; six listings and one existence check.
    assert 100 < store.reads["get"] <= 100 + 8 and reads <= 100 + 16, dict(store.reads)


# -- in a real browser ----------------------------------------------------------------------------

class _Dom(HTMLParser):
    """Table rows (attributes and cell texts) and every element's attributes, from a DOM dump."""

    def __init__(self, html: str):
        super().__init__()
        self.rows: list[tuple[dict, list[str]]] = []
        self.elements: list[tuple[str, dict]] = []
        self._cell: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.elements.append((tag, a))
        if tag == "tr":
            self.rows.append((a, []))
        elif tag == "td" and self.rows:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.rows[-1][1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def by_id(self, id_: str) -> dict:
        return next(a for _, a in self.elements if a.get("id") == id_)


def _chromium(*args: str) -> str:
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--no-first-run", "--virtual-time-budget=4000", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@needs_chromium
def test_the_page_in_headless_chromium_shows_workers_bans_and_curves_and_runs_no_worker_text(tmp_path):
    r = _run(tmp_path)
    with serving(Dashboard(r.store, r.run, r.public_key, r.run_dir)) as url:
        html = _chromium("--dump-dom", url)
        shot = tmp_path / "dashboard.png"
        _chromium("--screenshot=" + str(shot), "--window-size=1280,1600", "--hide-scrollbars", url)
        mine = _chromium("--dump-dom", url + "#worker=worker-1")
    print(f"\nscreenshot: {shot}")
    assert shot.stat().st_size > 20_000
    dom = _Dom(html)
    rows = {cells[0]: (a, cells) for a, cells in dom.rows if cells}
    assert {"worker-0", "worker-1", "worker-2", "slow-mac", "newcomer", "gone-cheater", EVIL_ID} <= set(rows)
    cells = rows["worker-1"][1]
    assert cells[1] == "ok" and cells[2] == "generating" and cells[4] == "1" and cells[6] == "401"  # lag, tokens/s
    assert rows["slow-mac"][1][1].startswith("withholding?struck") and rows[EVIL_ID][1][1].startswith("banned")
    assert "replay: the same episodes twice" in html  # a ban reason, in full
    assert EVIL_REASON.replace("<", "&lt;").replace(">", "&gt;") in html  # shown as text
    # Nothing from a worker's text became markup or ran: no <img>, no <b id=pwned>, no <pwned>, title kept.
    assert not any(tag in ("img", "pwned", "b") or a.get("id") == "pwned" for tag, a in dom.elements)
    assert "<title>Stoa dashboard</title>" in html and "pwned</title>" not in html
    for chart, n in (("chart-eval", 2 * len(r.evals)), ("chart-pulse", 2 * r.train_steps),
                     ("chart-signal", r.train_steps)):
        assert dom.by_id(chart)["data-points"] == str(n)
        body = html[html.index(f'id="{chart}"'):]
        body = body[:body.index("</svg>")]
        assert body.count("<circle") == n
    assert 'class="chip running"' in html and "read errors" in html
    dom = _Dom(mine)
    marked = [cells[0] for a, cells in dom.rows if "mine" in (a.get("class") or "")]
    assert marked == ["worker-1"] and "hidden" not in dom.by_id("mine")


def test_cli_serves_the_page_and_refuses_a_missing_run(tmp_path):
    r = _run(tmp_path)
    cmd = [sys.executable, "-m", "stoa", "dashboard", "--store", str(r.store.root), "--run", r.run, "--port", "0",
           "--public-key", r.public_key.public_bytes_raw().hex(), "--run-dir", str(r.run_dir)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        assert "#worker=" in line
        time.sleep(0.3)  # uvicorn starts accepting right after the line
        code, _, body = _get(url + "api/state")
        assert code == 200 and json.loads(body)["run"] == r.run
    finally:
        p.terminate()
        p.wait(20)
    out = subprocess.run([sys.executable, "-m", "stoa", "dashboard", "--store", str(r.store.root), "--run", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no run 'nope'" in out.stderr and "Traceback" not in out.stderr
