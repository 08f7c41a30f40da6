"""``stoa dashboard``: one run's fleet on a live page in a browser, for the operator and the volunteers.

The page reads what ``stoa status`` reads (:func:`~stoa.fleet.operator.status.fleet_status`: the
store, every document the trainer signs verified under the run's public key) and, given the run
folder, its ``metrics.jsonl`` (what ``stoa report`` plots). :class:`Dashboard` is the data, one
JSON object (``GET /api/state``); :func:`make_app` the read-only ASGI app (starlette) that serves
it with the page, its script and its style; :func:`serve` runs it under uvicorn.

The store is read at most once per ``refresh_s`` however many browsers poll, so a volunteer's tab
costs the store nothing. Evaluation documents are immutable once written: each is read until it
verifies, then kept.

Every string a worker wrote reaches the browser as JSON data and is put in the page as text
(``textContent``), never as markup; the page has no inline script and its Content-Security-Policy
(:data:`CSP`) allows only its own script and the JSON endpoint, so a worker id carrying
``<script>`` is shown, not run.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from stoa.fleet.operator.status import eval_row, fleet_status, strict
from stoa.transport import layout
from stoa.transport.store import ObjectStore

__all__ = ["CSP", "Dashboard", "make_app", "serve", "start"]

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
"""No inline script or style, nothing from another origin: the page's own files and its JSON only."""
STATIC = Path(__file__).with_name("dashboard_static")
MAX_POINTS = 400
"""Points per curve sent to the browser (a long run's curve is thinned evenly, its last point kept)."""
HISTORY = 720
"""Samples of the fleet's tokens/s kept by the server (an hour at one refresh every 5 s)."""
SILENT_AFTER_S = 30.0
"""A heartbeat older than this (and not ``stopped``) marks its worker silent (the trainer's default)."""


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _thin(points: list[list[float]]) -> list[list[float]]:
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / (MAX_POINTS - 1)
    return [points[int(i * step)] for i in range(MAX_POINTS - 1)] + [points[-1]]


