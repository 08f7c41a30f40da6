"""``stoa train CONFIG``: a whole fleet on one machine, with a live view.

Everything lives under ``runs/<name>/``: the object store (a LocalStore in ``store/``), the run's
signing key (``keys/``), the trainer's checkpoints, ``metrics.jsonl``, TensorBoard events, logs of
every process, and at the end the plots and ``summary.md``. The trainer and each worker are
separate processes that talk only through the store, exactly as on a real fleet. When every
worker has exited before the run finished (banned, refused at start, failed), the launcher stops
the trainer and says why (:class:`FleetGone`) instead of waiting for rollouts that cannot come.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from stoa.fleet.metrics import read_metrics, write_plots
from stoa.fleet.run import read_heartbeats
from stoa.fleet.sections import check
from stoa.fleet.status import clean, strict
from stoa.transport.store import LocalStore

if TYPE_CHECKING:
    from stoa.fleet.config import RunConfig

__all__ = ["FleetConfig", "FleetGone", "summarize", "train_local", "write_report"]


@dataclass(frozen=True)
class FleetConfig:
    """The local launcher (``[fleet]``)."""

    workers: int = 2
    """Worker processes started by ``stoa train``."""
    worker_threads: int = 1
    """CPU threads per worker (MLX/OpenBLAS)."""

    def __post_init__(self) -> None:
        check(self.workers >= 0 and self.worker_threads >= 1, "fleet.workers >= 0 and worker_threads >= 1")


log = logging.getLogger("stoa.report")

_WORKER_EXITS = {0: "stopped", 2: "configuration error", 3: "banned", 4: "no such run", 5: "store unreachable"}
"""What a worker's exit status means (``stoa.fleet.worker``'s ``EXIT_*``)."""


class FleetGone(RuntimeError):
    """Every worker of the local fleet exited while the run was not finished."""


def no_worker_left(procs: dict[str, subprocess.Popen], finished: Callable[[], bool]) -> str | None:
    """Why the run cannot go on, when every worker process in ``procs`` (all but ``"trainer"``)
    has exited while the trainer runs and the run is not ``finished()``; else None (also when
    there are no workers)."""
    workers = {n: p for n, p in procs.items() if n != "trainer"}
    if not workers or any(p.poll() is None for p in workers.values()) or procs["trainer"].poll() is not None \
            or finished():
        return None
    how = ", ".join(f"{n} exited {p.returncode}" + (f" ({_WORKER_EXITS[p.returncode]})"
                                                   if p.returncode in _WORKER_EXITS else "")
                    for n, p in sorted(workers.items()))
    return (f"no worker is left ({how}), so no rollouts can come: stopping the trainer; see the workers' "
            "logs in the run folder, and continue with --resume")


def _spawn(args: list[str], log_path: Path, threads: int | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # MLX's OpenBLAS threads (read at load); torch's threads are set by the learner config.
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    return subprocess.Popen([sys.executable, "-m", "stoa", *args], stdout=open(log_path, "ab"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _enrolled_key(store: Any, run: str, run_key: Path, keys: Path, wid: str, enroll: bool) -> Path:
    """``keys/<wid>.key``, made if absent and (unless ``enroll`` is False) enrolled in the run's roster."""
    from stoa.transport.identity import enroll_worker, load_or_create_worker_key, read_roster
    from stoa.transport.signing import key_id, load_private_key

    path = keys / f"{wid}.key"
    worker_key = load_or_create_worker_key(path)
    run_private = load_private_key(run_key)
    if enroll and key_id(worker_key.public_key()) not in read_roster(store, run, run_private.public_key()).enrolled:
        enroll_worker(store, run, run_private, worker_key, wid, note="stoa train (local fleet)")
    return path


