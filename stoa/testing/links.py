"""Emulated home-internet links: one asyncio TCP proxy per link in front of a loopback server.

Each :class:`Link` listens on its own ``127.0.0.1`` port and forwards to the upstream server (the
S3 server of a test or benchmark). A client that talks to the link's port sees:

* **bandwidth** per direction (``down``: server to client, ``up``: client to server), a token
  bucket shared by all of the link's connections, as a home line's capacity is;
* **latency**: half the round-trip time added to every chunk in each direction, plus uniform
  jitter, never reordering bytes; a new connection's first bytes wait one extra RTT (the TCP
  handshake; TLS is not emulated);
* **faults**: random connection resets (``resets_per_gb``) and stalls mid-transfer
  (``stalls_per_gb`` of ``stall_s`` seconds) drawn from a seeded generator, and at run time
  :meth:`Link.outage` (``"blackhole"``: bytes stop and resume when the link returns, as a real
  drop; ``"reset"``: every connection is reset and new ones are refused), :meth:`Link.stall`
  and :meth:`Link.reset_all`.

The proxy parses the HTTP/1.1 requests going up (method, target, body length) and records each
one with its time in :attr:`Link.requests`, so tests can count requests per poll and bound the
rate a fleet sends after an outage.

Bandwidth is shaped here in user space. This machine kind allows network namespaces and ``tc``
``tbf`` as root, but its kernel has no ``netem``; a namespace per link would also need every
client in that namespace (a subprocess under ``ip netns exec``), which in-process followers
cannot be. So this module shapes with its own token bucket everywhere and says so
(:data:`SHAPING`); the numbers it produces are the proxy's.

Every link binds 127.0.0.1 only and forwards only to the upstream given (which must be a
loopback address); nothing here opens a connection anywhere else.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Literal

__all__ = ["SHAPING", "HttpRequest", "Link", "LinkNet", "LinkProfile", "LinkStats", "quiet_loop_errors", "reset_connection"]

SHAPING = "proxy token bucket (user space)"
"""How bandwidth is shaped: by the proxy itself (see the module docstring for why not tc)."""

_MAX_HEAD = 64 << 10
_MAX_RECORDED = 1_000_000


@dataclass(frozen=True)
class LinkProfile:
    """One link's character. Rates in Mbit/s (10^6 bits), times in ms unless named ``_s``."""

    name: str
    """Link class, e.g. ``"dsl50"``; links of one class are reported together."""
    down_mbit: float
    """Server-to-client capacity."""
    up_mbit: float
    """Client-to-server capacity."""
    rtt_ms: float = 20.0
    """Round-trip time added (half in each direction)."""
    jitter_ms: float = 0.0
    """Uniform extra delay in [0, jitter_ms] per chunk, one direction (order is kept)."""
    resets_per_gb: float = 0.0
    """Expected connection resets per GB moved through the link (both directions)."""
    stalls_per_gb: float = 0.0
    """Expected stalls per GB moved: the connection goes silent for ``stall_s``, then continues."""
    stall_s: float = 5.0
    """Length of one random stall."""
    seed: int = 0
    """Seed of the fault generator (runs are repeatable given the same traffic)."""

    def __post_init__(self) -> None:
        if self.down_mbit <= 0 or self.up_mbit <= 0:
            raise ValueError(f"{self.name}: rates must be > 0")
        if min(self.rtt_ms, self.jitter_ms, self.resets_per_gb, self.stalls_per_gb, self.stall_s) < 0:
            raise ValueError(f"{self.name}: times and fault rates must be >= 0")


@dataclass(frozen=True)
class HttpRequest:
    """One HTTP request seen going up a link."""

    t: float
    """``time.monotonic()`` when its head was complete."""
    method: str
    target: str
    """The request target (path and query)."""
    body_bytes: int
    range: str | None = None
    """The Range header, if any (a resumed download asks from its last byte)."""


@dataclass
class LinkStats:
    """Counters of one link (read them any time; they only grow)."""

    bytes_down: int = 0
    bytes_up: int = 0
    connections: int = 0
    resets: int = 0
    """Connections this link reset (random faults, ``reset_all`` and reset-mode outages)."""
    stalls: int = 0
    refused: int = 0
    """Connections reset on arrival during a reset-mode outage."""
    upstream_errors: int = 0
    """Connections reset because the upstream server could not be reached."""


class _Bucket:
    """Token bucket as a virtual clock: bytes may leave once the clock has paid for them."""

    def __init__(self, mbit: float):
        self.set_rate(mbit)
        self._t = 0.0

    def set_rate(self, mbit: float) -> None:
        self.rate = mbit * 1e6 / 8
        self.burst_s = max(0.01, 16384 / self.rate)

    def chunk(self) -> int:
        return int(min(64 << 10, max(4 << 10, self.rate * 0.02)))

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self._t = max(self._t, now - self.burst_s) + n / self.rate
        if self._t > now:
            await asyncio.sleep(self._t - now)


