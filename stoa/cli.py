"""The ``stoa`` command line. Heavy imports happen inside each command, never at start-up."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

import stoa
from stoa.errors import ExpectedFailure

app = typer.Typer(
    name="stoa",
    help="Decentralized RL post-training: int8 MLX rollout workers and a GPU trainer meeting in an object store.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"stoa {stoa.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show the traceback of any failure (errors are one line otherwise).")
    ] = False,
) -> None:
    """Stoa command line."""


def _private_key(path: Path, what: str = "--key: the run's private key") -> object:
    """A private key file, or a one-line error naming how to make one."""
    from stoa.transport.signing import load_private_key

    if not Path(path).expanduser().is_file():
        raise UserError(f"no key file {path} ({what}; make one with `stoa keygen DIR`)", 2)
    try:
        return load_private_key(path)
    except ValueError as e:
        raise UserError(f"{path}: {e} ({what})", 2) from None


def _public_key(src: str) -> object:
    """A public key given as 64 hex characters or a .pub file, or a one-line error."""
    from stoa.transport.signing import load_public_key

    is_hex = len(src) == 64 and all(c in "0123456789abcdefABCDEF" for c in src)
    if not is_hex and not Path(src).expanduser().is_file():
        raise UserError(f"--public-key {src!r} is neither 64 hex characters nor an existing .pub file "
                        "(the run's operator gives it out: `stoa keygen` wrote it as run.pub)", 2)
    try:
        return load_public_key(src)
    except ValueError as e:
        raise UserError(f"--public-key {src}: {e}", 2) from None


@app.command("init-tiny")
def init_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the Hugging Face model into.")],
    text: Annotated[
        Optional[Path], typer.Option(help="Text file (one document per line) to train the tokenizer on.")
    ] = None,
    vocab_size: Annotated[int, typer.Option(help="Target BPE vocabulary size.")] = 2048,
    hidden_size: Annotated[int, typer.Option(help="Model width (multiple of 64).")] = 128,
    num_layers: Annotated[int, typer.Option(help="Transformer blocks.")] = 4,
    num_heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    num_kv_heads: Annotated[int, typer.Option(help="Key/value heads.")] = 2,
    intermediate_size: Annotated[int, typer.Option(help="MLP width (multiple of 64).")] = 512,
    seed: Annotated[int, typer.Option(help="Weight-initialisation seed.")] = 0,
    preset: Annotated[
        Optional[str],
        typer.Option(help="Real shape instead of the tiny one: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, "
                          "qwen3-0.6b, qwen3-8b, llama-3.2-1b, smollm2-135m, mistral-7b-v0.1, gemma-2-2b, "
                          "gemma-3-1b, or a config.json path. --vocab-size then sets the tokenizer's size; the "
                          "embedding keeps the shape's vocabulary."),
    ] = None,
    dtype: Annotated[str, typer.Option(help="Weights on disk with --preset: float32 or bfloat16.")] = "float32",
) -> None:
    """Build a random model with a trained byte-level BPE tokenizer (HF format, offline): a small
    Qwen2 by default, or a public checkpoint's exact shape with --preset."""
    import json
    import time

    if text is not None:
        texts = [line for line in text.read_text().splitlines() if line.strip()]
    else:
        from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts

        texts = list(tokenizer_texts(generate(SyntheticConfig(seed=seed))))
    t0 = time.perf_counter()
    if preset is not None:
        from stoa.models.presets import build_preset, num_params

        try:
            path = build_preset(out_dir, preset, texts, tokenizer_vocab=vocab_size, dtype=dtype, seed=seed)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    else:
        from stoa.models.tiny import TinyConfig, build_tiny

        cfg = TinyConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, seed=seed)
        path = build_tiny(out_dir, texts, cfg)
    c = json.loads((path / "config.json").read_text())
    extra = ""
    if preset is not None:
        extra = f", {num_params(c) / 1e9:.3f}B params, {time.perf_counter() - t0:.0f} s"
    typer.echo(f"wrote {path} (vocab {c['vocab_size']}, hidden {c['hidden_size']}, layers {c['num_hidden_layers']}{extra})")


retriever_app = typer.Typer(help="Build and serve BM25 retrieval indexes (Search-R1 API).", no_args_is_help=True)
app.add_typer(retriever_app, name="retriever")


