"""Scoring untrusted text in a locked-down subprocess.

The trainer replays every worker's turns through its own copy of the task, so a scorer runs on
text a stranger wrote. Some third-party scorers parse answers with ``eval`` or sympy; a scorer
that hangs on ``9**9**9``, exhausts memory or crashes on deep nesting must not take the trainer
(or a worker) with it. :class:`Sandbox` runs such scorers in one persistent child process:

- **Limits, per call**: CPU seconds (``RLIMIT_CPU``, raised by the budget before each call) and a
  wall-clock timeout in the parent; on either the child is killed and restarted on next use.
  Address space (``RLIMIT_AS``) is capped at what the child had after its imports plus
  ``memory_mb``.
- **No writes, no processes, no network**: after its imports the child drops root (to
  ``nobody``, where it runs as root), sets ``RLIMIT_FSIZE = 0``, ``RLIMIT_NPROC = 0`` and
  ``RLIMIT_CORE = 0``, moves into an empty read-only directory, and installs an audit hook
  (PEP 578) that refuses opening files for writing, creating/removing/renaming paths, spawning or
  forking processes, sockets and ``ctypes``.
- **One-way trust**: the parent pickles requests to the child; the child answers with one JSON
  line (a float or an error name), which the parent validates. Nothing the child says is
  unpickled or executed. The child inherits no environment variables but ``PATH`` and the locale
  (no credentials), and its stray output goes to ``/dev/null``, not to the reply channel.

The sandbox is the second wall: a task should also close code-running paths at the source (see
``stoa.envs.rgym``, which replaces the scorers' ``eval`` and ``parse_expr``), because code that
does run in the child could still forge its answer.

An outcome is ``(score, error)``: ``error`` is ``""`` on success, else one of ``"timeout"`` (the
CPU or wall limit), ``"crashed"`` (the child died otherwise: a segfault, the memory cap inside C
code), ``"memory"``, ``"recursion"`` or ``"error:<ExceptionName>"``. ``"timeout"`` and
``"crashed"`` depend on the machine and its load, not only on the text.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Sandbox", "SandboxLimits", "shared_sandbox", "INDETERMINATE"]

INDETERMINATE = ("timeout", "crashed")
"""Errors that depend on the machine and its load rather than on the text alone."""

_HEADER = struct.Struct("<I")
_MAX_REPLY = 1 << 16


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one scoring call and of the child process."""

    cpu_seconds: float = 5.0
    """CPU time one call may use (``RLIMIT_CPU``; the child is killed past it)."""
    wall_seconds: float = 10.0
    """Wall-clock time the parent waits for one answer before killing the child."""
    memory_mb: int = 1024
    """Address space the child may add after its imports (``RLIMIT_AS``)."""
    start_seconds: float = 120.0
    """Time the child may take to start (imports) before the start counts as failed."""


