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
) -> None:
    """Build a small random Qwen2 model with a trained byte-level BPE tokenizer (HF format, offline)."""
    from stoa.models.tiny import TinyConfig, build_tiny

    if text is not None:
        texts = [line for line in text.read_text().splitlines() if line.strip()]
    else:
        from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts

        texts = list(tokenizer_texts(generate(SyntheticConfig(seed=seed))))
    cfg = TinyConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, seed=seed)
    path = build_tiny(out_dir, texts, cfg)
    cfg_json = (path / "config.json").read_text()
    import json

    c = json.loads(cfg_json)
    typer.echo(f"wrote {path} (vocab {c['vocab_size']}, hidden {c['hidden_size']}, layers {c['num_hidden_layers']})")


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
    name: Annotated[str, typer.Option(help="File name stem, e.g. the run's name.")] = "run",
) -> None:
    """Write a new ed25519 keypair for signing a run's weights (the trainer keeps .key, workers get .pub)."""
    from stoa.transport.signing import generate_private_key, key_id, save_keypair

    key = generate_private_key()
    try:
        priv, pub = save_keypair(key, out_dir, name)
    except FileExistsError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {priv} (private, keep it on the trainer) and {pub} (give it to workers)")
    typer.echo(f"key id {key_id(key.public_key())}, public key {key.public_key().public_bytes_raw().hex()}")


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
) -> None:
    """Run a whole fleet locally: the trainer plus N int8 workers meeting in runs/<name>/store."""
    from stoa.fleet.config import ConfigError, load_config
    from stoa.fleet.local import train_local

    try:
        if check:
            typer.echo(load_config(config, _parse_sets(set_)).to_json())
            return
        train_local(config, _parse_sets(set_), runs_root=runs, resume=resume, workers=workers)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


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
    """Train: consume episodes from the store, take optimizer steps, publish int8 weights through PULSE."""
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
    Trainer(cfg, open_store(store), run_dir or Path("runs") / cfg.name, load_private_key(key), resume=resume).run()


@app.command("worker")
def worker(
    store: Annotated[str, typer.Option(help="Object store: a path, file://..., or s3://bucket/prefix.")],
    run: Annotated[str, typer.Option(help="Run name (its prefix in the store).")],
    public_key: Annotated[str, typer.Option(help="The run's public key: hex, or a .pub file.")],
    id: Annotated[Optional[str], typer.Option("--id", help="Worker id (default: hostname-pid).")] = None,
    cache: Annotated[Optional[Path], typer.Option(help="Local folder for the run's model files.")] = None,
    max_batches: Annotated[Optional[int], typer.Option(help="Exit after this many uploads.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Generate rollouts with the int8 MLX engine from the newest signed weights; upload them."""
    import re
    import socket

    from stoa.fleet.worker import Worker
    from stoa.transport.store import open_store

    _setup_logging(verbose)
    wid = id or re.sub(r"[^A-Za-z0-9._-]", "-", f"{socket.gethostname()}-{os.getpid()}")[:64]
    cache_dir = cache or Path.home() / ".cache" / "stoa" / run / wid
    raise typer.Exit(Worker(open_store(store), run, public_key, wid, cache_dir, max_batches=max_batches).run())


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
