"""How long a fleet process outlives a stop request, or the launcher that started it.

A stop request (SIGTERM, SIGINT, SIGHUP) makes the trainer and a worker stop at their next safe
point (the trainer after its current step, with a checkpoint; a worker after its current upload).
Orchestrators (systemd, Docker, Kubernetes, CI cancellations) SIGKILL a process some seconds after
their SIGTERM, so that wait is bounded: a process still running :data:`STOP_BOUND_S` seconds after
the request exits at once with :data:`EXIT_ABANDONED`. What it was doing is abandoned, never half
kept: a trainer's step in progress (and any step since its last checkpoint) is redone after
``--resume``, which re-delivers exactly the batches that checkpoint had not trained on; a worker's
batch whose upload had not committed is invisible to the trainer and is generated again under the
same number by the worker's next session.

``stoa train`` starts its trainer and workers bound to it (:func:`child_env`, then
:func:`install` in the child): each watches a pipe whose other end only the launcher holds, and on
Linux also asks the kernel for a SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``). Either
way a launcher that dies, even by SIGKILL, takes its fleet with it within the bound.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

__all__ = ["EXIT_ABANDONED", "STOP_BOUND_S", "child_env", "install", "stop_requested"]

STOP_BOUND_S = 20.0
"""Seconds from a stop request (or the launcher's death) to the process's exit, at most."""

EXIT_ABANDONED = 143
"""Exit status of a process that did not reach a safe point within :data:`STOP_BOUND_S` (128 + SIGTERM)."""

_PIPE_VAR, _PARENT_VAR = "STOA_PARENT_PIPE", "STOA_PARENT_PID"
log = logging.getLogger("stoa.lifetime")
_state = {"installed": False, "armed": False}
_lock = threading.Lock()


def child_env(read_fd: int) -> dict[str, str]:
    """Environment entries that bind a child to this process: ``read_fd`` is the read end of a pipe
    whose write end only this process holds (pass it with ``Popen(pass_fds=[read_fd])``)."""
    return {_PIPE_VAR: str(read_fd), _PARENT_VAR: str(os.getpid())}


def install() -> None:
    """In a trainer or worker process: make stop requests bounded (:func:`stop_requested` then
    arms the exit) and, when started by a launcher (:func:`child_env`), stop when it dies."""
    _state["installed"] = True
    fd, parent = os.environ.pop(_PIPE_VAR, None), os.environ.pop(_PARENT_VAR, None)
    if fd is None or parent is None:
        return
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # the pipe below still works
    threading.Thread(target=_watch_parent, args=(int(fd), int(parent)), name="stoa-parent", daemon=True).start()


def _watch_parent(fd: int, parent: int) -> None:
    if os.getppid() == parent:  # else it died before we looked: act at once
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
    log.warning("the launcher is gone: stopping")
    stop_requested()
    os.kill(os.getpid(), signal.SIGTERM)  # the process's own stop handler, from its main thread


def stop_requested() -> None:
    """A stop was requested: exit with :data:`EXIT_ABANDONED` if still running :data:`STOP_BOUND_S`
    seconds from now (only in a process that called :func:`install`; idempotent)."""
    with _lock:
        if not _state["installed"] or _state["armed"]:
            return
        _state["armed"] = True
    timer = threading.Timer(STOP_BOUND_S, _abandon)
    timer.daemon = True
    timer.start()


def _abandon() -> None:
    log.warning("no safe point within %.0f s of the stop request: exiting now, abandoning the work in "
                "progress (redone after a restart)", STOP_BOUND_S)
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(EXIT_ABANDONED)
