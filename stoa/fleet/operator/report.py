"""``stoa report RUN_DIR``: the plots, ``summary.json`` and ``summary.md`` of a run folder.

Read from the folder's ``metrics.jsonl`` and ``config.json`` (a ``stoa train`` run's or a lone
``stoa trainer``'s), plus the trainer's trust report; ``stoa train`` writes it when the run ends.
Every string a worker wrote is escaped before it reaches Markdown (:func:`_md`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from stoa.fleet.config import RunConfig
from stoa.fleet.metrics import read_metrics, write_plots
from stoa.fleet.operator.status import clean, strict

__all__ = ["headline_metrics", "summarize", "write_report"]

log = logging.getLogger("stoa.report")


def write_report(run_dir: str | Path, store: Any = None, wall_s: float | None = None,
                 workers: int | None = None, public_key: Any = None) -> dict[str, Any]:
    """Plots, ``summary.json`` and ``summary.md`` of any run folder (``stoa train``'s or a lone
    ``stoa trainer``'s), from its ``metrics.jsonl`` and ``config.json``. Returns the summary.

    The trust section comes from the trainer's own copy of its report in the run folder
    (``roster/trust.json``) when there is one; else from ``store``'s ``trust.json``, verified
    under ``public_key`` (default: ``keys/run.pub`` in the run folder, if there), and without a
    key read as it is and marked unverified in the summary.

    ``wall_s`` defaults to the time between the first and last metrics row, ``workers`` to the
    most workers the trainer saw alive at once.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (it needs metrics.jsonl and config.json, "
                                "which the trainer writes)")
    cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()), resolve_objective=False)
    rows = read_metrics(run_dir / "metrics.jsonl")
    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    if wall_s is None:
        wall_s = max(times) - min(times) if times else 0.0
    if workers is None:
        workers = max((int(r.get("fleet/workers_alive") or 0) for r in rows), default=0)
    plots = write_plots(rows, run_dir / "plots")
    summary = summarize(rows, wall_s=wall_s, workers=workers)
    summary["plots"] = [str(p) for p in plots]
    summary["trust"] = _trust_summary(run_dir, store, cfg.name, public_key)
    (run_dir / "summary.json").write_text(json.dumps(strict(summary), indent=2, allow_nan=False) + "\n")
    (run_dir / "summary.md").write_text(_summary_md(cfg, summary))
    return summary


def _trust_summary(run_dir: Path, store: Any, run: str, public_key: Any) -> dict[str, Any] | None:
    """Per worker: accepted and rejected batches, trained episodes, ban reason (the trainer's
    report; see :func:`write_report` for which copy, and ``verified``/``source`` for how it was read)."""
    from stoa.fleet.trust.records import TrustReport, read_trust_report
    from stoa.transport.signing import SignatureError, load_public_key

    own = run_dir / "roster" / "trust.json"  # the trainer's copy (its roster_copy folder): no one else writes it
    tr, source, verified = None, "", False
    if own.is_file():
        try:
            tr, source, verified = TrustReport.parse(json.loads(own.read_text())), "the trainer's run folder", True
        except (ValueError, OSError) as e:
            log.warning("ignoring %s: %s", own, e)
    if tr is None and store is not None:
        if public_key is None and (run_dir / "keys" / "run.pub").is_file():
            public_key = run_dir / "keys" / "run.pub"
        try:
            tr = read_trust_report(store, run, None if public_key is None else load_public_key(public_key))
        except SignatureError as e:
            return {"error": f"the store's trust report does not verify under the run's key: {e}"}
        source, verified = "the store", public_key is not None
    if tr is None:
        return None
    workers = [{"worker_id": w.worker_id, "key": kid, "accepted_batches": w.accepted_batches,
                "trained_episodes": w.trained_episodes, "rejected": w.rejected, "banned": w.banned}
               for kid, w in sorted(tr.workers.items(), key=lambda kv: kv[1].worker_id)]
    return {"mode": tr.mode, "version": tr.version, "workers": workers, "anonymous": tr.anonymous,
            "banned_keys": max(tr.banned_keys, sum(bool(w["banned"]) for w in workers)), "source": source,
            "verified": verified}


def _md(text: Any) -> str:
    """A worker-written string safe in a Markdown table cell: no control characters, no HTML, no markup."""
    import html
    import re

    return html.escape(re.sub(r"([\\`*_\[\]|#!~])", r"\\\1", clean(text)), quote=False)


def summarize(rows: list[dict[str, Any]], wall_s: float, workers: int) -> dict[str, Any]:
    """Start/end evaluation, staleness, gate and PULSE figures of a finished run."""
    import numpy as np

    evals = [r for r in rows if r.get("kind") == "eval"]
    train = [r for r in rows if r.get("kind") == "train"]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    headline = headline_metrics(rows)
    lag: dict[str, int] = {}
    for r in train:
        for k, v in r.items():
            if k.startswith("staleness/lag"):
                lag[k[len("staleness/lag"):]] = lag.get(k[len("staleness/lag"):], 0) + int(v)
    deltas = [r["pulse/bytes"] for r in train if not r.get("pulse/anchor")]
    full = [r["pulse/full_bytes"] for r in train]
    def mean(key: str) -> float | None:
        vals = [r[key] for r in train if r.get(key) is not None]
        return float(np.mean(vals)) if vals else None

    flat = longest = 0
    for r in train:  # the longest stretch of steps in which no group's rewards differed
        flat = flat + 1 if r.get("groups/signal_frac") == 0 else 0
        longest = max(longest, flat)
    return {
        "wall_seconds": round(wall_s, 1),
        "workers": workers,
        "versions": train[-1]["version"] if train else 0,
        "eval_questions": first.get("eval/questions"),
        "pass@1_start": first.get("eval/pass@1"), "pass@1_end": last.get("eval/pass@1"),
        "headline": {m: [first.get(f"eval/{m}"), last.get(f"eval/{m}")] for m in headline},
        "staleness_histogram": dict(sorted(lag.items(), key=lambda kv: int(kv[0]))),
        "episodes_stale_ge_1": sum(v for k, v in lag.items() if int(k) >= 1),
        "gate_masked_frac_mean": mean("gate/masked_frac"),
        "signal_frac_mean": mean("groups/signal_frac"),
        "train_steps": len(train),
        "no_signal_steps": sum(r.get("groups/signal_frac") == 0 for r in train),
        "longest_no_signal_steps": longest,
        "delta_bytes_mean": float(np.mean(deltas)) if deltas else None,
        "full_bytes": float(np.mean(full)) if full else None,
        "dropped_stale_groups": train[-1].get("dropped/stale_groups") if train else 0,
        "trainer_peak_rss_gib": max((r["memory/peak_rss_gib"] for r in train if "memory/peak_rss_gib" in r),
                                    default=None),
    }