class _RequestParser:
    """Splits an HTTP/1.1 request stream into requests (Content-Length bodies only)."""

    def __init__(self, sink: list[HttpRequest]):
        self.sink, self.head, self.body_left, self.broken = sink, bytearray(), 0, False

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view.nbytes and not self.broken:
            if self.body_left:
                n = min(self.body_left, view.nbytes)
                self.body_left -= n
                view = view[n:]
                continue
            start = max(0, len(self.head) - 3)
            self.head += view
            end = self.head.find(b"\r\n\r\n", start)
            if end < 0:
                self.broken = len(self.head) > _MAX_HEAD
                return
            rest = bytes(self.head[end + 4:])
            head = bytes(self.head[:end]).decode("latin-1")
            self.head = bytearray()
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            if len(parts) != 3 or "chunked" in fields.get("transfer-encoding", "").lower():
                self.broken = True  # not a request stream we can follow; stop counting this connection
                return
            try:
                self.body_left = int(fields.get("content-length", "0"))
            except ValueError:
                self.broken = True
                return
            if len(self.sink) < _MAX_RECORDED:
                self.sink.append(HttpRequest(time.monotonic(), parts[0], parts[1], self.body_left, fields.get("range")))
            view = memoryview(rest)


class _Reset(Exception):
    pass