@retriever_app.command("build")
def retriever_build(
    corpus: Annotated[str, typer.Option(help="Corpus: hub dataset name or local .parquet/.jsonl file or folder.")],
    out: Annotated[Path, typer.Option(help="New (empty) folder to write the index into.")],
    limit: Annotated[Optional[int], typer.Option(help="Index only the first N documents.")] = None,
    files: Annotated[Optional[str], typer.Option(help="Hub file(s) within the dataset, e.g. data/corpus/pubmed.jsonl.")] = None,
) -> None:
    """Index a corpus with bm25s and save it (loaded memory-mapped by --index users)."""
    import time

    from stoa.envs.data import iter_corpus
    from stoa.envs.retrieval import BM25SRetriever

    t0 = time.perf_counter()
    r = BM25SRetriever.build(iter_corpus(corpus, files=files, limit=limit), out=out)
    typer.echo(f"indexed {len(r)} documents into {out} in {time.perf_counter() - t0:.1f} s")


@retriever_app.command("serve")
def retriever_serve(
    index: Annotated[Optional[Path], typer.Option(help="Index folder written by `stoa retriever build`.")] = None,
    corpus: Annotated[Optional[str], typer.Option(help="Or: a corpus to index in memory first.")] = None,
    synthetic_seed: Annotated[Optional[int], typer.Option(help="Or: serve the synthetic corpus of this seed.")] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 8000,
    topk: Annotated[int, typer.Option(help="Default topk when a request omits it.")] = 3,
) -> None:
    """Serve POST /retrieve (Search-R1 API) until interrupted."""
    from stoa.envs.server import ServerLimits, serve

    if sum(x is not None for x in (index, corpus, synthetic_seed)) != 1:
        raise typer.BadParameter("give exactly one of --index, --corpus, --synthetic-seed")
    if index is not None:
        from stoa.envs.retrieval import load_retriever

        retriever = load_retriever(index)
    elif corpus is not None:
        from stoa.envs.data import iter_corpus
        from stoa.envs.retrieval import BM25SRetriever

        retriever = BM25SRetriever.build(iter_corpus(corpus))
    else:
        from stoa.envs.retrieval import BM25SRetriever
        from stoa.envs.synthetic import SyntheticConfig, generate

        retriever = BM25SRetriever.build(generate(SyntheticConfig(seed=synthetic_seed)).docs)
    serve(retriever, host, port, ServerLimits(default_topk=topk))


envs_app = typer.Typer(help="Text environments a run can name in env.id.", no_args_is_help=True)
app.add_typer(envs_app, name="envs")


@envs_app.command("list")
def envs_list(
    dataset: Annotated[
        Optional[list[str]], typer.Option(help="Check only these reasoning-gym datasets (repeatable).")
    ] = None,
) -> None:
    """Registered ids, then every reasoning-gym dataset checked through the adapter (check_env and
    its gold answers), passing or refused with the reason."""
    import gymnasium

    import stoa.envs  # noqa: F401 - registers the built-in and installed ids

    ids = sorted(k for k, spec in gymnasium.registry.items()
                 if "/" in k and not str(spec.entry_point).startswith("gymnasium."))
    typer.echo(f"registered ({len(ids)}): " + ", ".join(ids))
    try:
        from stoa.envs import rgym

        names = dataset or rgym.dataset_names()
    except ImportError:
        typer.echo("reasoning_gym:<dataset>: not installed (pip install 'stoa[reasoning-gym]')")
        return
    passing, refused = rgym.survey(names, progress=lambda n: typer.echo(f"checking {rgym.PREFIX}{n}", err=True))
    typer.echo(f"{rgym.PREFIX}<dataset> passing check_env ({len(passing)} of {len(names)}): " + ", ".join(passing))
    typer.echo(f"refused ({len(refused)}):")
    for name, why in refused.items():
        typer.echo(f"  {rgym.PREFIX}{name}: {why}")


@app.command("keygen")
def keygen(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write <name>.key and <name>.pub into.")],
    name: Annotated[Optional[str], typer.Option(help="File name stem (default: run, or worker with --worker).")] = None,
    worker_key: Annotated[bool, typer.Option("--worker", help="A worker's key (it signs the worker's uploads).")] = False,
) -> None:
    """Write a new ed25519 keypair: a run's (the trainer keeps .key, workers get .pub) or, with
    --worker, a worker's (the worker keeps .key; the run's operator enrolls .pub with `stoa enroll`)."""
    from stoa.transport.signing import generate_private_key, key_id, save_keypair

    key = generate_private_key()
    try:
        priv, pub = save_keypair(key, out_dir, name or ("worker" if worker_key else "run"))
    except FileExistsError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if worker_key:
        typer.echo(f"wrote {priv} (private, keep it on the worker: stoa worker --key) and {pub} (for stoa enroll)")
    else:
        typer.echo(f"wrote {priv} (private, keep it on the trainer) and {pub} (give it to workers)")
    typer.echo(f"key id {key_id(key.public_key())}, public key {key.public_key().public_bytes_raw().hex()}")


