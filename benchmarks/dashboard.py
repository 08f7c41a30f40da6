"""What ``stoa dashboard`` costs the store per refresh, at 10 to 1,000 workers.

Each case writes a run as the real components write it (``stoa.testing.showrun``: published
versions, one heartbeat per worker, a signed trust report with a record per worker, evaluations),
wraps its store in a counter of reads (get, get_range, list, exists, size), and takes one refresh
after the first (the evaluations are read once and kept). A refresh serves every browser for
``--every`` seconds, so the cost does not grow with viewers; the table says so by polling 20 times
in one interval. Also: the seconds one refresh takes on a local store, and the JSON the page polls.

    python benchmarks/dashboard.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(workers: int, run_dir: bool, viewers: int = 20) -> dict:
    from stoa.fleet.operator.dashboard import Dashboard
    from stoa.testing.showrun import CountingStore, show_run

    with tempfile.TemporaryDirectory() as tmp:
        r = show_run(tmp, workers=workers, versions=9)
        store = CountingStore(r.store)
        dash = Dashboard(store, r.run, r.public_key, r.run_dir if run_dir else None, refresh_s=3600)
        first = dash.snapshot()
        first_reads = sum(store.reads.values())
        store.reads.clear()
        dash._at = 0.0  # the next call reads the store again, as after --every seconds
        t0 = time.perf_counter()
        snap = dash.snapshot()
        seconds = time.perf_counter() - t0
        for _ in range(viewers - 1):
            dash.snapshot()
        assert len(first["workers"]) == workers
        return {"workers": workers, "curves": "metrics.jsonl" if run_dir else "store", "viewers": viewers,
                "first_reads": first_reads, "reads": sum(store.reads.values()), "by_call": dict(store.reads),
                "refresh_s": round(seconds, 4), "json_bytes": len(json.dumps(snap, separators=(",", ":")))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 and 100 workers only (a few seconds)")
    p.add_argument("--json", type=Path, help="write results here")
    a = p.parse_args()
    sizes = (10, 100) if a.quick else (10, 100, 1000)
    rows = [measure(n, run_dir) for n in sizes for run_dir in (False, True)]
    print(f"{'workers':>7} {'curves':>13} {'viewers':>7} {'first':>6} {'reads/refresh':>13} "
          f"{'gets':>5} {'lists':>5} {'refresh s':>9} {'JSON KiB':>8}")
    for r in rows:
        print(f"{r['workers']:>7} {r['curves']:>13} {r['viewers']:>7} {r['first_reads']:>6} {r['reads']:>13} "
              f"{r['by_call'].get('get', 0):>5} {r['by_call'].get('list', 0):>5} {r['refresh_s']:>9.3f} "
              f"{r['json_bytes'] / 1024:>8.1f}")
    if a.json:
        a.json.write_text(json.dumps({"benchmark": "dashboard", "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
