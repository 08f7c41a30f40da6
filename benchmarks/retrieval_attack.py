"""The retriever server under the slow-client attack, at several descriptor limits.

For each ``RLIMIT_NOFILE`` (128, 256 and 1024; macOS's default is 256) a child process lowers its
soft limit with ``resource.setrlimit``, then builds a small BM25 index and serves it on
127.0.0.1. In this process an attacker opens 256 connections (the server's nominal
``max_connections``), sends half a request on each, and re-opens every connection the server
drops, for the whole phase. Meanwhile an honest client (``HTTPRetriever``, no retries, a short
timeout) sends one-query requests one after another. The baseline is the same honest load with
no attacker, on the same server, measured in the same run. With ``--before`` each limit whose
cap the descriptor limit lowers is also run with the cap forced back to the nominal 256, as
before the cap followed the limit. Everything stays on 127.0.0.1; every loop is bounded
in count and in time, and the children stop when this process does.

    python benchmarks/retrieval_attack.py --quick            # < 1 min
    python benchmarks/retrieval_attack.py --before --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from stoa.envs.retrieval import BM25SRetriever, Document, HTTPRetriever, RetrieverError
from stoa.envs.server import ServerLimits, make_server

HALF = b"POST /retrieve HTTP/1.1\r\nContent-Le"
LIMITS = (128, 256, 1024)
ATTACKERS = ServerLimits().max_connections
DOCS = [Document(f"d{i}", f"Protein{i}", f"Protein{i} inhibits the kinase Kin{i} in hepatocytes.") for i in range(50)]
CHILD_LIFETIME_S = 600.0


def honest(url: str, n: int, timeout: float, max_s: float) -> dict:
    """Up to ``n`` one-query requests, one after another, for at most ``max_s`` seconds."""
    client, ok, lat, tried = HTTPRetriever(url, retries=0, timeout=timeout), 0, [], 0
    deadline = time.monotonic() + max_s
    while tried < n and time.monotonic() < deadline:
        t0 = time.perf_counter()
        tried += 1
        try:
            client.search([f"Protein{tried % 50}"], 3)
            ok += 1
            lat.append(time.perf_counter() - t0)
        except RetrieverError:
            pass
    return {"tried": tried, "answered": ok, "failed": tried - ok,
            "p50_ms": 1e3 * float(np.median(lat)) if lat else None,
            "p95_ms": 1e3 * float(np.percentile(lat, 95)) if lat else None}


def attack(port: int, conns: int, stop: threading.Event, counts: dict[str, int], max_s: float = 120.0) -> None:
    """Hold ``conns`` half-sent requests open, re-opening each one the server drops, until ``stop``
    (or ``max_s`` seconds)."""
    held: list[socket.socket] = []
    deadline = time.monotonic() + max_s  # bounded whatever happens
    for _ in range(conns):
        if stop.is_set() or time.monotonic() > deadline:
            break
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(HALF)
        except OSError:
            continue
        held.append(s)
        counts["held"] = len(held)
    counts["held"] = len(held)
    while not stop.is_set() and time.monotonic() < deadline:
        ready = select.select(held, [], [], 0.01)[0] if held else []
        for s in ready:
            i = held.index(s)
            s.close()
            try:
                held[i] = socket.create_connection(("127.0.0.1", port), timeout=5)
                held[i].sendall(HALF)
                counts["reopened"] += 1
            except OSError:
                held[i] = socket.socket()
    for s in held:
        s.close()


def serve_child(limit: int, nominal: bool) -> None:
    """The child: lower the descriptor limit, serve, answer ``stats`` lines on stdin until EOF."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    watchdog = threading.Timer(CHILD_LIFETIME_S, lambda: os._exit(3))  # never outlives a stuck parent for long
    watchdog.daemon = True
    watchdog.start()
    srv = make_server(BM25SRetriever.build(DOCS), "127.0.0.1", 0, ServerLimits())
    if nominal:
        srv.max_connections = srv.limits.max_connections  # the server before the cap followed the limit
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(json.dumps({"port": srv.server_address[1], "cap": getattr(srv, "max_connections", srv.limits.max_connections),
                      "limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}), flush=True)
    for line in sys.stdin:
        if line.strip() != "stats":
            break
        print(json.dumps({"evicted": srv.evicted, "refused": srv.refused, "timed_out": srv.timed_out}), flush=True)
    os._exit(0)


def measure(limit: int, nominal: bool, requests: int, timeout: float, phase_s: float) -> dict:
    """A baseline and an attacked phase against one child server at ``limit``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--serve-child", str(limit)] + (["--nominal"] if nominal else [])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        hello = json.loads(proc.stdout.readline())
        port = hello["port"]
        url = f"http://127.0.0.1:{port}"
        out = {"limit": hello["limit"], "cap": hello["cap"], "nominal": nominal,
               "baseline": honest(url, requests, timeout, phase_s)}
        stop, counts = threading.Event(), {"held": 0, "reopened": 0}
        t = threading.Thread(target=attack, args=(port, ATTACKERS, stop, counts), daemon=True)
        t.start()
        fill = time.monotonic() + 20
        while counts["held"] < ATTACKERS and t.is_alive() and time.monotonic() < fill:
            time.sleep(0.01)
        out["attack"] = honest(url, requests, timeout, phase_s)
        stop.set()
        t.join(30)
        out["attacker"] = dict(counts)
        proc.stdin.write("stats\n")
        proc.stdin.flush()
        out["server"] = json.loads(proc.stdout.readline())
        return out
    finally:
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _raise_own_limit(need: int) -> None:
    """This process holds the attacker's sockets: make room for them where the hard limit allows."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 honest requests per phase, 1 s timeout (< 1 min)")
    ap.add_argument("--requests", type=int, default=None, help="honest requests per phase (default 200)")
    ap.add_argument("--limits", type=int, nargs="+", default=list(LIMITS), help="RLIMIT_NOFILE values to run")
    ap.add_argument("--before", action="store_true",
                    help="also run each lowered limit with the cap forced back to the nominal 256")
    ap.add_argument("--json", type=str, default=None, help="write the results here")
    ap.add_argument("--serve-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--nominal", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_child is not None:
        serve_child(a.serve_child, a.nominal)
        return
    _raise_own_limit(4 * ATTACKERS + 64)
    n = a.requests or (30 if a.quick else 200)
    timeout, phase_s = (1.0, 6.0) if a.quick else (2.0, 30.0)
    rows = []
    for limit in a.limits:
        r = measure(limit, False, n, timeout, phase_s)
        rows.append(r)
        if a.before and r["cap"] < ServerLimits().max_connections:
            rows.append(measure(limit, True, n, timeout, phase_s))
    print(f"honest client: up to {n} requests a phase, {timeout:g} s timeout, {phase_s:g} s a phase; "
          f"attacker: {ATTACKERS} half-sent requests, re-opened when dropped")
    print(f"{'RLIMIT_NOFILE':>13} {'cap':>12} {'phase':>9} {'answered':>10} {'failed':>7} {'p50 ms':>8} "
          f"{'p95 ms':>8} {'p50 vs base':>12} {'evicted':>8} {'503s':>5}")
    for r in rows:
        base = r["baseline"]["p50_ms"]
        cap = f"{r['cap']}{' (forced)' if r['nominal'] else ''}"
        for phase in ("baseline", "attack"):
            p = r[phase]
            ratio = f"{p['p50_ms'] / base:.2f}x" if p["p50_ms"] and base else "-"
            p50 = f"{p['p50_ms']:.2f}" if p["p50_ms"] is not None else "-"
            p95 = f"{p['p95_ms']:.2f}" if p["p95_ms"] is not None else "-"
            ev = str(r["server"]["evicted"]) if phase == "attack" else ""
            ref = str(r["server"]["refused"]) if phase == "attack" else ""
            print(f"{r['limit']:>13} {cap:>12} {phase:>9} {p['answered']:>5}/{p['tried']:<4} {p['failed']:>7} "
                  f"{p50:>8} {p95:>8} {ratio:>12} {ev:>8} {ref:>5}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
