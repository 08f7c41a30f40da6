"""The run's keys and roster: ``keygen``, ``enroll``, ``ban`` and ``invite``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from stoa.cli.common import read_private_key

__all__ = ["ban", "enroll", "invite_cmd", "keygen"]


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

    run_key = read_private_key(key)
    try:
        roster = enroll_worker(open_store(store), run, run_key, worker_public_key, worker_id, note)
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"enrolled {worker_id} (roster revision {roster.revision}: {len(roster.enrolled)} enrolled)")


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

    run_key = read_private_key(key)
    try:
        done = ban_worker(open_store(store, create=False), run, run_key, who, reason)
    except (KeyError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"banned {who} ({done.reason})")


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