def _series(name: str, rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return {"name": name, "points": _thin([[r["version"], r[key]] for r in rows
                                            if _num(r.get(key)) and _num(r.get("version"))])}


def _chart(cid: str, title: str, series: list[dict[str, Any]], *, x: str = "policy version", y: str = "",
           log: bool = False, note: str = "") -> dict[str, Any]:
    return {"id": cid, "title": title, "x": x, "y": y, "log": log, "note": note, "series": series}


class _Tail:
    """The rows of a growing ``metrics.jsonl``, read from where the last call stopped (a torn
    last line waits for its end; a file that shrank is read again from the start)."""

    def __init__(self, path: Path):
        self.path, self.pos, self.rows = path, 0, []  # type: ignore[var-annotated]

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self.pos:
                    self.pos, self.rows = 0, []
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return self.rows
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                self.rows.append(row)
        self.pos += end
        return self.rows


def _standing(w: dict[str, Any], t: dict[str, Any]) -> list[str]:
    """Tags for a worker row, the weightiest first: banned, withholding?, probation, struck, silent,
    stopped, no heartbeat, ok."""
    tags = []
    if t.get("banned"):
        tags.append("banned")
    if t.get("withholding_flagged"):
        tags.append("withholding?")
    if t.get("probation_batches") and t.get("accepted_batches") == t.get("probation_batches"):
        tags.append("probation")
    if t.get("strikes"):
        tags.append("struck")
    if not w:
        tags.append("no heartbeat")
    elif w.get("status") == "stopped":
        tags.append("stopped")
    elif _num(w.get("age_s")) and w["age_s"] > SILENT_AFTER_S:
        tags.append("silent")
    return tags or ["ok"]


_TRUST_FIELDS = ("accepted_batches", "accepted_episodes", "trained_episodes", "rejected_batches", "rejected",
                 "strikes", "spot_checks", "spot_check_failures", "probation_batches", "last_reason", "banned",
                 "last_seen", "last_accepted", "withheld", "withheld_rate", "withholding_flagged", "late_batches")
_BEAT_FIELDS = ("status", "version", "lag", "age_s", "tokens_per_s", "episodes_per_s", "episodes", "batches",
                "mode", "host", "trouble", "store_retries")


def worker_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per worker of a :func:`fleet_status` dict: each heartbeat with its trust record, then
    each key of the trust report that no heartbeat matched (a banned worker that went away)."""
    rows, matched = [], set()
    for w in s["workers"]:
        t = w.get("trust") or {}
        matched.add(t.get("key"))
        rows.append({"worker_id": w["worker_id"], "key": t.get("key"), **{k: w.get(k) for k in _BEAT_FIELDS},
                     **{k: t.get(k) for k in _TRUST_FIELDS}, "standing": _standing(w, t)})
    for kid, t in sorted(((s.get("trust") or {}).get("workers") or {}).items(),
                         key=lambda kv: str(kv[1].get("worker_id"))):
        if kid not in matched:
            rows.append({"worker_id": t.get("worker_id"), "key": kid, **{k: None for k in _BEAT_FIELDS},
                         **{k: t.get(k) for k in _TRUST_FIELDS}, "standing": _standing({}, t)})
    return rows


class Dashboard:
    """The data behind the page: :meth:`snapshot` reads the store (and the run folder) at most once
    every ``refresh_s`` seconds and keeps what the page draws over time (the fleet's tokens/s, the
    head versions' learning figures, every evaluation).

    Args:
        store: the run's object store.
        run: the run's name.
        public_key: the run's public key; without it every signed document is shown marked unverified.
        run_dir: the run folder, for its ``metrics.jsonl`` (the curves of every step); without it the
            curves are the store's evaluations and what this dashboard saw while it ran.
        refresh_s: seconds a snapshot is served before the store is read again.
    """

    def __init__(self, store: ObjectStore, run: str, public_key: Any = None, run_dir: str | Path | None = None,
                 refresh_s: float = 5.0):
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.store, self.run, self.public_key, self.refresh_s = store, run, public_key, float(refresh_s)
        self.run_dir = None if run_dir is None else Path(run_dir)
        self._tail = None if self.run_dir is None else _Tail(self.run_dir / "metrics.jsonl")
        self._lock = threading.Lock()
        self._snap: dict[str, Any] | None = None
        self._at = 0.0
        self._started = time.time()
        self._evals: dict[str, dict[str, Any] | None] = {}  # eval key -> row (None: did not verify or read)
        self._learning: dict[int, dict[str, Any]] = {}
        self._tokens: list[list[float]] = []
        self._head: tuple[Any, float | None] = (None, None)
        self._errors = 0

    def snapshot(self) -> dict[str, Any]:
        """The page's data (strict JSON), read anew when the last read is ``refresh_s`` old.

        Raises:
            RunNotFound: on the first read, when the store holds no such run (later failures are
                shown on the page, with the last good data).
        """
        with self._lock:
            if self._snap is None or time.time() - self._at >= self.refresh_s:
                try:
                    self._snap = self._read()
                except Exception as e:
                    if self._snap is None:
                        raise
                    self._errors += 1
                    self._snap = {**self._snap, "error": f"{type(e).__name__}: {e}"[:500],
                                  "read_failures": self._errors}
                self._at = time.time()
            return self._snap

    def _read(self) -> dict[str, Any]:
        s = fleet_status(self.store, self.run, self.public_key)
        now = time.time()
        workers = worker_rows(s)
        alive = [w for w in workers if w["status"] not in (None, "stopped") and _num(w["age_s"])
                 and w["age_s"] <= SILENT_AFTER_S]
        tokens = sum(w["tokens_per_s"] for w in alive if _num(w["tokens_per_s"]))
        self._tokens = (self._tokens + [[round((now - self._started) / 60, 3), round(tokens, 1)]])[-HISTORY:]
        if s["head"] is not None and s.get("learning"):
            self._learning[s["head"]] = s["learning"]
        if s["head"] != self._head[0]:
            self._head = (s["head"], None if self._head[0] is None and self._snap is None else now)
        rows = self._tail.read() if self._tail is not None else None
        evals, eval_errors = self._store_evals() if rows is None else ([], [])
        trust = s.get("trust") or {}
        return strict({
            "run": s["run"], "state": s["state"], "head": s["head"], "time": now, "refresh_s": self.refresh_s,
            "verified": s["verified"], "unverified": s["unverified"], "unverified_why": s["unverified_why"],
            "steps": sum(r.get("kind") == "train" for r in rows) if rows is not None else s["head"],
            "learning": s.get("learning"), "error": None, "read_failures": self._errors,
            "fleet": {"tokens_per_s": tokens, "workers": len(workers), "alive": len(alive),
                      "banned": sum("banned" in w["standing"] for w in workers)},
            "workers": workers,
            "trust": {k: trust.get(k) for k in ("mode", "version", "time", "keys", "banned_keys")} if trust else None,
            "anonymous": trust.get("anonymous") or {},
            "store": {"last_publish": self._last_publish(s["head"], rows),
                      "rollouts_waiting": s["rollouts_waiting"], "quarantined": s["quarantined"],
                      "read_errors": [f"unreadable heartbeat {k}" for k in s["bad_heartbeats"]] + eval_errors},
            "charts": self._charts(rows, evals),
            "source": "metrics.jsonl" if rows is not None else "store",
        })

    def _store_evals(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Every evaluation in the store, each document read (and verified) once it has verified."""
        for key in self.store.list(layout.eval_prefix(self.run)):
            if self._evals.get(key) is None:  # one that failed is read again (the store may have failed)
                self._evals[key] = eval_row(self.store, key, self.public_key)
        rows = sorted((r for r in self._evals.values() if r is not None), key=lambda r: r["version"])
        return rows, [f"evaluation {k} does not verify or parse" for k, r in self._evals.items() if r is None]

    def _last_publish(self, head: Any, rows: list[dict[str, Any]] | None) -> dict[str, Any]:
        if head is None:
            return {"version": None, "time": None, "how": "nothing published yet"}
        if rows:
            t = next((r.get("time") for r in reversed(rows) if r.get("kind") == "train" and r.get("version") == head),
                     None)
            if _num(t):
                return {"version": head, "time": t, "how": "metrics.jsonl"}
        t = self._head[1]
        return {"version": head, "time": t, "how": "seen by this dashboard" if t else "before this dashboard started"}

    def _charts(self, rows: list[dict[str, Any]] | None, evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
        tokens = _chart("tokens", "Fleet tokens/s", [{"name": "sampled tokens/s (live workers)",
                                                       "points": _thin(self._tokens)}],
                        x="minutes since this dashboard started", y="tokens/s")
        if rows is None:
            learn = sorted(self._learning.items())
            need = "with --run-dir (the run folder's metrics.jsonl)"
            head = [k for k in (evals[-1] if evals else {}) if k.startswith("eval/") and not k.endswith(".n")
                    and k not in ("eval/pass@1", "eval/seconds", "eval/questions")][:4]
            return [
                _chart("eval", "Held-out evaluation (the store's)", [_series("pass@1", evals, "eval/pass@1"),
                       *(_series(k[len("eval/"):], evals, k) for k in head)]),
                _chart("reward", "Reward (head versions seen)",
                       [{"name": "mean reward", "points": [[v, lr["reward"]] for v, lr in learn]}]),
                _chart("signal", "Learning signal (head versions seen)",
                       [{"name": "groups/signal_frac", "points": [[v, lr["signal_frac"]] for v, lr in learn]}],
                       y="share of groups"),
                tokens,
                _chart("gate", "DPPO gate", [], note=need),
                _chart("staleness", "Staleness", [], note=need),
                _chart("pulse", "PULSE bytes per version", [], note=need),
            ]
        ev = [r for r in rows if r.get("kind") == "eval"]
        train = [r for r in rows if r.get("kind") == "train"]
        headline = next((list(r.get("headline") or []) for r in rows
                         if r.get("kind") == "event" and r.get("event") == "started"), [])
        pub = [r for r in train if not r.get("pulse/anchor")]
        return [
            _chart("eval", "Held-out evaluation", [_series("pass@1", ev, "eval/pass@1"),
                   *(_series(str(m), ev, f"eval/{m}") for m in headline[:4])]),
            _chart("reward", "Reward", [_series("reward/mean", train, "reward/mean")]),
            _chart("signal", "Learning signal", [_series("groups/signal_frac", train, "groups/signal_frac")],
                   y="share of groups"),
            tokens,
            _chart("gate", "DPPO gate", [_series("masked", train, "gate/masked_frac")], y="share of model tokens"),
            _chart("staleness", "Staleness", [_series("mean", train, "staleness/mean"),
                                              _series("max", train, "staleness/max")], y="versions behind"),
            _chart("pulse", "PULSE bytes per version", [_series("delta", pub, "pulse/bytes"),
                                                        _series("full int8 state", train, "pulse/full_bytes")],
                   y="bytes", log=True),
        ]


_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
          "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
          "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-store"}


def make_app(dash: Dashboard, allowed_hosts: list[str] | None = None) -> Any:
    """The read-only ASGI app: ``GET /`` (the page), ``/dashboard.js``, ``/dashboard.css`` and
    ``/api/state`` (:meth:`Dashboard.snapshot` as JSON); every response carries :data:`HEADERS`.
    ``allowed_hosts``: Host header values accepted (a page on another site cannot reach a
    loopback dashboard by rebinding its DNS name); None accepts any."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    files = {path: ((STATIC / name).read_bytes(), kind) for path, (name, kind) in _FILES.items()}

    def static(path: str) -> Any:
        body, kind = files[path]

        async def endpoint(request: Request) -> Response:
            return Response(body, media_type=kind, headers=HEADERS)
        return endpoint

    async def state(request: Request) -> Response:
        snap = await run_in_threadpool(dash.snapshot)
        return Response(json.dumps(snap, allow_nan=False, separators=(",", ":")), media_type="application/json",
                        headers=HEADERS)

    routes = [Route(p, static(p), methods=["GET"]) for p in files] + [Route("/api/state", state, methods=["GET"])]
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)] if allowed_hosts else []
    return Starlette(routes=routes, middleware=middleware)


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def start(dash: Dashboard, host: str = "127.0.0.1", port: int = 0) -> tuple[Any, Any, str]:
    """Bind ``host:port`` (0: a free port) and prepare uvicorn; returns ``(server, socket, url)``.
    Call ``server.run(sockets=[socket])`` (blocks; ``server.should_exit = True`` stops it)."""
    import socket

    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    hosts = [*_LOOPBACK, "[::1]"] if host in _LOOPBACK else None
    app = make_app(dash, hosts)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    shown = f"[{host}]" if ":" in host else host
    return server, sock, f"http://{shown}:{bound}/"


def serve(dash: Dashboard, host: str = "127.0.0.1", port: int = 8765, on_ready: Any = print) -> None:
    """Serve the page until interrupted; ``on_ready(line)`` is told the URL once it is bound."""
    server, sock, url = start(dash, host, port)
    on_ready(f"stoa dashboard of {dash.run}: {url}  (a volunteer's row: {url}#worker=<worker id>; Ctrl-C stops)")
    server.run(sockets=[sock])