def train_local(config_path: str | Path, overrides: dict[str, Any] | None = None, runs_root: str | Path = "runs",
                resume: bool = False, workers: int | None = None, console: Any = None,
                store: str | None = None, adversaries: list[str] = ()) -> dict[str, Any]:
    """Run the trainer and ``fleet.workers`` workers locally until the run finishes; returns the summary.

    ``store`` (a path, ``file://`` or ``s3://bucket/prefix?endpoint=...`` URL) replaces the run
    folder's ``store/``; the run's objects go under ``<store>/<name>/``. ``adversaries`` adds one
    dishonest worker per kind listed (``stoa.testing.adversaries``), named ``adversary-<j>-<kind>``.
    With ``[trust] mode = "enrolled"`` every worker's key is made under ``keys/`` and enrolled
    (an ``unenrolled`` adversary's is not).
    """
    from rich.console import Console

    from stoa.fleet.config import load_config
    from stoa.transport.signing import generate_private_key, load_private_key, save_keypair

    console = console or Console()
    cfg = load_config(config_path, overrides)
    n_workers = cfg.fleet.workers if workers is None else workers
    run_dir = Path(runs_root) / cfg.name
    if run_dir.exists() and not resume:
        old = run_dir.with_name(f"{cfg.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(old)
        console.print(f"[dim]moved the previous {run_dir} to {old}[/dim]")
    (run_dir / "keys").mkdir(parents=True, exist_ok=True)
    key_file = run_dir / "keys" / "run.key"
    if not key_file.exists():
        save_keypair(generate_private_key(), run_dir / "keys", "run")
    public_hex = load_private_key(key_file).public_key().public_bytes_raw().hex()
    from stoa.transport.store import open_store

    store_dir = store or str(run_dir / "store")
    the_store = open_store(store_dir)
    if store is not None and not resume and the_store.list(f"{cfg.name}/"):
        raise SystemExit(f"{the_store} already holds run {cfg.name!r}: pass --resume, or use another prefix")

    console.print(f"[bold]stoa train[/bold] {cfg.name}: trainer + {n_workers} int8 worker(s), store {store_dir}")
    trainer_args = ["trainer", str(config_path), "--store", str(store_dir), "--run-dir", str(run_dir),
                    "--key", str(key_file)]
    for k, v in (overrides or {}).items():
        trainer_args += ["--set", f"{k}={json.dumps(v)}"]
    if resume:
        trainer_args.append("--resume")
    procs = {"trainer": _spawn(trainer_args, run_dir / "trainer.log", 1)}
    fleet = [(f"worker-{i}", None) for i in range(n_workers)]
    fleet += [(f"adversary-{j}-{kind}", kind) for j, kind in enumerate(adversaries)]
    for wid, kind in fleet:
        args = ["worker", "--store", str(store_dir), "--run", cfg.name, "--public-key", public_hex, "--id", wid,
                "--cache", str(run_dir / "cache" / wid)]
        if cfg.trust.mode == "enrolled":
            args += ["--key", str(_enrolled_key(the_store, cfg.name, key_file, run_dir / "keys", wid,
                                                enroll=kind != "unenrolled"))]
        procs[wid] = _spawn(args + (["--adversary", kind] if kind else []), run_dir / f"{wid}.log",
                            cfg.fleet.worker_threads)
    t0 = time.time()
    from stoa.transport.exchange import is_finished

    run_public = load_private_key(key_file).public_key()
    gone = None
    try:
        _watch(cfg, run_dir, the_store, procs, console, t0, lambda: is_finished(the_store, cfg.name, run_public),
               run_public)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the fleet (resume with --resume)[/yellow]")
        raise
    except FleetGone as e:
        gone = str(e)
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        for p in procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
    if gone:
        raise SystemExit(gone)
    code = procs["trainer"].returncode
    if code != 0:
        tail = (run_dir / "trainer.log").read_text(errors="replace").splitlines()[-25:]
        console.print("[red]the trainer failed:[/red]\n" + "\n".join(tail))
        raise SystemExit(code or 1)
    summary = write_report(run_dir, the_store, wall_s=time.time() - t0, workers=n_workers)
    console.out((run_dir / "summary.md").read_text(), highlight=False)
    return summary


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
    from stoa.fleet.config import RunConfig

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
    from stoa.fleet.trust import TrustReport, read_trust_report
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
    headline = _headline(rows)
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
        "delta_bytes_mean": float(np.mean(deltas)) if deltas else None,
        "full_bytes": float(np.mean(full)) if full else None,
        "dropped_stale_groups": train[-1].get("dropped/stale_groups") if train else 0,
    }


