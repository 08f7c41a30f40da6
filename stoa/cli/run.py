"""The fleet's processes: ``train`` (a local fleet), ``sweep``, ``trainer``, ``worker`` and ``stage``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from stoa.cli.common import read_private_key

__all__ = ["stage_cmd", "sweep", "train", "trainer", "worker"]


def _parse_sets(sets: list[str] | None) -> dict:
    """``--set trainer.steps=50`` pairs; values are JSON (numbers, booleans, strings in quotes) or bare strings."""
    import json

    out = {}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--set expects key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _setup_logging(verbose: bool) -> None:
    import logging

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def train(
    config: Annotated[Path, typer.Argument(help="Run config (TOML), e.g. examples/papersearch_tiny.toml.")],
    workers: Annotated[Optional[int], typer.Option(help="Worker processes (default: fleet.workers).")] = None,
    runs: Annotated[Path, typer.Option(help="Folder that holds runs/<name>/.")] = Path("runs"),
    resume: Annotated[bool, typer.Option("--resume", help="Continue runs/<name> from its newest checkpoint.")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a config key: --set trainer.steps=50.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Validate the config, print it resolved (JSON), and exit.")] = False,
    store: Annotated[Optional[str], typer.Option(help="Object store instead of runs/<name>/store: a path or s3://bucket/prefix?endpoint=URL.")] = None,
    adversary: Annotated[Optional[list[str]], typer.Option(help="Add a dishonest worker of this kind to the fleet (see stoa.testing.adversaries), e.g. flip-rewards.")] = None,
) -> None:
    """Run a whole fleet locally: the trainer plus N int8 workers meeting in runs/<name>/store (or --store).

    Ctrl-C, SIGTERM and SIGHUP stop the fleet with a checkpoint (`--resume` continues it) within
    about 25 s; its processes exit with it even when it is SIGKILLed."""
    from stoa.fleet.config import ConfigError, check_runnable, load_config
    from stoa.fleet.operator.launcher import Stopped, train_local

    try:
        cfg = load_config(config, _parse_sets(set_))
        fmt = check_runnable(cfg)  # before any process starts: an unknown env id or model folder is one line
        if check:
            typer.echo(cfg.to_json())
            typer.echo(fmt, err=True)
            return
        train_local(config, _parse_sets(set_), runs_root=runs, resume=resume, workers=workers, store=store,
                    adversaries=adversary or [])
    except Stopped as e:  # SIGTERM / SIGHUP: the fleet stopped as by Ctrl-C, resumable
        raise typer.Exit(128 + e.signum) from None
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def sweep(
    sweep_file: Annotated[Path, typer.Argument(help="Sweep file (TOML): a run config and objectives x lags x seeds.")],
    runs: Annotated[Path, typer.Option(help="Folder that holds runs/<sweep name>/.")] = Path("runs"),
    parallel: Annotated[Optional[int], typer.Option(help="Cells running at a time (default: the file's).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Resolve every cell's config, list the cells, exit.")] = False,
    report: Annotated[bool, typer.Option("--report", help="Only rewrite the report from finished cells.")] = False,
) -> None:
    """Run a grid of fleet runs (each a `stoa train`), resumably; write results.json, results.md, plots."""
    from stoa.fleet.operator.sweep import SweepError, collect, load_sweep, run_sweep, validate, write_report

    try:
        spec = load_sweep(sweep_file, **({} if parallel is None else {"parallel": parallel}))
        cells = validate(spec)
        if dry_run:
            for c in cells:
                typer.echo(f"{c.id}: " + " ".join(f"{k}={v}" for k, v in c.overrides.items() if k != "name"))
            return
        if report:
            write_report(collect(spec, runs), runs / spec.name)
            typer.echo(f"wrote {runs / spec.name / 'results.md'}")
            return
        out = run_sweep(spec, runs, say=typer.echo)
    except SweepError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    done = sum(c["status"] == "done" for c in out["cells"])
    typer.echo(f"{done}/{len(out['cells'])} cells finished; report in {runs / spec.name / 'results.md'}")
    if done < len(out["cells"]):
        raise typer.Exit(1)


def trainer(
    config: Annotated[Path, typer.Argument(help="Run config (TOML).")],
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    key: Annotated[Optional[Path], typer.Option(help="The run's ed25519 private key (from `stoa keygen`); rank 0 only.")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Local folder for checkpoints and metrics (default runs/<name>).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in --run-dir.")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a config key: --set trainer.steps=50.")] = None,
    outer_rank: Annotated[int, typer.Option(help="With [outer] trainers = N: this trainer's rank, 1..N-1 (0: the coordinator, with --key).")] = 0,
    outer_secret: Annotated[Optional[Path], typer.Option(help="With [outer] trainers > 1: the secret file the run's trainers share (stoa train makes keys/outer.secret).")] = None,
    public_key: Annotated[Optional[str], typer.Option(help="With --outer-rank >= 1: the run's public key (hex, or a .pub file).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Train: consume episodes from the store, take optimizer steps, publish int8 weights through PULSE.

    SIGINT / SIGTERM / SIGHUP stop it after the current step with a checkpoint, without marking the
    run finished (`--resume` continues it); a step still running 20 s after the signal is abandoned
    (exit 143; redone after `--resume`); a second Ctrl-C stops at once.

    Several GPUs: `torchrun --nproc-per-node N -m stoa trainer ...` with learner.kind = "megatron".
    Several trainers of one run ([outer] trainers = N, docs/outer.md): rank 0 with --key and
    --outer-secret, ranks 1..N-1 with --outer-rank i, --outer-secret and --public-key."""
    from stoa.fleet.config import ConfigError, check_runnable, load_config
    from stoa.fleet.trainer.trainer import Trainer
    from stoa.transport.store import open_store

    _setup_logging(verbose)
    try:
        cfg = load_config(config, _parse_sets(set_))
        check_runnable(cfg)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    run_dir = run_dir or Path("runs") / cfg.name
    secret = None
    if outer_secret is not None or outer_rank:
        from stoa.fleet.outer.exchange import read_secret

        try:
            secret = read_secret(outer_secret) if outer_secret is not None else None
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    if outer_rank:
        _inner_trainer(cfg, store, run_dir, outer_rank, public_key, secret)
        return
    if key is None:
        typer.echo("error: give --key (the run's private key), or --outer-rank i for a non-coordinating trainer", err=True)
        raise typer.Exit(2)
    private_key = read_private_key(key)
    from stoa.fleet.trainer import distributed

    if distributed.world_size() > 1:  # under torchrun: rank 0 runs the loop, the other ranks follow it
        try:
            distributed.run_ranks(cfg, lambda ranks: Trainer(cfg, open_store(store), run_dir, private_key,
                                                             resume=resume, ranks=ranks).run())
        except distributed.RankFailed as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        return
    trainer = Trainer(cfg, open_store(store), run_dir, private_key, resume=resume, outer_secret=secret)
    import signal

    from stoa.fleet import lifetime

    lifetime.install()  # a stop request is bounded; started by `stoa train`, it dies with it
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # stop after the current step, with a checkpoint
        signal.signal(sig, trainer.request_stop)
    trainer.run()


