"""Watching and keeping a run: ``status``, ``dashboard``, ``report`` and ``export``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from stoa.cli.common import UserError, read_public_key

__all__ = ["dashboard", "export", "report", "status"]


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
    key = read_public_key(public_key) if public_key else None
    try:
        show_status(open_store(store, create=False), run, key, as_json=json_, watch=every if watch else None)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


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
    dash = Dashboard(open_store(store, create=False), run, read_public_key(public_key) if public_key else None,
                     run_dir, refresh_s=every)
    dash.snapshot()  # a missing run is one line before anything is bound
    try:
        serve(dash, host, port, on_ready=typer.echo)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


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
    key = read_public_key(public_key) if public_key else None
    try:
        write_report(run_dir, open_store(store, create=False) if store else None, public_key=key)
    except FileNotFoundError as e:
        raise UserError(str(e), 2) from None
    typer.echo((run_dir / "summary.md").read_text(), nl=False)


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