def _headline(rows: list[dict[str, Any]]) -> list[str]:
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
        f"- wall time {s['wall_seconds']:.0f} s, {s['versions']} versions, {s['workers']} int8 workers",
        f"- staleness of trained episodes (versions behind: count): {s['staleness_histogram']}; "
        f"{s['episodes_stale_ge_1']} episodes at staleness >= 1; {s['dropped_stale_groups']} stale groups dropped",
        f"- DPPO gate masked fraction (mean over steps): {gate} of model tokens",
        f"- PULSE: mean delta {_fmt(s['delta_bytes_mean'])} bytes vs full int8 state {_fmt(s['full_bytes'])} bytes"
        + (f" ({100 * s['delta_bytes_mean'] / s['full_bytes']:.1f}%)" if s["delta_bytes_mean"] and s["full_bytes"] else ""),
    ]
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


def _watch(cfg: RunConfig, run_dir: Path, store: LocalStore, procs: dict[str, subprocess.Popen], console: Any,
           t0: float, finished: Callable[[], bool] = lambda: False, public_key: Any = None) -> None:
    """Render the live view until the trainer exits (a worker that dies is reported; raises
    :class:`FleetGone` once none is left and the run is not ``finished()``)."""
    from rich.live import Live

    state: dict[str, Any] = {"rows": [], "offset": 0}
    metrics_path = run_dir / "metrics.jsonl"

    def refresh() -> None:
        gone = no_worker_left(procs, finished)
        if gone:
            raise FleetGone(gone)
        if metrics_path.exists():
            with open(metrics_path) as f:
                f.seek(state["offset"])
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            state["offset"] += len(complete.encode())
            for line in complete.splitlines():
                try:
                    state["rows"].append(json.loads(line))
                except json.JSONDecodeError:
                    pass

    if console.is_terminal:
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while procs["trainer"].poll() is None:
                refresh()
                live.update(_view(cfg, state["rows"], store, procs, t0, public_key))
                time.sleep(0.5)
            refresh()
            live.update(_view(cfg, state["rows"], store, procs, t0, public_key))
    else:
        printed = 0
        while procs["trainer"].poll() is None or printed < len(state["rows"]):
            refresh()
            headline = _headline(state["rows"])
            for r in state["rows"][printed:]:
                line = _plain_line(r, headline)
                if line:
                    console.out(line, highlight=False)  # one record a line: out() never wraps
            printed = len(state["rows"])
            if procs["trainer"].poll() is not None:
                refresh()
                if printed >= len(state["rows"]):
                    break
            time.sleep(0.5)


def _plain_line(r: dict[str, Any], headline: list[str]) -> str | None:
    """One metrics row as one line (under 80 characters for the usual rows; longer ones are not
    wrapped), or None for rows not shown. Strings of event rows are escaped (:func:`clean`)."""
    t = time.strftime("%H:%M:%S", time.localtime(r.get("time", 0)))
    if r.get("kind") == "eval":
        extra = "".join(f" {m} {r[f'eval/{m}']:.3f}" for m in headline if f"eval/{m}" in r)
        return (f"{t} eval v{r['version']} pass@1 {r['eval/pass@1']:.3f}{extra}"
                f" ({r.get('eval/questions', 0):.0f} items, {r.get('eval/seconds', 0):.1f}s)")
    if r.get("kind") == "warmstart":
        check = r.get("warmstart/p_final_turn")
        return (f"{t} warm step {r['step']}/{r.get('of', '?')} ({r.get('phase', '')}) loss {r['loss']:.3f}"
                + ("" if check is None else f" p(final turn | held out) {check:.2f}") + f" ({r.get('seconds', 0):.0f}s)")
    if r.get("kind") == "train" and (r["version"] % 5 == 0 or r["version"] == 1):
        extra = "".join(f" {m} {r[f'rollout/{m}']:.2f}" for m in headline if f"rollout/{m}" in r)
        return (f"{t} train v{r['version']} reward {r['reward/mean']:.3f}{extra}"
                f" gate {r.get('gate/masked_frac', 0):.4f} lag {r['staleness/mean']:.2f}"
                f" delta {r['pulse/bytes'] / 1e3:.1f}kB workers {r.get('fleet/workers_alive', 0)}")
    if r.get("kind") == "event" and r.get("event") != "started":
        rest = " ".join(f"{clean(k)}={clean(f'{v:.4g}' if isinstance(v, float) else v, 300)}"
                        for k, v in sorted(r.items()) if k not in ("kind", "event", "time", "version"))
        return f"{t} event {clean(r.get('event'))} v{r.get('version')}" + (f" {rest}" if rest else "")
    return None


