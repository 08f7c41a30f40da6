"""Store faults: an HTTP proxy in front of a loopback S3 server that fails requests on a seeded schedule.

:class:`FaultProxy` listens on its own ``127.0.0.1`` port and forwards S3 requests to the
upstream server one at a time per connection (HTTP/1.1 keep-alive). Each request may be hit by
one fault, drawn from a seeded generator at the rates in force (:class:`FaultRates`, changed at
run time with :meth:`FaultProxy.set_rates`), or forced with :meth:`FaultProxy.inject`:

* ``error-500`` / ``slowdown-503``: the proxy answers ``500 InternalError`` or ``503 SlowDown``
  itself; the server never sees the request;
* ``timeout``: the request reaches the server (a write is applied) but its answer is held for
  ``hold_s`` (longer than the client's read timeout), then the connection is closed;
* ``reset``: the connection is reset mid-body: a request with a body is cut after half of it
  (the server never completes it); otherwise the answer is cut after half of its body (or before
  its head, when it has no body: the server did the work, the client never hears);
* ``slow``: the answer is delayed ``slow_s`` seconds;
* ``multipart-stall``: an ``UploadPart`` request stops moving after half of its body for
  ``hold_s`` seconds, then continues (the client may have given up and retried by then).

Every fault is counted in :attr:`FaultProxy.injected` and recorded with its time, method and
target in :attr:`FaultProxy.events`. The proxy binds 127.0.0.1 only and forwards only to a
loopback upstream.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stoa.testing.links import quiet_loop_errors, reset_connection

__all__ = ["KINDS", "FaultProxy", "FaultRates", "Request"]

KINDS = ("error-500", "slowdown-503", "timeout", "reset", "slow", "multipart-stall")

_MAX_HEAD = 64 << 10
_CHUNK = 64 << 10


@dataclass(frozen=True)
class FaultRates:
    """Probability per request of each fault (at most one per request; they must sum to <= 1)."""

    error_500: float = 0.0
    slowdown_503: float = 0.0
    timeout: float = 0.0
    reset: float = 0.0
    slow: float = 0.0
    multipart_stall: float = 0.0
    """Per ``UploadPart`` request (other requests are never stalled this way)."""
    hold_s: float = 5.0
    """How long a ``timeout`` holds the answer and a ``multipart-stall`` holds the body."""
    slow_s: float = 1.0
    """How long a ``slow`` answer is delayed."""

    def __post_init__(self) -> None:
        rates = [self.error_500, self.slowdown_503, self.timeout, self.reset, self.slow]
        if min(rates + [self.multipart_stall, self.hold_s, self.slow_s]) < 0 or sum(rates) > 1 \
                or self.multipart_stall > 1:
            raise ValueError(f"fault rates must be >= 0 and sum to <= 1: {self}")

    @classmethod
    def only(cls, kind: str, rate: float, **times: float) -> FaultRates:
        """Rates with one kind (a name of :data:`KINDS`) at ``rate``."""
        if kind not in KINDS:
            raise ValueError(f"unknown store fault {kind!r} (known: {', '.join(KINDS)})")
        name = {"error-500": "error_500", "slowdown-503": "slowdown_503"}.get(kind, kind.replace("-", "_"))
        return cls(**{name: rate}, **times)


@dataclass(frozen=True)
class Request:
    """The head of one request going up."""

    method: str
    target: str
    headers: dict[str, str]

    @property
    def is_upload_part(self) -> bool:
        return self.method == "PUT" and "partNumber=" in self.target and "uploadId=" in self.target


@dataclass
class _Forced:
    kind: str
    when: Callable[[Request], bool]
    count: int


class _Cut(Exception):
    """The connection is to be reset now."""


@dataclass
class FaultProxy:
    """A fault-injecting proxy to ``upstream`` (a loopback ``(host, port)``); a context manager.

    ``endpoint`` is the URL to give S3 clients. Control methods may be called from any thread.
    """

    upstream: tuple[str, int]
    seed: int = 0
    rates: FaultRates = field(default_factory=FaultRates)
    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    events: list[dict] = field(default_factory=list)
    requests: int = 0

    def __post_init__(self) -> None:
        if not ipaddress.ip_address(socket.gethostbyname(self.upstream[0])).is_loopback:
            raise ValueError(f"upstream {self.upstream[0]} is not a loopback address")
        self._rng = random.Random(self.seed)
        self._forced: list[_Forced] = []
        self._lock = threading.Lock()
        self._conns: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(quiet_loop_errors)
        self._thread = threading.Thread(target=self._loop.run_forever, name="stoa-storefaults", daemon=True)
        self._thread.start()

        async def start() -> int:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=512)
            return self._server.sockets[0].getsockname()[1]

        self.port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(30)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_rates(self, rates: FaultRates) -> None:
        """Draw faults at these rates from now on (``FaultRates()``: none)."""
        self.rates = rates

    def inject(self, kind: str, when: Callable[[Request], bool] = lambda r: True, count: int = 1) -> None:
        """Hit the next ``count`` requests that ``when`` accepts with ``kind``, whatever the rates."""
        if kind not in KINDS:
            raise ValueError(f"unknown store fault {kind!r}")
        with self._lock:
            self._forced.append(_Forced(kind, when, count))

    def _draw(self, req: Request) -> str | None:
        with self._lock:
            self.requests += 1
            for f in self._forced:
                if f.count > 0 and f.when(req):
                    f.count -= 1
                    kind = f.kind
                    break
            else:
                r = self.rates
                kind = None
                if req.is_upload_part and r.multipart_stall and self._rng.random() < r.multipart_stall:
                    kind = "multipart-stall"
                else:
                    x, acc = self._rng.random(), 0.0
                    for name, p in (("error-500", r.error_500), ("slowdown-503", r.slowdown_503),
                                    ("timeout", r.timeout), ("reset", r.reset), ("slow", r.slow)):
                        acc += p
                        if x < acc:
                            kind = name
                            break
            if kind is not None:
                self.injected[kind] += 1
                self.events.append({"time": time.time(), "kind": kind, "method": req.method,
                                    "target": req.target[:200]})
            return kind

    # inside the event loop ----------------------------------------------------------------------

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self._conns.add(c_writer)
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _read_head(c_reader)
                if head is None:
                    return
                req = _parse_request(head)
                if up is None or up[1].is_closing():
                    up = await asyncio.open_connection(*self.upstream)
                keep = await self._one(req, head, c_reader, c_writer, up)
                if not keep:
                    return
        except (_Cut, ConnectionError, asyncio.IncompleteReadError, ValueError):
            reset_connection(c_writer)
        finally:
            self._conns.discard(c_writer)
            if up is not None:
                up[1].close()
            c_writer.close()

    async def _one(self, req: Request, head: bytes, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter,
                   up: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bool:
        """Serve one request; returns whether the client connection stays open."""
        kind = self._draw(req)
        length = int(req.headers.get("content-length", "0") or 0)
        if "chunked" in req.headers.get("transfer-encoding", "").lower():
            raise ValueError("chunked request bodies are not followed")
        if req.headers.get("expect", "").lower() == "100-continue":
            c_writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the proxy asks for the body itself
            await c_writer.drain()
            head = _drop_header(head, "expect")
        if kind in ("error-500", "slowdown-503"):
            await _skip(c_reader, length)
            code, reason, err = ((500, "Internal Server Error", "InternalError") if kind == "error-500"
                                 else (503, "Slow Down", "SlowDown"))
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{err}</Code>'
                    f"<Message>injected by stoa.testing.storefaults</Message></Error>").encode()
            c_writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/xml\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await c_writer.drain()
            return True
        u_reader, u_writer = up
        u_writer.write(head)
        if kind in ("reset", "multipart-stall") and length > 1:
            await _pipe(c_reader, u_writer, length // 2)
            if kind == "reset":
                reset_connection(u_writer)
                raise _Cut()
            await asyncio.sleep(self.rates.hold_s)
            await _pipe(c_reader, u_writer, length - length // 2)
        else:
            await _pipe(c_reader, u_writer, length)
        r_head = await _read_head(u_reader)
        if r_head is None:
            raise ConnectionError("upstream closed")
        status = int(r_head.split(b" ", 2)[1])
        fields = _fields(r_head)
        no_body = req.method == "HEAD" or status in (204, 304) or 100 <= status < 200
        if kind == "timeout":
            await _drain_body(u_reader, fields, no_body)  # the server did the work; the client never hears
            await asyncio.sleep(self.rates.hold_s)
            raise _Cut()
        if kind == "slow":
            await asyncio.sleep(self.rates.slow_s)
        if no_body and kind == "reset":
            raise _Cut()  # the server did the work; the client sees the connection reset
        c_writer.write(r_head)
        if no_body:
            await c_writer.drain()
            return fields.get("connection", "").lower() != "close"
        if "chunked" in fields.get("transfer-encoding", "").lower():
            if kind == "reset":
                raise _Cut()
            await _relay_chunked(u_reader, c_writer)
            return fields.get("connection", "").lower() != "close"
        if "content-length" in fields:
            n = int(fields["content-length"])
            if kind == "reset":
                await _pipe(u_reader, c_writer, n // 2)
                await c_writer.drain()
                raise _Cut()
            await _pipe(u_reader, c_writer, n)
            await c_writer.drain()
            return fields.get("connection", "").lower() != "close"
        while data := await u_reader.read(_CHUNK):  # the body runs to the end of the connection
            c_writer.write(data)
            await c_writer.drain()
        return False

    def close(self) -> None:
        """Stop listening, reset open connections and stop the loop thread."""
        async def stop() -> None:
            self._server.close()
            for w in list(self._conns):
                reset_connection(w)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionError("connection closed mid-head") from None
        return None
    except asyncio.LimitOverrunError:
        raise ValueError("request head too large") from None


def _fields(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}


def _parse_request(head: bytes) -> Request:
    if len(head) > _MAX_HEAD:
        raise ValueError("request head too large")
    parts = head.decode("latin-1").split("\r\n", 1)[0].split(" ")
    if len(parts) != 3:
        raise ValueError("not an HTTP/1.1 request")
    return Request(parts[0], parts[1], _fields(head))


def _drop_header(head: bytes, name: str) -> bytes:
    lines = head.split(b"\r\n")
    keep = [ln for ln in lines[1:] if ln.split(b":", 1)[0].strip().lower() != name.encode()]
    return b"\r\n".join(lines[:1] + keep)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        data = await src.read(min(_CHUNK, n))
        if not data:
            raise ConnectionError("closed mid-body")
        n -= len(data)
        dst.write(data)
        await dst.drain()


async def _skip(src: asyncio.StreamReader, n: int) -> None:
    while n > 0:
        data = await src.read(min(_CHUNK, n))
        if not data:
            raise ConnectionError("closed mid-body")
        n -= len(data)


async def _relay_chunked(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    while True:
        line = await src.readuntil(b"\r\n")
        dst.write(line)
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (trailer := await src.readuntil(b"\r\n")) != b"\r\n":
                dst.write(trailer)
            dst.write(b"\r\n")
            await dst.drain()
            return
        dst.write(await src.readexactly(size + 2))
        await dst.drain()


async def _drain_body(src: asyncio.StreamReader, fields: dict[str, str], no_body: bool) -> None:
    if no_body:
        return
    if "chunked" in fields.get("transfer-encoding", "").lower():
        while True:
            size = int((await src.readuntil(b"\r\n")).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while await src.readuntil(b"\r\n") != b"\r\n":
                    pass
                return
            await src.readexactly(size + 2)
    elif "content-length" in fields:
        await src.readexactly(int(fields["content-length"]))
