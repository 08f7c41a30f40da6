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
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from stoa.fleet.config import RunConfig, load_config
from stoa.fleet.operator.report import headline_metrics, write_report
from stoa.fleet.operator.status import clean
from stoa.fleet.run import read_heartbeats
from stoa.transport.store import LocalStore

__all__ = ["FleetGone", "Stopped", "no_worker_left", "train_local"]

_WORKER_EXITS = {0: "stopped", 2: "configuration error", 3: "banned", 4: "no such run", 5: "store unreachable"}
"""What a worker's exit status means (``stoa.fleet.worker``'s ``EXIT_*``)."""


class FleetGone(RuntimeError):
    """Every worker of the local fleet exited while the run was not finished."""


def no_worker_left(procs: dict[str, subprocess.Popen], finished: Callable[[], bool]) -> str | None:
    """Why the run cannot go on, when every worker process in ``procs`` (all but the trainers)
    has exited while the trainer runs and the run is not ``finished()``; else None (also when
    there are no workers)."""
    workers = {n: p for n, p in procs.items() if not n.startswith("trainer")}
    if not workers or any(p.poll() is None for p in workers.values()) or procs["trainer"].poll() is not None \
            or finished():
        return None
    how = ", ".join(f"{n} exited {p.returncode}" + (f" ({_WORKER_EXITS[p.returncode]})"
                                                   if p.returncode in _WORKER_EXITS else "")
                    for n, p in sorted(workers.items()))
    return (f"no worker is left ({how}), so no rollouts can come: stopping the trainer; see the workers' "
            "logs in the run folder, and continue with --resume")