def _view(cfg: RunConfig, rows: list[dict[str, Any]], store: LocalStore, procs: dict[str, subprocess.Popen],
          t0: float, public_key: Any = None):
    from rich.table import Table
    from rich.text import Text

    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    warm = [r for r in rows if r.get("kind") == "warmstart"]
    last = train[-1] if train else {}
    table = Table(title=f"stoa train: {cfg.name}  ({time.time() - t0:.0f}s)", show_header=False, expand=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    headline = _headline(rows)
    if not train:
        phase = "warm start" if warm and not evals else "waiting for rollouts"
        table.add_row("phase", phase + (f" (step {warm[-1]['step']}/{warm[-1].get('of', '?')})" if warm and not evals else ""))
    table.add_row("version", f"{last.get('version', evals[-1]['version'] if evals else 0)} / {cfg.trainer.steps}")
    table.add_row("episodes/s", f"{last.get('throughput/episodes_per_s', 0):.1f}")
    table.add_row("reward (rollouts)", f"{last.get('reward/mean', 0):.3f}")
    for m in headline:
        table.add_row(f"{m} (rollouts)", f"{last.get(f'rollout/{m}', 0):.2f}")
    if evals:
        e0, e1 = evals[0], evals[-1]
        table.add_row("eval pass@1", f"{e0['eval/pass@1']:.3f} -> {e1['eval/pass@1']:.3f} (v{e1['version']})")
        for m in headline:
            if f"eval/{m}" in e0 and f"eval/{m}" in e1:
                table.add_row(f"eval {m}", f"{e0[f'eval/{m}']:.3f} -> {e1[f'eval/{m}']:.3f}")
    table.add_row("gate masked fraction", f"{last.get('gate/masked_frac', 0):.4f}")
    hist: dict[int, int] = {}
    for r in train:
        for k, v in r.items():
            if k.startswith("staleness/lag"):
                hist[int(k[13:])] = hist.get(int(k[13:]), 0) + int(v)
    table.add_row("staleness (lag: episodes)", "  ".join(f"{k}: {v}" for k, v in sorted(hist.items())) or "-")
    if last:
        table.add_row("delta bytes", f"{last['pulse/bytes']:,} of {last['pulse/full_bytes']:,} full")
    beats, _ = read_heartbeats(store, cfg.name)
    now = time.time()
    alive = [b for b in beats if now - b.time < 30 and b.status != "stopped"]
    table.add_row("workers alive", Text(f"{len(alive)} of {len(procs) - 1}: " + ", ".join(
        f"{clean(b.worker_id, 40)} v{b.version} {clean(b.status, 20)} {b.episodes_per_s:.0f} ep/s"
        for b in sorted(beats, key=lambda b: b.worker_id))))
    from stoa.fleet.status import trust_lines

    for name, line in trust_lines(store, cfg.name, public_key) if public_key is not None else []:  # worker-written text: shown as Text, never as markup
        table.add_row(Text(name), Text(line, style="red" if "banned:" in line else ""))
    return table