class Sandbox:
    """A persistent scoring process: ``call(factory, args, answer, entry)`` runs
    ``factory(*args)(answer, entry)`` in the child and returns ``(score, error)``.

    Args:
        setup: ``"module:function"`` names run in the child, in order, before it locks down
            (imports, patches); everything a scorer needs must be imported by then.
        limits: :class:`SandboxLimits`.

    ``factory`` is a ``"module:function"`` name; ``factory(*args)`` is built once per child and
    cached (``args`` must pickle). Thread-safe: calls are serialized.
    """

    def __init__(self, setup: tuple[str, ...] = (), limits: SandboxLimits = SandboxLimits()) -> None:
        self.setup, self.limits = tuple(setup), limits
        self._proc: subprocess.Popen | None = None
        self._owner = 0
        self._built: set[tuple] = set()
        self._lock = threading.Lock()
        self._dir: tempfile.TemporaryDirectory | None = None
        self.hardening: tuple[str, ...] = ()
        """What the running child managed to apply (``"rlimits"``, ``"setuid"``, ``"audit"``, ...)."""
        self.restarts = 0

    # -- parent side -----------------------------------------------------------------------------
    def call(self, factory: str, args: tuple, answer: str | None, entry: Any) -> tuple[float, str]:
        """Score ``answer`` against ``entry`` in the child. Never raises for what the text does.

        Raises:
            RuntimeError: the child could not start (its setup failed: a missing package, say).
        """
        with self._lock:
            proc = self._ensure()
            msg = pickle.dumps(("score", factory, args, answer, entry, self.limits.cpu_seconds))
            try:
                proc.stdin.write(_HEADER.pack(len(msg)) + msg)
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._kill()
                return 0.0, "crashed"
            first = (factory, args) not in self._built  # building the scorer may take a while
            reply = self._read_line(proc, self.limits.start_seconds if first else self.limits.wall_seconds)
            if not reply:  # None: no answer in time; b"": the child is gone
                try:
                    code = proc.wait(timeout=1.0) if reply == b"" else None
                except subprocess.TimeoutExpired:
                    code = None
                self._kill()
                return 0.0, "crashed" if code is not None and code != -signal.SIGXCPU else "timeout"
            self._built.add((factory, args))
            return _parse_reply(reply)

    def close(self) -> None:
        """Stop the child (a later call starts a new one)."""
        with self._lock:
            self._kill()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:
            pass

    def _ensure(self) -> subprocess.Popen:
        if self._proc is not None and self._owner == os.getpid() and self._proc.poll() is None:
            return self._proc
        if self._owner != os.getpid():
            self._proc = None  # a forked copy: the child belongs to the parent process
        else:
            self._kill()
        if self._dir is None or self._owner != os.getpid():
            self._dir = tempfile.TemporaryDirectory(prefix="stoa-sandbox-")
            os.chmod(self._dir.name, 0o555)
        env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in os.environ}  # no credentials
        env.update(PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONDONTWRITEBYTECODE="1",
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
        proc = subprocess.Popen([sys.executable, "-u", "-m", "stoa.envs.sandbox"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=self._dir.name,
                                start_new_session=True)
        self._proc, self._owner, self._built = proc, os.getpid(), set()
        hello = pickle.dumps({"setup": self.setup, "memory_mb": self.limits.memory_mb, "workdir": self._dir.name})
        try:
            proc.stdin.write(_HEADER.pack(len(hello)) + hello)
            proc.stdin.flush()
        except OSError:
            self._kill()
            raise RuntimeError("the scoring sandbox exited at once") from None
        reply = self._read_line(proc, self.limits.start_seconds)
        try:
            ready = json.loads(reply) if reply else None
        except ValueError:
            ready = None
        if not isinstance(ready, dict) or ready.get("ready") is not True:
            why = ready.get("error") if isinstance(ready, dict) else "no answer"
            self._kill()
            raise RuntimeError(f"the scoring sandbox did not start: {str(why)[:200]}")
        self.hardening = tuple(str(h) for h in ready.get("hardening", []))[:16]
        return proc

    def _read_line(self, proc: subprocess.Popen, timeout: float) -> bytes | None:
        """One reply line within ``timeout`` seconds; ``b""`` at EOF; None on a timeout or an
        oversized or doubled reply."""
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or len(buf) > _MAX_REPLY:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return b""
            buf += chunk
        line, _, rest = buf.partition(b"\n")
        return None if rest else line  # the child answers exactly one line per request

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or self._owner != os.getpid():
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.restarts += 1


def _parse_reply(line: bytes) -> tuple[float, str]:
    import math

    try:
        data = json.loads(line)
    except ValueError:
        return 0.0, "crashed"
    if not isinstance(data, dict):
        return 0.0, "crashed"
    err = data.get("error")
    if isinstance(err, str) and err:
        return 0.0, err[:120]
    v = data.get("value")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return 0.0, "error:non-finite score"
    return float(v), ""


_SHARED: dict[tuple, Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(setup: tuple[str, ...], limits: SandboxLimits = SandboxLimits()) -> Sandbox:
    """The process's one sandbox for this ``setup`` and ``limits`` (environments share it)."""
    key = (tuple(setup), limits)
    with _SHARED_LOCK:
        box = _SHARED.get(key)
        if box is None:
            box = _SHARED[key] = Sandbox(setup, limits)
        return box


# -- child side ------------------------------------------------------------------------------------
_BLOCKED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
    "subprocess.Popen", "pty.spawn", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
    "os.link", "os.symlink", "os.truncate", "os.putenv", "os.unsetenv", "os.chdir", "os.chroot", "os.setxattr",
    "os.removexattr", "os.utime", "os.startfile", "shutil.copyfile", "shutil.copytree", "shutil.move",
    "shutil.rmtree", "shutil.make_archive", "shutil.chown", "socket.__new__", "socket.connect", "socket.bind",
    "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
    "ctypes.addressof", "ctypes.string_at", "ctypes.wstring_at", "ctypes.PyObj_FromPtr", "urllib.Request",
    "webbrowser.open", "sqlite3.connect", "os.setuid", "os.setgid", "signal.pthread_kill",
})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit(event: str, args: tuple) -> None:
    if event in _BLOCKED_EVENTS or event.startswith(("ctypes.", "socket.", "subprocess.", "_posixsubprocess")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and len(args) >= 3:
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS):
            raise PermissionError("sandbox: opening files for writing is not allowed")
    if event == "import" and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes", "socket", "_socket",
                                                                     "subprocess", "_posixsubprocess", "multiprocessing"):
        raise PermissionError(f"sandbox: importing {args[0]} is not allowed")