class Stopped(KeyboardInterrupt):
    """The launcher received SIGTERM or SIGHUP (``signum``): stopped as by Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _spawn(args: list[str], log_path: Path, threads: int | None, bind_fd: int) -> subprocess.Popen:
    from stoa.backends import openmp
    from stoa.fleet import lifetime

    env = dict(os.environ, PYTHONUNBUFFERED="1", **lifetime.child_env(bind_fd))
    # The engine's math threads, read when its library loads (OpenBLAS for MLX, OpenMP for torch); the
    # trainer's learner then sets its own torch thread count from its config.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    openmp.shared_env(env)  # the trainer and workers share this machine's cores: idle threads sleep
    return subprocess.Popen([sys.executable, "-m", "stoa", *args], stdout=open(log_path, "ab"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True, pass_fds=(bind_fd,))


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

    trainers = "trainer" if cfg.outer.trainers == 1 else f"{cfg.outer.trainers} trainers"
    console.print(f"[bold]stoa train[/bold] {cfg.name}: {trainers} + {n_workers} int8 worker(s), store {store_dir}")
    # SIGTERM and SIGHUP (kill, systemd, Docker, Kubernetes, a CI cancellation, a closed terminal) stop the
    # fleet as Ctrl-C does; the children hold the read end of a pipe whose write end dies with this
    # process, however it dies (stoa.fleet.lifetime), so a SIGKILL of the launcher takes them too.
    def stop(signum: int, _frame: Any) -> None:
        if not stopping:
            stopping.append(signum)
            raise Stopped(signum)

    stopping: list[int] = []
    old_handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    bind_read, bind_write = os.pipe()
    procs: dict[str, subprocess.Popen] = {}
    t0 = time.time()
    try:
        gone = _run_fleet(cfg, config_path, overrides, run_dir, store_dir, key_file, public_hex, the_store,
                          resume, n_workers, adversaries, bind_read, procs, console, t0)
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        os.close(bind_write)
        os.close(bind_read)
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


def _run_fleet(cfg: RunConfig, config_path: str | Path, overrides: dict[str, Any] | None, run_dir: Path,
               store_dir: str, key_file: Path, public_hex: str, the_store: Any, resume: bool, n_workers: int,
               adversaries: list[str], bind_fd: int, procs: dict[str, subprocess.Popen], console: Any,
               t0: float) -> str | None:
    """Start the trainer and workers into ``procs`` and watch them; on any exit (the run's end, Ctrl-C,
    SIGTERM/SIGHUP, an error) stop the ones still running: SIGTERM, then SIGKILL after the stop bound.
    Returns why the run cannot go on when no worker is left (:class:`FleetGone`), else None."""
    from stoa.fleet.lifetime import STOP_BOUND_S
    from stoa.fleet.outer.exchange import make_secret
    from stoa.transport.signing import load_private_key

    trainer_args = ["trainer", str(config_path), "--store", str(store_dir), "--run-dir", str(run_dir),
                    "--key", str(key_file)]
    for k, v in (overrides or {}).items():
        trainer_args += ["--set", f"{k}={json.dumps(v)}"]
    if resume:
        trainer_args.append("--resume")
    secret = make_secret(run_dir / "keys" / "outer.secret") if cfg.outer.trainers > 1 else None
    if secret is not None:
        trainer_args += ["--outer-secret", str(secret)]
    try:
        procs["trainer"] = _spawn(trainer_args, run_dir / "trainer.log", 1, bind_fd)
        for rank in range(1, cfg.outer.trainers):  # the run's other trainers (docs/outer.md)
            args = ["trainer", str(config_path), "--store", str(store_dir), "--run-dir", str(run_dir / f"trainer-{rank}"),
                    "--outer-rank", str(rank), "--outer-secret", str(secret), "--public-key", public_hex]
            for k, v in (overrides or {}).items():
                args += ["--set", f"{k}={json.dumps(v)}"]
            procs[f"trainer-{rank}"] = _spawn(args, run_dir / f"trainer-{rank}.log", 1, bind_fd)
        fleet = [(f"worker-{i}", None) for i in range(n_workers)]
        fleet += [(f"adversary-{j}-{kind}", kind) for j, kind in enumerate(adversaries)]
        for wid, kind in fleet:
            args = ["worker", "--store", str(store_dir), "--run", cfg.name, "--public-key", public_hex, "--id", wid,
                    "--cache", str(run_dir / "cache" / wid)]
            if cfg.trust.mode == "enrolled":
                args += ["--key", str(_enrolled_key(the_store, cfg.name, key_file, run_dir / "keys", wid,
                                                    enroll=kind != "unenrolled"))]
            procs[wid] = _spawn(args + (["--adversary", kind] if kind else []), run_dir / f"{wid}.log",
                                cfg.fleet.worker_threads, bind_fd)
        from stoa.transport.exchange import is_finished

        run_public = load_private_key(key_file).public_key()
        _watch(cfg, run_dir, the_store, procs, console, t0, lambda: is_finished(the_store, cfg.name, run_public),
               run_public)
    except KeyboardInterrupt as e:
        why = f"{e.args[0]}: " if isinstance(e, Stopped) and e.args else "interrupted: "
        console.print(f"[yellow]{why}stopping the fleet (resume with --resume)[/yellow]")
        raise
    except FleetGone as e:
        return str(e)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + STOP_BOUND_S + 5  # each child exits within the bound by itself
        for p in procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return None


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
            headline = headline_metrics(state["rows"])
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
                f" signal {r.get('groups/signal_frac', 0):.2f} gate {r.get('gate/masked_frac', 0):.4f}"
                f" lag {r['staleness/mean']:.2f} delta {r['pulse/bytes'] / 1e3:.1f}kB")
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
    headline = headline_metrics(rows)
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
    if last:
        flat = int(last.get("groups/flat_steps") or 0)
        table.add_row("learning signal", Text(f"{last.get('groups/signal_frac', 0):.0%} of groups' rewards differ"
                                              + (f"; none for {flat} steps in a row" if flat else ""),
                                              style="red" if flat >= max(1, cfg.trainer.warn_flat_steps) else ""))
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
    table.add_row("workers alive", Text(f"{len(alive)} of {sum(not n.startswith('trainer') for n in procs)}: " + ", ".join(
        f"{clean(b.worker_id, 40)} v{b.version} {clean(b.status, 20)} {b.episodes_per_s:.0f} ep/s"
        for b in sorted(beats, key=lambda b: b.worker_id))))
    from stoa.fleet.operator.status import trust_lines

    for name, line in trust_lines(store, cfg.name, public_key) if public_key is not None else []:  # worker-written text: shown as Text, never as markup
        table.add_row(Text(name), Text(line, style="red" if "banned:" in line else ""))
    return table
