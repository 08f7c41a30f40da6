"""The retriever server under the slow-client attack: honest clients' answers and latency.

An attacker on loopback opens as many connections as the server admits (``max_connections``),
sends half a request on each, and re-opens every connection the server drops, for the whole
run. Meanwhile honest clients (``HTTPRetriever``, no retries, 10 s timeout) send one-query
requests one after another. The baseline is the same honest load with no attacker, measured in
the same run. Everything stays on 127.0.0.1 and stops by itself.

    python benchmarks/retrieval_attack.py --quick            # < 1 min
    python benchmarks/retrieval_attack.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import threading
import time

import numpy as np

from stoa.envs.retrieval import BM25SRetriever, Document, HTTPRetriever, RetrieverError
from stoa.envs.server import ServerLimits, make_server

HALF = b"POST /retrieve HTTP/1.1\r\nContent-Le"


def honest(url: str, n: int) -> tuple[int, list[float]]:
    client, ok, lat = HTTPRetriever(url, retries=0, timeout=10), 0, []
    for i in range(n):
        t0 = time.perf_counter()
        try:
            client.search([f"Protein{i % 50}"], 3)
            ok += 1
            lat.append(time.perf_counter() - t0)
        except RetrieverError:
            pass
    return ok, lat


def attack(port: int, conns: int, stop: threading.Event, counts: dict[str, int]) -> None:
    held = []
    deadline = time.monotonic() + 120  # bounded whatever happens
    for _ in range(conns):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(HALF)
        held.append(s)
    counts["held"] = len(held)
    while not stop.is_set() and time.monotonic() < deadline:
        ready = select.select(held, [], [], 0.01)[0]
        for s in ready:
            i = held.index(s)
            s.close()
            try:
                held[i] = socket.create_connection(("127.0.0.1", port), timeout=10)
                held[i].sendall(HALF)
                counts["reopened"] += 1
            except OSError:
                held[i] = socket.socket()
    for s in held:
        s.close()


def run(requests: int) -> dict[str, dict]:
    docs = [Document(f"d{i}", f"Protein{i}", f"Protein{i} inhibits the kinase Kin{i} in hepatocytes.")
            for i in range(50)]
    srv = make_server(BM25SRetriever.build(docs), "127.0.0.1", 0, ServerLimits())
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url, port = f"http://127.0.0.1:{srv.server_address[1]}", srv.server_address[1]
    out = {}
    try:
        for name in ("no attack", "attack"):
            stop, counts = threading.Event(), {"held": 0, "reopened": 0}
            t = None
            if name == "attack":
                t = threading.Thread(target=attack, args=(port, ServerLimits().max_connections, stop, counts),
                                     daemon=True)
                t.start()
                while counts["held"] < ServerLimits().max_connections and t.is_alive():
                    time.sleep(0.01)
            t0 = time.perf_counter()
            ok, lat = honest(url, requests)
            wall = time.perf_counter() - t0
            stop.set()
            if t is not None:
                t.join()
            out[name] = {"requests": requests, "answered": ok, "p50_ms": 1e3 * float(np.median(lat)) if lat else None,
                         "p95_ms": 1e3 * float(np.percentile(lat, 95)) if lat else None, "wall_s": wall,
                         "attacker_connections": counts["held"], "attacker_reopened": counts["reopened"],
                         "evicted": getattr(srv, "evicted", None), "refused": getattr(srv, "refused", None)}
    finally:
        srv.shutdown()
        srv.server_close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="50 honest requests per phase (< 1 min)")
    ap.add_argument("--requests", type=int, default=None, help="honest requests per phase (default 300)")
    ap.add_argument("--json", type=str, default=None, help="write the results here")
    a = ap.parse_args()
    n = a.requests or (50 if a.quick else 300)
    res = run(n)
    base = res["no attack"]
    print(f"{'phase':<10} {'answered':>10} {'p50 ms':>8} {'p95 ms':>8} {'p50 vs base':>12} {'held':>6} {'evicted':>8} {'503s':>6}")
    for name, r in res.items():
        ratio = (r["p50_ms"] / base["p50_ms"]) if r["p50_ms"] and base["p50_ms"] else float("nan")
        p50 = f"{r['p50_ms']:.2f}" if r["p50_ms"] is not None else "-"
        p95 = f"{r['p95_ms']:.2f}" if r["p95_ms"] is not None else "-"
        print(f"{name:<10} {r['answered']:>5}/{r['requests']:<4} {p50:>8} {p95:>8} {ratio:>11.2f}x "
              f"{r['attacker_connections']:>6} {str(r['evicted']):>8} {str(r['refused']):>6}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