@app.command("enroll")
def enroll(
    worker_public_key: Annotated[str, typer.Argument(help="The worker's public key: hex, or its .pub file.")],
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    run: Annotated[str, typer.Option(help="Run name.")],
    key: Annotated[Path, typer.Option(help="The run's private key (the roster is signed with it).")],
    worker_id: Annotated[str, typer.Option("--worker-id", help="The worker id this key uploads as.")],
    note: Annotated[str, typer.Option(help="A note kept in the roster (who, which machine).")] = "",
) -> None:
    """Enroll a worker key in the run's signed roster (<run>/workers.json); takes effect while the run is live."""
    from stoa.transport.identity import enroll_worker
    from stoa.transport.store import open_store

    run_key = _private_key(key)
    try:
        roster = enroll_worker(open_store(store), run, run_key, worker_public_key, worker_id, note)
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"enrolled {worker_id} (roster revision {roster.revision}: {len(roster.enrolled)} enrolled)")


@app.command("ban")
def ban(
    who: Annotated[str, typer.Argument(help="A worker id enrolled in the run, or a key id (16 hex).")],
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    run: Annotated[str, typer.Option(help="Run name.")],
    key: Annotated[Path, typer.Option(help="The run's private key (the roster is signed with it).")],
    reason: Annotated[str, typer.Option(help="Why (kept in the key's ban document, at most 240 characters, and shown by stoa status).")] = "banned by hand",
) -> None:
    """Ban a worker key: the trainer drops its queued batches and refuses the rest; the worker stops."""
    from stoa.transport.identity import ban_worker
    from stoa.transport.store import open_store

    run_key = _private_key(key)
    try:
        done = ban_worker(open_store(store, create=False), run, run_key, who, reason)
    except (KeyError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"banned {who} ({done.reason})")


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


@app.command("train")
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


@app.command("sweep")
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