def _inner_trainer(cfg, store: str, run_dir: Path, rank: int, public_key: str | None, secret: bytes | None) -> None:
    """``stoa trainer --outer-rank i``: a trainer of the run that is not its coordinator (stoa.fleet.outer.inner)."""
    import signal

    from stoa.fleet import lifetime
    from stoa.fleet.outer.inner import InnerTrainer
    from stoa.transport.store import open_store

    if public_key is None or secret is None:
        typer.echo("error: --outer-rank needs --public-key (the run's) and --outer-secret", err=True)
        raise typer.Exit(2)
    trainer = InnerTrainer(cfg, open_store(store), run_dir, rank, public_key, secret)
    lifetime.install()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, trainer.request_stop)
    trainer.run()


def _worker_fail(code: int, message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _worker_threads(threads: int | None) -> None:
    """Cap the BLAS / OpenMP threads the engine's math library starts (read when it loads)."""
    if threads is not None:
        if threads < 1:
            raise typer.BadParameter("--threads must be >= 1")
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
            os.environ[var] = str(threads)


def worker(
    invite: Annotated[Optional[Path], typer.Option(help="An invite file from the run's operator (stoa invite): store, run and public key in one.")] = None,
    store: Annotated[Optional[str], typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")] = None,
    run: Annotated[Optional[str], typer.Option(help="Run name (its prefix in the store).")] = None,
    public_key: Annotated[Optional[str], typer.Option(help="The run's public key: hex, or a .pub file.")] = None,
    id: Annotated[Optional[str], typer.Option("--id", help="Worker id (default: w-<key id>, the same on every start with the same key).")] = None,
    cache: Annotated[Optional[Path], typer.Option(help="Local folder for the run's model files and kept weights (default ~/.cache/stoa/<run>/<id>).")] = None,
    max_batches: Annotated[Optional[int], typer.Option(help="Exit after this many uploads.")] = None,
    max_hours: Annotated[Optional[float], typer.Option(help="Exit after this many hours (finishing the current upload).")] = None,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads the engine's math may use (default: all).")] = None,
    follow_only: Annotated[bool, typer.Option("--follow-only", help="Only follow the weight chain (apply and verify every version); generate nothing.")] = False,
    key: Annotated[Optional[Path], typer.Option(help="This worker's private key (stoa keygen --worker); default: the invite's, else <cache>/worker.key with --cache, else ~/.config/stoa/worker.key (made on first start).")] = None,
    adversary: Annotated[Optional[str], typer.Option(help="Run as a dishonest worker of this kind, to test a trainer's checks (stoa.testing.adversaries).")] = None,
    stages: Annotated[Optional[int], typer.Option(help="Drive a pipeline of this many stages: hold stage 0 here, the others are `stoa stage` processes (docs/pipeline.md).")] = None,
    pipeline: Annotated[str, typer.Option(help="The pipeline's id, with --stages (its stages announce under it).")] = "p0",
    max_memory_mb: Annotated[Optional[float], typer.Option(help="With --stages: refuse to start when stage 0's weights + KV need more than this.")] = None,
    stage_keys: Annotated[Optional[str], typer.Option(help="With --stages: key ids of the stages to accept (comma-separated; `stoa stage` logs its key id), besides keys enrolled in the run.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Generate rollouts with the int8 MLX engine from the newest signed weights; upload them.

    Exit status: 0 run finished / limit reached / stopped; 2 configuration error; 3 banned;
    4 no such run; 5 store unreachable (see docs/volunteer.md)."""
    from stoa.fleet.worker.invite import (
        check_run,
        check_worker_id,
        default_cache_dir,
        default_key_path,
        default_worker_id,
        read_invite,
    )
    from stoa.fleet.worker.worker import EXIT_CONFIG, Worker
    from stoa.transport.identity import load_or_create_worker_key
    from stoa.transport.signing import load_private_key, load_public_key
    from stoa.transport.store import open_store

    _setup_logging(verbose)
    _worker_threads(threads)
    worker_key = None
    if invite is not None:
        try:
            inv = read_invite(invite)
        except (OSError, ValueError) as e:
            _worker_fail(EXIT_CONFIG, f"cannot read the invite {invite}: {e}")
        store, run, public_key = store or inv.store, run or inv.run, public_key or inv.public_key
        if inv.worker_key is not None and key is None:
            worker_key, id = load_private_key(inv.worker_key), id or inv.worker_id
    missing = [f"--{n}" for n, v in (("store", store), ("run", run), ("public-key", public_key)) if not v]
    if missing:
        _worker_fail(EXIT_CONFIG, f"give --invite FILE, or all of --store, --run and --public-key (missing {', '.join(missing)})")
    try:  # before anything is written under a folder they name
        check_run(run)
        if id is not None:
            check_worker_id(id)
    except ValueError as e:
        _worker_fail(EXIT_CONFIG, str(e))
    try:
        load_public_key(public_key)
    except (OSError, ValueError, TypeError) as e:
        _worker_fail(EXIT_CONFIG, f"the run's public key {public_key!r} cannot be read: {e}")
    try:
        if key is not None:
            if not key.expanduser().exists():
                _worker_fail(EXIT_CONFIG, f"no key file {key} (make one with `stoa keygen --worker`, or leave --key out)")
            worker_key = load_private_key(key)
        elif worker_key is None:
            worker_key = load_or_create_worker_key(cache / "worker.key" if cache is not None else default_key_path())
    except (OSError, ValueError) as e:
        _worker_fail(EXIT_CONFIG, f"the worker key cannot be read: {e}")
    try:
        the_store = open_store(store)
    except (ValueError, OSError, ImportError) as e:
        _worker_fail(EXIT_CONFIG, f"cannot open the store {store!r}: {e}")
    if follow_only:
        import logging

        from stoa.fleet.worker.follower import Follower

        f = Follower(the_store, run, public_key, name=id or "follower")
        f.run(on_record=lambda r: logging.getLogger("stoa.follow").info(
            "%s to version %d in %.2f s (%d bytes, %d deltas%s)", r.kind, r.to_version, r.seconds, r.bytes_read,
            r.deltas, ", anchor" if r.anchor else ""))
        return
    wid = id or default_worker_id(worker_key)
    cache_dir = cache or default_cache_dir(run, wid)
    from stoa.fleet import lifetime

    lifetime.install()  # a stop request is bounded; started by `stoa train`, it dies with it
    args = (the_store, run, public_key, wid, cache_dir)
    kwargs = {"max_batches": max_batches, "private_key": worker_key,
              "max_seconds": None if max_hours is None else max_hours * 3600}
    if stages is not None:
        from stoa.fleet.stages.driver import PipelineWorker

        try:
            w = PipelineWorker(*args, **kwargs, pipeline=pipeline, stages=stages, max_memory_mb=max_memory_mb,
                               stage_keys=_key_ids(stage_keys))
        except ValueError as e:
            _worker_fail(EXIT_CONFIG, str(e))
        raise typer.Exit(w.run())
    if adversary:
        from stoa.testing.adversaries import make_adversary

        raise typer.Exit(make_adversary(adversary, *args, **kwargs).run())
    raise typer.Exit(Worker(*args, **kwargs).run())


def _key_ids(text: str | None) -> list[str]:
    """Key ids from a comma-separated option (16 hex characters each; ValueError otherwise)."""
    from stoa.transport import layout

    ids = [k.strip() for k in (text or "").split(",") if k.strip()]
    for k in ids:
        if not layout.KEY_ID.fullmatch(k):
            raise ValueError(f"{k[:40]!r} is not a key id (16 hex characters)")
    return ids


def stage_cmd(
    stage: Annotated[str, typer.Option(help="Which stage of how many: i/N, 1 <= i < N (stage 0 is `stoa worker --stages N`).")],
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    run: Annotated[str, typer.Option(help="Run name (its prefix in the store).")],
    public_key: Annotated[str, typer.Option(help="The run's public key: hex, or a .pub file.")],
    cache: Annotated[Path, typer.Option(help="Local folder for the run's model files and this stage's key.")],
    pipeline: Annotated[str, typer.Option(help="The pipeline's id (the driver's --pipeline).")] = "p0",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port; the announcement says which).")] = 0,
    advertise: Annotated[Optional[str], typer.Option(help="Address the driver should connect to, HOST or HOST:PORT ([IPv6]:PORT), when it differs from where this stage listens (a forwarded port, a proxy); default: --host and the port listened on.")] = None,
    max_memory_mb: Annotated[Optional[float], typer.Option(help="Refuse to start when this stage's weights + KV need more than this.")] = None,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads the stage's math may use (default: all).")] = None,
    driver_key: Annotated[Optional[str], typer.Option(help="Key id of the driver to serve (comma-separated for several), besides keys enrolled in the run.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Serve layers of the model to a pipeline's driver (one stage of `stoa worker --stages N`).

    Exit status: 0 run finished / stopped; 2 configuration error (a bad --stage, over --max-memory-mb)."""
    import signal

    from stoa.fleet.stages.server import StageServer
    from stoa.transport.store import open_store

    _setup_logging(verbose)
    _worker_threads(threads)
    try:
        i, n = (int(x) for x in stage.split("/"))
        server = StageServer(open_store(store), run, public_key, pipeline, i, n, cache, host, port, advertise,
                             max_memory_mb, driver_keys=_key_ids(driver_key))
    except (ValueError, OSError, TypeError) as e:
        _worker_fail(2, f"cannot start the stage: {e}")
    from stoa.fleet import lifetime

    lifetime.install()  # a stop request is bounded, as for a worker

    def stop(*_: object) -> None:
        lifetime.stop_requested()
        server.stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    raise typer.Exit(server.run())