class Link:
    """One emulated link; made by :meth:`LinkNet.add`. Control methods may be called from any thread."""

    def __init__(self, net: LinkNet, profile: LinkProfile):
        self.net, self.profile = net, profile
        self.stats = LinkStats()
        self.requests: list[HttpRequest] = []
        self.port = 0
        self._down = _Bucket(profile.down_mbit)
        self._up = _Bucket(profile.up_mbit)
        self._rng = random.Random(profile.seed)
        self._outage_until = 0.0
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._server: asyncio.base_events.Server | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: give this to the client as its S3 endpoint."""
        return f"http://127.0.0.1:{self.port}"

    def __repr__(self) -> str:
        p = self.profile
        return f"Link({p.name} {p.down_mbit:g}/{p.up_mbit:g} Mbit/s {p.rtt_ms:g} ms at :{self.port})"

    # run-time control -------------------------------------------------------------------------

    def outage(self, seconds: float, mode: Literal["blackhole", "reset"] = "blackhole") -> None:
        """Take the link down for ``seconds`` from now.

        ``blackhole``: nothing moves (connections stay open and stall; new ones are accepted
        and wait), then traffic resumes where it stopped. ``reset``: open connections are
        reset now and new ones are reset on arrival until the outage ends.
        """
        if mode not in ("blackhole", "reset"):
            raise ValueError(f"mode must be 'blackhole' or 'reset', got {mode!r}")
        self._outage_until = time.monotonic() + seconds
        self._outage_mode = mode
        if mode == "reset":
            self.reset_all()

    def stall(self, seconds: float) -> None:
        """Freeze every byte on the link for ``seconds`` (a blackhole outage)."""
        self.outage(seconds, "blackhole")

    def up(self) -> bool:
        """Whether the link is up now."""
        return time.monotonic() >= self._outage_until

    def reset_all(self) -> None:
        """Reset every open connection (the client sees ECONNRESET)."""
        self.net._call(self._reset_all)

    def set_rates(self, down_mbit: float | None = None, up_mbit: float | None = None) -> None:
        """Change the link's capacity from now on."""
        self.profile = replace(self.profile, down_mbit=down_mbit or self.profile.down_mbit,
                               up_mbit=up_mbit or self.profile.up_mbit)
        self._down.set_rate(self.profile.down_mbit)
        self._up.set_rate(self.profile.up_mbit)

    def request_kinds(self) -> dict[str, int]:
        """Requests counted by S3 operation: ``LIST`` (a bucket listing) or the HTTP method."""
        kinds: dict[str, int] = {}
        for r in list(self.requests):
            k = "LIST" if "list-type=" in r.target else r.method
            kinds[k] = kinds.get(k, 0) + 1
        return kinds

    def requests_between(self, t0: float, t1: float) -> list[HttpRequest]:
        """Requests whose head arrived in [t0, t1) (``time.monotonic()`` times)."""
        return [r for r in list(self.requests) if t0 <= r.t < t1]

    # inside the event loop ----------------------------------------------------------------------

    def _reset_all(self) -> None:
        for pair in list(self._conns):
            self._abort(pair)

    def _abort(self, pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        if pair in self._conns:
            self._conns.discard(pair)
            self.stats.resets += 1
        for w in pair:
            reset_connection(w)

    async def _gate(self) -> None:
        while (left := self._outage_until - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.5))

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if not self.up() and getattr(self, "_outage_mode", "") == "reset":
            self.stats.refused += 1
            reset_connection(c_writer)
            return
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.net.upstream)
        except OSError as e:
            self.stats.upstream_errors += 1
            self.last_upstream_error = repr(e)
            reset_connection(c_writer)
            return
        pair = (c_writer, u_writer)
        self._conns.add(pair)
        p = self.profile
        handshake = p.rtt_ms / 1000
        tasks = [asyncio.create_task(self._pump(c_reader, u_writer, self._up, pair, handshake, True)),
                 asyncio.create_task(self._pump(u_reader, c_writer, self._down, pair, 0.0, False))]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    self._abort(pair)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._conns.discard(pair)
            for w in pair:
                w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, bucket: _Bucket,
                    pair: tuple, first_delay: float, upward: bool) -> None:
        q: asyncio.Queue = asyncio.Queue(maxsize=256)
        parser = _RequestParser(self.requests) if upward else None
        one_way = self.profile.rtt_ms / 2000

        async def reader() -> None:
            last = time.monotonic() + first_delay
            while True:
                await self._gate()
                data = await src.read(bucket.chunk())
                if not data:
                    await q.put((last, None))
                    return
                if parser is not None:
                    parser.feed(data)
                await bucket.take(len(data))
                await self._gate()
                p = self.profile
                gb = len(data) / 1e9
                if p.resets_per_gb and self._rng.random() < p.resets_per_gb * gb:
                    raise _Reset()
                if p.stalls_per_gb and self._rng.random() < p.stalls_per_gb * gb:
                    self.stats.stalls += 1
                    await asyncio.sleep(p.stall_s)
                if upward:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                jitter = self._rng.uniform(0, p.jitter_ms / 1000) if p.jitter_ms else 0.0
                last = max(last, time.monotonic() + one_way + jitter)
                await q.put((last, data))

        async def writer() -> None:
            while True:
                at, data = await q.get()
                if (wait := at - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                await self._gate()
                if data is None:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()

        r, w = asyncio.create_task(reader()), asyncio.create_task(writer())
        try:
            await asyncio.gather(r, w)
        except (ConnectionError, _Reset):
            raise _Reset() from None
        finally:
            r.cancel()
            w.cancel()


def reset_connection(writer: asyncio.StreamWriter) -> None:
    """Close so that the peer sees a reset (SO_LINGER 0), not an orderly end."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


def quiet_loop_errors(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    # Resets and cancellations are this module's business, not noise for the test log.
    if not isinstance(context.get("exception"), (ConnectionError, asyncio.CancelledError, _Reset)):
        loop.default_exception_handler(context)


@dataclass
class LinkNet:
    """A set of links in front of one loopback server, served by one event-loop thread.

    Use as a context manager (or call :meth:`close`)::

        with LinkNet(("127.0.0.1", s3_port)) as net:
            dsl = net.add(LinkProfile("dsl50", 50, 10, rtt_ms=40))
            store = S3Store(bucket, endpoint_url=dsl.endpoint, ...)
    """

    upstream: tuple[str, int]
    links: list[Link] = field(default_factory=list)

    def __post_init__(self) -> None:
        host = self.upstream[0]
        if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            raise ValueError(f"upstream {host} is not a loopback address; links only front local test servers")
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(quiet_loop_errors)
        self._thread = threading.Thread(target=self._loop.run_forever, name="stoa-links", daemon=True)
        self._thread.start()

    def _call(self, fn, *args) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    def _run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def add(self, profile: LinkProfile) -> Link:
        """Open a link (a proxy on a free 127.0.0.1 port) with this profile."""
        link = Link(self, profile)

        async def start() -> None:
            link._server = await asyncio.start_server(link._handle, "127.0.0.1", 0, backlog=512)
            link.port = link._server.sockets[0].getsockname()[1]

        self._run(start())
        self.links.append(link)
        return link

    def close(self) -> None:
        """Close every link and stop the loop thread."""
        async def stop() -> None:
            for link in self.links:
                if link._server is not None:
                    link._server.close()
                link._reset_all()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            try:
                self._run(stop(), timeout=10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> LinkNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m stoa.testing.links``: serve links in their own process (a benchmark's fleet then
    shares no interpreter lock with them). Writes ``{"ports": [...]}`` to --ready once listening;
    on SIGTERM writes each link's counters to --stats and exits."""
    import argparse
    import json
    import signal

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the loopback server")
    ap.add_argument("--links", required=True, help="JSON file: a list of LinkProfile fields")
    ap.add_argument("--ready", required=True, help="file to write the ports to")
    ap.add_argument("--stats", required=True, help="file to write the counters to at exit")
    args = ap.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    with open(args.links) as fh:
        profiles = [LinkProfile(**p) for p in json.load(fh)]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    with LinkNet((host, int(port))) as net:
        links = [net.add(p) for p in profiles]
        tmp = args.ready + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"ports": [lk.port for lk in links]}, fh)
        os.replace(tmp, args.ready)
        while not stop.wait(0.5):
            pass
        out = [{"name": lk.profile.name, **vars(lk.stats), "requests": len(lk.requests),
                "request_kinds": lk.request_kinds(), "request_times": [r.t for r in lk.requests]} for lk in links]
    with open(args.stats, "w") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
