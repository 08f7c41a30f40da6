"""An example over many seeds: its version-0 and final figures per seed, and their spread.

Runs ``stoa train CONFIG --set seed=N`` for each seed, one after another, as a user would (each in
its own process and run folder), and reads each run's ``metrics.jsonl`` and ``summary.json``:

* version 0 (after the warm start) and the final evaluation: held-out pass@1 and the task's
  headline metrics (for the search tasks: ``searched``), each with a 95% Wilson interval over the
  evaluation's questions x samples;
* the warm start's measured propensity to open as its practice style (``warmstart/p_open``, where
  ``warmstart.habit_band`` is set): after the planned habit steps and at version 0;
* wall time, versions, batches accepted and rejected (the trainer's trust report), the share of a
  step's groups whose rewards differed (``groups/signal_frac``, mean over steps) and steps with none.

``--warmstart-only`` stops each run at version 0 (``trainer.steps = 0``, no workers): the spread of
where RL would start, at the cost of a warm start and one evaluation a seed. The last rows of the
table are the mean and the min..max over seeds of each figure. ``--quick``: two seeds, warm start
only, 16 evaluation questions (use a small config, e.g. ``examples/papersearch_tiny.toml``, for a
smoke test under a minute). ``--json PATH`` writes every seed's figures.

    python benchmarks/seeds.py examples/smollm2_search.toml --seeds 0-9 --warmstart-only
    python benchmarks/seeds.py examples/smollm2_search.toml --seeds 0,1,2,5,6,7 --json seeds.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def wilson(p: float | None, n: float | None, z: float = 1.96) -> tuple[float, float] | None:
    """The 95% Wilson score interval of a proportion ``p`` measured on ``n`` trials."""
    if p is None or not n:
        return None
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


def parse_seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def figures(run_dir: Path) -> dict[str, Any]:
    """Version-0 and final figures of one finished run folder."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    train = [r for r in rows if r.get("kind") == "train"]
    warm = [r for r in rows if r.get("kind") == "warmstart" and "warmstart/p_open" in r]
    started = next((r for r in rows if r.get("event") == "started"), {})
    headline = list(started.get("headline") or [])
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    trust = summary.get("trust") or {}
    workers = trust.get("workers") or []
    out: dict[str, Any] = {"headline": headline, "wall_s": summary.get("wall_seconds"), "versions": len(train),
                           "p_open": warm[-1]["warmstart/p_open"] if warm else None,
                           "p_open_habit": warm[0]["warmstart/p_open"] if warm else None,
                           "band_steps": sum(r.get("phase") == "band" for r in warm),
                           "accepted": sum(w.get("accepted_batches", 0) for w in workers) if workers else None,
                           "rejected": sum(sum((w.get("rejected") or {}).values()) for w in workers) if workers else None,
                           "signal_frac": summary.get("signal_frac_mean"), "no_signal_steps": summary.get("no_signal_steps")}
    samples = json.loads((run_dir / "config.json").read_text())["eval"]["samples"]
    for tag, e in (("v0", evals[0] if evals else {}), ("final", evals[-1] if len(evals) > 1 else {})):
        n = (e.get("eval/questions") or 0) * samples
        out[f"{tag}_version"] = e.get("version")
        out[f"{tag}_n"] = n
        for m in ["pass@1", *headline]:
            out[f"{tag}_{m}"] = e.get(f"eval/{m}")
            out[f"{tag}_{m}_n"] = e.get(f"eval/{m}.n", n)  # a metric some episodes carry: its own count
    return out