@app.command("trainer")
def trainer(
    config: Annotated[Path, typer.Argument(help="Run config (TOML).")],
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    key: Annotated[Path, typer.Option(help="The run's ed25519 private key (from `stoa keygen`).")],
    run_dir: Annotated[Optional[Path], typer.Option(help="Local folder for checkpoints and metrics (default runs/<name>).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in --run-dir.")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a config key: --set trainer.steps=50.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Train: consume episodes from the store, take optimizer steps, publish int8 weights through PULSE.

    SIGINT / SIGTERM / SIGHUP stop it after the current step with a checkpoint, without marking the
    run finished (`--resume` continues it); a step still running 20 s after the signal is abandoned
    (exit 143; redone after `--resume`); a second Ctrl-C stops at once.

    Several GPUs: `torchrun --nproc-per-node N -m stoa trainer ...` with learner.kind = "megatron"."""
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
    private_key = _private_key(key)
    from stoa.fleet.trainer import distributed

    if distributed.world_size() > 1:  # under torchrun: rank 0 runs the loop, the other ranks follow it
        try:
            distributed.run_ranks(cfg, lambda ranks: Trainer(cfg, open_store(store), run_dir, private_key,
                                                             resume=resume, ranks=ranks).run())
        except distributed.RankFailed as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        return
    trainer = Trainer(cfg, open_store(store), run_dir, private_key, resume=resume)
    import signal

    from stoa.fleet import lifetime

    lifetime.install()  # a stop request is bounded; started by `stoa train`, it dies with it
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # stop after the current step, with a checkpoint
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


@app.command("worker")
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
            w = PipelineWorker(*args, **kwargs, pipeline=pipeline, stages=stages, max_memory_mb=max_memory_mb)
        except ValueError as e:
            _worker_fail(EXIT_CONFIG, str(e))
        raise typer.Exit(w.run())
    if adversary:
        from stoa.testing.adversaries import make_adversary

        raise typer.Exit(make_adversary(adversary, *args, **kwargs).run())
    raise typer.Exit(Worker(*args, **kwargs).run())


@app.command("stage")
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
                             max_memory_mb)
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


@app.command("invite")
def invite_cmd(
    out: Annotated[Path, typer.Argument(help="The invite file to write (new).")],
    store: Annotated[str, typer.Option(help="The store URL as workers reach it: a path, file://..., or s3://bucket/prefix?endpoint=URL.")],
    run: Annotated[str, typer.Option(help="Run name.")],
    key: Annotated[Optional[Path], typer.Option(help="The run's private key: its public half goes in the invite; needed with --enroll.")] = None,
    public_key: Annotated[Optional[str], typer.Option(help="Or: the run's public key (hex or .pub file), for an invite without an enrolled key.")] = None,
    enroll: Annotated[Optional[str], typer.Option(help="Make a worker key, enroll it in the run's roster under this worker id, and put it in the invite.")] = None,
    note: Annotated[str, typer.Option(help="A note kept in the roster with --enroll (who, which machine).")] = "",
) -> None:
    """Write an invite: all a volunteer needs to run `stoa worker --invite FILE` (no store credentials)."""
    from stoa.fleet.worker.invite import Invite, write_invite
    from stoa.transport.signing import generate_private_key, key_id, load_private_key, load_public_key

    try:
        if key is not None:
            run_key = load_private_key(key)
            pub = run_key.public_key()
        elif public_key is not None:
            run_key, pub = None, load_public_key(public_key)
        else:
            raise ValueError("give --key (the run's private key) or --public-key")
        worker_key = worker_id = None
        if enroll is not None:
            if run_key is None:
                raise ValueError("--enroll signs the roster: give --key, the run's private key")
            from stoa.transport.identity import enroll_worker
            from stoa.transport.store import open_store

            wk = generate_private_key()
            enroll_worker(open_store(store), run, run_key, wk, enroll, note or "stoa invite")
            worker_key, worker_id = wk.private_bytes_raw().hex(), enroll
        where = store if "://" in store else str(Path(store).expanduser().resolve())  # a path: from anywhere
        path = write_invite(out, Invite(where, run, pub.public_bytes_raw().hex(), worker_id, worker_key))
    except FileExistsError:
        typer.echo(f"error: {out} exists; choose another file", err=True)
        raise typer.Exit(1) from None
    except (OSError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    who = f"; it enrolls worker {worker_id} (key {key_id(load_private_key(worker_key).public_key())}): keep it secret" \
        if worker_key else ""
    typer.echo(f"wrote {path}{who}. The volunteer runs: stoa worker --invite {path.name}")


@app.command("status")
def status(
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    run: Annotated[str, typer.Option(help="Run name.")],
    public_key: Annotated[Optional[str], typer.Option(help="The run's public key: every document shown is verified (without it they are shown marked unverified).")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print everything known as JSON (per worker: heartbeat and trust record, full reasons).")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until the run finishes (with --json: one JSON object per line).")] = False,
    every: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 5.0,
) -> None:
    """Show the fleet: workers and their last heartbeat, versions, lag, throughput, trust, evaluations.

    Give --public-key to verify what the trainer signed; without it, those documents are marked unverified."""
    from stoa.fleet.operator.status import show_status
    from stoa.transport.store import open_store

    if every <= 0:
        raise typer.BadParameter("--every must be > 0")
    key = _public_key(public_key) if public_key else None
    try:
        show_status(open_store(store, create=False), run, key, as_json=json_, watch=every if watch else None)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@app.command("dashboard")
def dashboard(
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    run: Annotated[str, typer.Option(help="Run name.")],
    public_key: Annotated[Optional[str], typer.Option(help="The run's public key: every document shown is verified (without it they are shown marked unverified).")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="The run folder (local runs): its metrics.jsonl gives every step's curves.")] = None,
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0 shows the page to the network: volunteers too).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 8765,
    every: Annotated[float, typer.Option(help="Seconds between reads of the store (however many browsers watch).")] = 5.0,
) -> None:
    """Serve a live page of the run: curves, every worker's standing, bans and the store (read-only).

    A volunteer finds its own row at URL#worker=<worker id>. Needs starlette and uvicorn (the dashboard extra)."""
    from stoa.transport.store import open_store

    from stoa.fleet.operator.dashboard import Dashboard, serve

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"stoa dashboard needs starlette and uvicorn ({e}): pip install 'stoa[dashboard]'", 2) from None
    if every <= 0:
        raise typer.BadParameter("--every must be > 0")
    if run_dir is not None and not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"--run-dir {run_dir}: no metrics.jsonl there (the trainer writes it in its run folder)", 2)
    dash = Dashboard(open_store(store, create=False), run, _public_key(public_key) if public_key else None,
                     run_dir, refresh_s=every)
    dash.snapshot()  # a missing run is one line before anything is bound
    try:
        serve(dash, host, port, on_ready=typer.echo)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@app.command("report")
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run folder: runs/<name> of `stoa train`, or a `stoa trainer` --run-dir.")],
    store: Annotated[Optional[str], typer.Option(help="The run's object store, for the trust section when the run folder has no copy of the trainer's report (default: <run_dir>/store if there).")] = None,
    public_key: Annotated[Optional[str], typer.Option(help="The run's public key, to verify the store's trust report (default: <run_dir>/keys/run.pub if there; without one it is shown marked unverified).")] = None,
) -> None:
    """Write plots, summary.json and summary.md for a run folder (also a trainer-only run's) and print the summary."""
    from stoa.fleet.operator.report import write_report
    from stoa.transport.store import open_store

    if store is None and (run_dir / "store").is_dir():
        store = str(run_dir / "store")
    key = _public_key(public_key) if public_key else None
    try:
        write_report(run_dir, open_store(store, create=False) if store else None, public_key=key)
    except FileNotFoundError as e:
        raise UserError(str(e), 2) from None
    typer.echo((run_dir / "summary.md").read_text(), nl=False)


