"""The one base class of the failures a user is told about in one line.

A failure the user can act on (a config that does not check, a store URL that names no store, a
store that refuses, a run that is not there, a start that would clobber a live run) derives from
:class:`ExpectedFailure`; the ``stoa`` command prints its message as one line and exits with its
:attr:`~ExpectedFailure.exit_code` (its traceback only with ``--verbose``). Anything else is a bug
and shows its traceback. This module imports nothing, so every room can derive from it.
"""

from __future__ import annotations

__all__ = ["ExpectedFailure"]


class ExpectedFailure(Exception):
    """A failure the user can act on; its message names what failed and, where it can, the fix."""

    exit_code: int = 1
    """The ``stoa`` command's exit status: 2 when the user's input is wrong (a config, a URL, a
    file), 1 when the run, the store or the machine refused."""