def run_seed(config: str, seed: int, runs: Path, sets: list[str], warm_only: bool) -> dict[str, Any]:
    over = [f"seed={seed}", *sets] + (["trainer.steps=0", "fleet.workers=0"] if warm_only else [])
    folder = runs / f"seed{seed}"
    cmd = [sys.executable, "-m", "stoa", "train", config, "--runs", str(folder)] + [a for s in over for a in ("--set", s)]
    t0 = time.time()
    log = folder.with_suffix(".log")
    folder.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    run_dirs = [p for p in folder.iterdir() if (p / "metrics.jsonl").is_file()]
    if rc != 0 or len(run_dirs) != 1:
        return {"seed": seed, "error": f"stoa train exited {rc}; see {log}", "wall_s": time.time() - t0}
    return {"seed": seed, **figures(run_dirs[0]), "wall_s": time.time() - t0}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _cell(r: dict[str, Any], key: str, n_key: str) -> str:
    ci = wilson(r.get(key), r.get(n_key))
    return _pct(r.get(key)) + ("" if ci is None else f" ({_pct(ci[0])}-{_pct(ci[1])})")


def table(results: list[dict[str, Any]], warm_only: bool) -> str:
    ok = [r for r in results if "error" not in r]
    headline = ok[0]["headline"] if ok else []
    metrics = ["pass@1", *headline]
    cols = ["seed", "p_open habit -> v0"] + [f"v0 {m} %" for m in metrics]
    if not warm_only:
        cols += [f"final {m} %" for m in metrics] + ["accepted", "rejected", "signal", "flat steps"]
    cols += ["wall s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['seed']} | {r['error']} |")
            continue
        cells = [str(r["seed"]), "-" if r["p_open"] is None else
                 f"{r['p_open_habit']:.3f} -> {r['p_open']:.3f} ({r['band_steps']} band steps)"]
        cells += [_cell(r, f"v0_{m}", f"v0_{m}_n") for m in metrics]
        if not warm_only:
            cells += [_cell(r, f"final_{m}", f"final_{m}_n") for m in metrics]
            cells += [str(r["accepted"]), str(r["rejected"]), _pct(r["signal_frac"]), str(r["no_signal_steps"])]
        cells.append(f"{r['wall_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    keys = [f"v0_{m}" for m in metrics] + ([f"final_{m}" for m in metrics] if not warm_only else [])
    for name, fn in (("mean", lambda v: sum(v) / len(v)), ("min..max", None)):
        cells = [name, ""]
        for k in keys:
            v = [r[k] for r in ok if r.get(k) is not None]
            cells.append("-" if not v else _pct(fn(v)) if fn else f"{_pct(min(v))}..{_pct(max(v))}")
        if not warm_only:
            cells += ["", "", "", ""]
        cells.append("")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--seeds", default="0-5", help="e.g. 0-9 or 0,1,2,7")
    ap.add_argument("--warmstart-only", action="store_true", help="stop each run at version 0")
    ap.add_argument("--set", action="append", default=[], help="a config override for every seed (as stoa train)")
    ap.add_argument("--runs", default="runs/seeds", help="folder of the seeds' run folders")
    ap.add_argument("--quick", action="store_true", help="two seeds, warm start only, 16 evaluation questions")
    ap.add_argument("--json", help="write every seed's figures here")
    a = ap.parse_args()
    seeds = parse_seeds(a.seeds)
    warm_only = a.warmstart_only or a.quick
    sets = list(a.set) + (["eval.num_questions=16"] if a.quick else [])
    if a.quick:
        seeds = seeds[:2]
    runs = Path(a.runs)
    results = []
    for seed in seeds:
        results.append(run_seed(a.config, seed, runs, sets, warm_only))
        print(f"seed {seed}: " + json.dumps({k: v for k, v in results[-1].items() if k != "headline"}), flush=True)
    print()
    print(f"{a.config}, {'warm start only' if warm_only else 'whole runs'}, seeds {seeds}"
          + (f", --set {' '.join(sets)}" if sets else ""))
    print(table(results, warm_only))
    if a.json:
        Path(a.json).write_text(json.dumps({"config": a.config, "seeds": seeds, "warmstart_only": warm_only,
                                            "set": sets, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
