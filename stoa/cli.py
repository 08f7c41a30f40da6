"""The ``stoa`` command line. Heavy imports happen inside each command, never at start-up."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

import stoa

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
) -> None:
    """Stoa command line."""


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
                          "qwen3-0.6b, qwen3-8b, llama-3.2-1b, or a config.json path. --vocab-size then sets "
                          "the tokenizer's size; the embedding keeps the shape's vocabulary."),
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
    from stoa.transport.signing import load_private_key
    from stoa.transport.store import open_store

    try:
        roster = enroll_worker(open_store(store), run, load_private_key(key), worker_public_key, worker_id, note)
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"enrolled {worker_id} (roster revision {roster.revision}: {len(roster.enrolled)} enrolled, "
               f"{len(roster.banned)} banned)")


@app.command("ban")
def ban(
    who: Annotated[str, typer.Argument(help="A worker id enrolled in the run, or a key id (16 hex).")],
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    run: Annotated[str, typer.Option(help="Run name.")],
    key: Annotated[Path, typer.Option(help="The run's private key (the roster is signed with it).")],
    reason: Annotated[str, typer.Option(help="Why (kept in the roster and shown by stoa status).")] = "banned by hand",
) -> None:
    """Ban a worker key: the trainer drops its queued batches and refuses the rest; the worker stops."""
    from stoa.transport.identity import ban_worker
    from stoa.transport.signing import load_private_key
    from stoa.transport.store import open_store

    try:
        roster = ban_worker(open_store(store), run, load_private_key(key), who, reason)
    except (KeyError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"banned {who} (roster revision {roster.revision}: {len(roster.banned)} banned)")


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
    """Run a whole fleet locally: the trainer plus N int8 workers meeting in runs/<name>/store (or --store)."""
    from stoa.fleet.config import ConfigError, load_config
    from stoa.fleet.local import train_local

    try:
        if check:
            typer.echo(load_config(config, _parse_sets(set_)).to_json())
            return
        train_local(config, _parse_sets(set_), runs_root=runs, resume=resume, workers=workers, store=store,
                    adversaries=adversary or [])
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
    from stoa.fleet.sweep import SweepError, collect, load_sweep, run_sweep, validate, write_report

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

    Several GPUs: `torchrun --nproc-per-node N -m stoa trainer ...` with learner.kind = "megatron"."""
    from stoa.fleet.config import ConfigError, load_config
    from stoa.fleet.trainer import Trainer
    from stoa.transport.signing import load_private_key
    from stoa.transport.store import open_store

    _setup_logging(verbose)
    try:
        cfg = load_config(config, _parse_sets(set_))
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    run_dir = run_dir or Path("runs") / cfg.name
    from stoa.fleet import distributed

    if distributed.world_size() > 1:  # under torchrun: rank 0 runs the loop, the other ranks follow it
        try:
            distributed.run_ranks(cfg, lambda ranks: Trainer(cfg, open_store(store), run_dir, load_private_key(key),
                                                             resume=resume, ranks=ranks).run())
        except distributed.RankFailed as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        return
    Trainer(cfg, open_store(store), run_dir, load_private_key(key), resume=resume).run()


@app.command("worker")
def worker(
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    run: Annotated[str, typer.Option(help="Run name (its prefix in the store).")],
    public_key: Annotated[str, typer.Option(help="The run's public key: hex, or a .pub file.")],
    id: Annotated[Optional[str], typer.Option("--id", help="Worker id (default: hostname-pid).")] = None,
    cache: Annotated[Optional[Path], typer.Option(help="Local folder for the run's model files.")] = None,
    max_batches: Annotated[Optional[int], typer.Option(help="Exit after this many uploads.")] = None,
    follow_only: Annotated[bool, typer.Option("--follow-only", help="Only follow the weight chain (apply and verify every version); generate nothing.")] = False,
    key: Annotated[Optional[Path], typer.Option(help="This worker's private key (stoa keygen --worker); default <cache>/worker.key, made on first start.")] = None,
    adversary: Annotated[Optional[str], typer.Option(help="Run as a dishonest worker of this kind, to test a trainer's checks (stoa.testing.adversaries).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Generate rollouts with the int8 MLX engine from the newest signed weights; upload them."""
    import re
    import socket

    from stoa.fleet.worker import Worker
    from stoa.transport.store import open_store

    _setup_logging(verbose)
    if follow_only:
        import logging

        from stoa.fleet.follower import Follower

        f = Follower(open_store(store), run, public_key, name=id or "follower")
        f.run(on_record=lambda r: logging.getLogger("stoa.follow").info(
            "%s to version %d in %.2f s (%d bytes, %d deltas%s)", r.kind, r.to_version, r.seconds, r.bytes_read,
            r.deltas, ", anchor" if r.anchor else ""))
        return
    wid = id or re.sub(r"[^A-Za-z0-9._-]", "-", f"{socket.gethostname()}-{os.getpid()}")[:64]
    cache_dir = cache or Path.home() / ".cache" / "stoa" / run / wid
    args = (open_store(store), run, public_key, wid, cache_dir)
    kwargs = {"max_batches": max_batches, "private_key": key}
    if adversary:
        from stoa.testing.adversaries import make_adversary

        raise typer.Exit(make_adversary(adversary, *args, **kwargs).run())
    raise typer.Exit(Worker(*args, **kwargs).run())


@app.command("status")
def status(
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    run: Annotated[str, typer.Option(help="Run name.")],
    public_key: Annotated[Optional[str], typer.Option(help="The run's public key, to verify eval results.")] = None,
) -> None:
    """Show the fleet: workers and their last heartbeat, versions, lag, throughput, evaluations."""
    from stoa.fleet.status import show_status
    from stoa.transport.store import open_store

    show_status(open_store(store), run, public_key)


def main() -> None:
    """Console entry point."""
    app(prog_name="stoa")


if __name__ == "__main__":
    main()
