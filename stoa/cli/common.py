"""What the commands share: the one-line :class:`UserError` and the run's keys read from the
command line."""

from __future__ import annotations

from pathlib import Path

from stoa.errors import ExpectedFailure

__all__ = ["UserError", "read_private_key", "read_public_key"]


class UserError(ExpectedFailure):
    """A failure of a command's own arguments: ``main`` prints its one-line message (naming the
    fix) and exits with ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = self.exit_code = code


def read_private_key(path: Path, what: str = "--key: the run's private key") -> object:
    """A private key file, or a one-line error naming how to make one."""
    from stoa.transport.signing import load_private_key

    if not Path(path).expanduser().is_file():
        raise UserError(f"no key file {path} ({what}; make one with `stoa keygen DIR`)", 2)
    try:
        return load_private_key(path)
    except ValueError as e:
        raise UserError(f"{path}: {e} ({what})", 2) from None


def read_public_key(src: str) -> object:
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
