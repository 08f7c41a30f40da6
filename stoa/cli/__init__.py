"""The ``stoa`` command line. Heavy imports happen inside each command, never at start-up.

One module per group of commands: :mod:`~stoa.cli.tools` (init-tiny, retriever, envs),
:mod:`~stoa.cli.keys` (keygen, enroll, ban, invite), :mod:`~stoa.cli.run` (train, sweep, trainer,
worker, stage), :mod:`~stoa.cli.operator` (status, dashboard, report, export); what they share is
in :mod:`~stoa.cli.common`. This module is the only one that knows them all: it registers each
command, in the order ``stoa --help`` lists them, and turns expected failures into one line.
"""

from __future__ import annotations

from typing import Annotated

import typer

import stoa
from stoa.cli import keys, operator, run, tools
from stoa.cli.common import UserError
from stoa.errors import ExpectedFailure

__all__ = ["UserError", "app", "explain", "main"]

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


for name, command in [("init-tiny", tools.init_tiny), ("keygen", keys.keygen), ("enroll", keys.enroll),
                      ("ban", keys.ban), ("train", run.train), ("sweep", run.sweep), ("trainer", run.trainer),
                      ("worker", run.worker), ("stage", run.stage_cmd), ("invite", keys.invite_cmd),
                      ("status", operator.status), ("dashboard", operator.dashboard), ("report", operator.report),
                      ("export", operator.export)]:
    app.command(name)(command)
app.add_typer(tools.retriever_app, name="retriever")
app.add_typer(tools.envs_app, name="envs")


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