def headline_metrics(rows: list[dict[str, Any]]) -> list[str]:
    """The task's headline metrics, as the trainer announced them when it started."""
    for r in rows:
        if r.get("kind") == "event" and r.get("event") == "started":
            return list(r.get("headline") or [])
    return []


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.1f}%"
    if isinstance(x, float) and x.is_integer():  # counts come back from metrics.jsonl as floats
        x = int(x)
    return f"{x:,.0f}" if isinstance(x, (int, float)) and abs(x) >= 100 else f"{x}"


def _summary_md(cfg: RunConfig, s: dict[str, Any]) -> str:
    def row(name: str, a: Any, b: Any) -> str:
        d = None if a is None or b is None else 100 * (b - a)
        return f"| {name} | {_fmt(a, True)} | {_fmt(b, True)} | {'-' if d is None else f'{d:+.1f} points'} |"

    gate = "-" if s["gate_masked_frac_mean"] is None else f"{100 * s['gate_masked_frac_mean']:.3f}%"
    signal = "-" if s.get("signal_frac_mean") is None else f"{100 * s['signal_frac_mean']:.1f}%"
    lines = [
        f"# {cfg.name}: summary",
        "",
        f"Held-out evaluation on {_fmt(s['eval_questions'])} questions, sampled at temperature "
        f"{cfg.rollout.temperature}, with the int8 policy the workers run:",
        "",
        "| metric | start | end | change |",
        "|---|---|---|---|",
        row("pass@1", s["pass@1_start"], s["pass@1_end"]),
        *(row(m, a, b) for m, (a, b) in s["headline"].items()),
        "",
        f"- wall time {s['wall_seconds']:.0f} s, {s['versions']} versions, {s['workers']} int8 workers"
        + (f"; trainer peak memory {s['trainer_peak_rss_gib']:.1f} GiB" if s.get("trainer_peak_rss_gib") else ""),
        f"- staleness of trained episodes (versions behind: count): {s['staleness_histogram']}; "
        f"{s['episodes_stale_ge_1']} episodes at staleness >= 1; {s['dropped_stale_groups']} stale groups dropped",
        f"- learning signal: {signal} of a step's groups had rewards that differ (mean over steps); "
        f"{s.get('no_signal_steps', 0)} steps had none",
        f"- DPPO gate masked fraction (mean over steps): {gate} of model tokens",
        f"- PULSE: mean delta {_fmt(s['delta_bytes_mean'])} bytes vs full int8 state {_fmt(s['full_bytes'])} bytes"
        + (f" ({100 * s['delta_bytes_mean'] / s['full_bytes']:.1f}%)" if s["delta_bytes_mean"] and s["full_bytes"] else ""),
    ]
    if s.get("no_signal_steps") and s["no_signal_steps"] == s.get("train_steps"):
        lines[2:2] = ["**No learning signal**: in every step every group's episodes got the same reward, so every "
                      "advantage was 0 and the weights did not move. RL cannot reinforce what the policy never "
                      "samples: look at the version-0 evaluation and the warm start.", ""]
    elif cfg.trainer.warn_flat_steps and s.get("longest_no_signal_steps", 0) >= cfg.trainer.warn_flat_steps:
        lines[2:2] = [f"**Warning**: {s['longest_no_signal_steps']} steps in a row had no group whose rewards "
                      "differ (nothing was learned in them).", ""]
    if s.get("plots"):
        lines.append(f"- plots: {', '.join(s['plots'])}")
    tr = s.get("trust")
    if tr and tr.get("error"):
        lines += ["", "## Trust", "", _md(tr["error"])]
    elif tr:
        lines += ["", f"## Trust (mode {_md(tr['mode'])}, as of version {tr['version']})", ""]
        if not tr.get("verified"):
            lines += ["**Unverified**: read from the store without the run's public key (`stoa report --public-key`); "
                      "anyone with write access to the store could have written it.", ""]
        lines += [f"{len(tr['workers'])} worker keys, {tr['banned_keys']} banned.", "",
                  "| worker | accepted batches | trained episodes | rejected | banned |", "|---|---|---|---|---|"]
        for w in tr["workers"]:
            rej = ", ".join(f"{_md(c)} {n}" for c, n in sorted(w["rejected"].items())) or "-"
            lines.append(f"| {_md(w['worker_id'])} | {w['accepted_batches']} | {w['trained_episodes']} | {rej} | "
                         f"{_md(w['banned']) or '-'} |")
        for wid, cats in sorted(tr["anonymous"].items()):
            lines.append(f"\n- refused unsigned or unverifiable batches from {_md(wid)}: {_md(cats)}")
    return "\n".join(lines) + "\n"