def _world_readable(path: str) -> bool:
    """Whether another user can list ``path`` and reach it (every folder on the way searchable)."""
    import stat

    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        while True:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
            if os.path.dirname(path) == path:
                return True
            path = os.path.dirname(path)
    except OSError:
        return False


def _lockdown(workdir: str, memory_mb: int) -> list[str]:
    import resource

    done = []
    os.chdir(workdir)
    done.append("empty read-only cwd")
    if os.getuid() == 0 and _world_readable(os.path.dirname(os.__file__)):  # else lazy imports would fail
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            done.append("setuid nobody")
        except OSError:
            pass
    for lim, value in ((resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_NPROC, 0), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(lim, (value, value))
        except (ValueError, OSError):
            continue
    done.append("rlimits fsize/nproc/core 0")
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[0])
        cap = pages * os.sysconf("SC_PAGE_SIZE") + memory_mb * (1 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        done.append(f"address space {cap >> 20} MiB")
    except (OSError, ValueError):
        pass
    sys.addaudithook(_audit)
    done.append("audit hook")
    return done


def _read_msg(stream: Any) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    return pickle.loads(stream.read(n))  # from the parent, which the child trusts


def _child_main() -> None:
    import resource

    out = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # stray prints (or a scorer's chatter) cannot reach the protocol stream
    sys.stdout = open(os.devnull, "w")
    inp = sys.stdin.buffer

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj).encode() + b"\n")

    hello = _read_msg(inp)
    try:
        for name in hello["setup"]:
            mod, _, fn = name.partition(":")
            getattr(importlib.import_module(mod), fn)()
        hardening = _lockdown(hello["workdir"], int(hello["memory_mb"]))
    except Exception as e:
        reply({"ready": False, "error": f"{type(e).__name__}: {e}"[:200]})
        return
    reply({"ready": True, "hardening": hardening})
    built: dict[bytes, Any] = {}
    while True:
        msg = _read_msg(inp)
        if msg is None:
            return
        _, factory, args, answer, entry, cpu = msg
        try:
            key = pickle.dumps((factory, args))
            fn = built.get(key)
            if fn is None:
                mod, _, attr = factory.partition(":")
                fn = built[key] = getattr(importlib.import_module(mod), attr)(*args)
            used = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(used.ru_utime + used.ru_stime + cpu) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
            value = fn(answer, entry)
            result = {"value": float(value)}
        except MemoryError:
            result = {"error": "memory"}
        except RecursionError:
            result = {"error": "recursion"}
        except BaseException as e:  # noqa: BLE001 - anything a scorer raises is its outcome
            result = {"error": f"error:{type(e).__name__}"}
        try:
            reply(result)
        except (TypeError, ValueError):
            reply({"error": "error:unencodable score"})


if __name__ == "__main__":
    _child_main()