@app.command("export")
def export(
    checkpoint: Annotated[Path, typer.Argument(help="A checkpoint folder (runs/<name>/checkpoints/v...) or a run folder (its newest checkpoint).")],
    out: Annotated[Path, typer.Argument(help="New folder to write the Hugging Face model into.")],
    model: Annotated[Optional[Path], typer.Option(help="The Hugging Face folder the run started from (default: found from the run folder).")] = None,
    dtype: Annotated[str, typer.Option(help="Weights dtype: auto (the starting model's), float32, bfloat16 or float16.")] = "auto",
) -> None:
    """Write a trained checkpoint (torch or Megatron learner) as a Hugging Face folder: config.json,
    model.safetensors and the tokenizer, loadable by transformers and mlx_lm."""
    from stoa.backends.export import ExportError, export_checkpoint

    try:
        path = export_checkpoint(checkpoint, out, model_dir=model, dtype=dtype)  # type: ignore[arg-type]
    except ExportError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path} (load it with transformers' from_pretrained or mlx_lm.load)")


class UserError(ExpectedFailure):
    """A failure of a command's own arguments: ``main`` prints its one-line message (naming the
    fix) and exits with ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = self.exit_code = code


_CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or put them in the URL: "
                    "s3://KEY:SECRET@BUCKET/PREFIX")


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def explain(e: BaseException) -> tuple[str, int] | None:
    """The one-line message and exit code of an expected failure (:class:`stoa.errors.ExpectedFailure`,
    or the S3 client's credential and connection errors behind one), or None for anything else (a
    bug: its traceback is shown). The user's own input (exit code 2, and a command's arguments)
    is said as it is; a store's refusal is said by its cause when the S3 client gives one."""
    from botocore import exceptions as s3

    chain = _chain(e)
    codes = {(getattr(x, "response", None) or {}).get("Error", {}).get("Code") for x in chain} - {None}
    if isinstance(e, UserError) or (isinstance(e, ExpectedFailure) and e.exit_code == 2):
        return str(e), e.exit_code
    if any(isinstance(x, (s3.NoCredentialsError, s3.PartialCredentialsError)) for x in chain):
        return f"no S3 credentials for the store: {_CREDENTIALS_FIX}", 1
    if codes & {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"}:
        return f"the store refused the S3 credentials ({sorted(codes)[0]}): check them; {_CREDENTIALS_FIX}", 1
    if codes & {"NoSuchBucket"}:
        return f"{e}: the bucket does not exist; create it, or fix the bucket name in --store", 1
    unreachable = (s3.EndpointConnectionError, s3.ConnectTimeoutError, s3.ConnectionClosedError, ConnectionRefusedError)
    if any(isinstance(x, unreachable) for x in chain):
        return f"cannot reach the store: {e} (check the endpoint in --store and your network)", 1
    if isinstance(e, ExpectedFailure):
        return str(e), e.exit_code
    return None


def _verbose_requested(argv: list[str]) -> bool:
    return any(a in ("--verbose", "-v") for a in argv)


def main() -> None:
    """Console entry point: expected failures print one line and exit non-zero; ``--verbose`` (or
    ``-v``) shows their traceback too."""
    import sys

    try:
        app(prog_name="stoa")
    except Exception as e:  # noqa: BLE001 - sorted into expected failures and bugs below
        known = explain(e)
        if known is None or _verbose_requested(sys.argv[1:]):
            raise
        typer.echo(f"error: {known[0]}", err=True)
        sys.exit(known[1])


if __name__ == "__main__":
    main()
