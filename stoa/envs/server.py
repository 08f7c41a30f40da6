"""A retrieval server speaking the Search-R1 API, so many workers can share one big index.

``POST /retrieve`` with JSON ``{"queries": [str, ...], "topk": int (optional), "return_scores":
bool (optional)}`` answers ``{"result": [[item, ...] per query]}``. Each item is the document
``{"id", "contents", "title", "text"}`` (``contents`` is Search-R1's ``"<title>"\\n<text>``), wrapped
as ``{"document": doc, "score": float}`` when ``return_scores`` is true. ``GET /health`` answers
``{"status": "ok", "num_docs": n}``. Bad requests get HTTP 400/404/411/413 with ``{"error": message}``.

Bounds (:class:`ServerLimits`; a request beyond one is refused, never truncated silently): the
request head and body size, queries per request, query length, ``topk``, ``queries x topk``, the
size of the answer (checked while it is built, so it is never held whole beyond the cap), open
connections, concurrent searches, and the time to receive one request: a client that sends
nothing, or trickles bytes, is disconnected when ``request_timeout`` runs out, whatever it sends.

The connection cap follows the process's descriptor limit: the effective cap
(``RetrieverServer.max_connections``) is ``max_connections`` lowered to the soft
``RLIMIT_NOFILE`` less the descriptors open when the server is made, less a headroom of
:data:`FD_HEADROOM` for the index, logs and the connection being accepted. Otherwise, under a
limit below the cap (macOS's default is 256), the attacker's half-sent requests would use up the
descriptors before the cap is reached: ``accept`` then fails and nobody is evicted, and a new
honest client waits in the listen queue until it times out. For the same reason connections are
accepted one at a time, each making room before the next (asyncio's own server accepts the whole
listen queue at once), so the server never holds more than the cap plus one.

Connections held open cannot lock honest clients out. The server is one asyncio loop (HTTP/1.1
parsed by ``h11``), so an open connection costs a few kilobytes, not a thread. At the
``max_connections`` cap a new connection *evicts* the open connection that has waited longest
for the rest of a request (or idled longest between keep-alive requests); only when every open
connection is inside a search is the newcomer answered 503. An honest request arrives whole within
a round trip, so it is never the oldest waiting one; an attacker holding half-sent requests loses
one of them for every connection anyone opens, however many it keeps opening.

The answer is bounded relative to the request: at most ``max_amplification`` (256) times the
request body's bytes. Documents are cut (to ``max_doc_chars``, and to an equal share of that
budget; a cut text ends with ``…``) so that honest requests always get an answer; only a request
whose answer does not fit even then is refused (413). So no request gets back more than 256
bytes per byte it sent.

Start it with ``stoa retriever serve --index DIR`` (or :func:`make_server` in-process); query it
with :class:`stoa.envs.retrieval.HTTPRetriever` or any Search-R1 client.
"""

from __future__ import annotations

import asyncio
import errno
import http
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import h11

from stoa.envs.retrieval import Hit, Retriever

__all__ = ["FD_HEADROOM", "RetrieverServer", "ServerLimits", "connection_cap", "make_server", "serve"]

log = logging.getLogger(__name__)

FD_HEADROOM = 32
"""Descriptors kept free beyond the open connections: the index's files, logs, the event loop's
own, and the newcomer accepted before the connection it evicts is closed."""


@dataclass(frozen=True)
class ServerLimits:
    """Request bounds; a request beyond them is refused, never truncated silently."""

    max_body_bytes: int = 1 << 20
    """Largest request body."""
    max_head_bytes: int = 16 << 10
    """Largest request line plus headers (431/400 beyond it)."""
    max_queries: int = 1024
    """Most queries in one request."""
    max_topk: int = 100
    """Largest ``topk``."""
    max_query_chars: int = 4096
    """Longest query."""
    max_results: int = 4096
    """Most documents in one answer (``len(queries) * topk``)."""
    max_response_bytes: int = 16 << 20
    """Largest answer body; a bigger one is refused with 413 (ask for fewer queries or a smaller topk)."""
    max_doc_chars: int = 4096
    """Longest document text (and title) in an answer; a longer one is cut and ends with ``…``."""
    max_amplification: int = 256
    """An answer body is at most this many times the request body: documents are cut (each to an
    equal share of that budget, ending with ``…``) until it fits, else the request is refused with
    413. A one-query top-3 request (~80 bytes) still gets documents of ~3,000 characters each."""
    default_topk: int = 3
    """``topk`` when the request omits it (Search-R1's default)."""
    max_concurrent: int = 4
    """Requests searched at once; each holds a float32 score per document (64 MB for 16M)."""
    max_connections: int = 256
    """Open connections at once, lowered to what the process's descriptor limit leaves
    (:func:`connection_cap`). At the cap a newcomer evicts the connection that has waited
    longest for a request; it is answered 503 only when every open connection is searching.
    Memory bound: about ``max_connections x (max_head_bytes + max_body_bytes)`` of buffered input."""
    request_timeout: float = 30.0
    """Seconds to receive one whole request (and to send its answer), idle keep-alive included."""

    def __post_init__(self) -> None:
        ints = (self.max_body_bytes, self.max_head_bytes, self.max_queries, self.max_topk, self.max_query_chars,
                self.max_results, self.max_response_bytes, self.max_concurrent, self.max_connections,
                self.max_doc_chars, self.max_amplification)
        if min(ints) < 1:
            raise ValueError("every server limit must be >= 1")
        if not 1 <= self.default_topk <= self.max_topk:
            raise ValueError("default_topk must lie in [1, max_topk]")
        if not (math.isfinite(self.request_timeout) and self.request_timeout > 0):
            raise ValueError("request_timeout must be a positive number of seconds")


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: max(0, chars - 1)] + "…"


def _doc(h: Hit, chars: int) -> dict[str, Any]:
    title, text = _cut(h.title, chars), _cut(h.text, chars)
    return {"id": _cut(h.id, 256), "contents": f'"{title}"\n{text}', "title": title, "text": text}


_BUSY = json.dumps({"error": "server busy: every connection is searching, retry later"}).encode()
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


class _Refusal(Exception):
    """A request answered with an error status (and, with ``close``, the connection closed)."""

    def __init__(self, code: int, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.close = code, message, close


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    waiting_since: float
    task: asyncio.Task | None = None
    writer: asyncio.StreamWriter | None = None
    searching: bool = False

    def close(self) -> None:
        """Drop the connection at once (its task is cancelled; its socket closes)."""
        if self.writer is not None:
            self.writer.transport.abort()
        else:
            self.sock.close()
        if self.task is not None:
            self.task.cancel()


def _answer(hits: list[list[Hit]], scores: bool, budget: int, max_chars: int) -> bytes | None:
    """The JSON answer within ``budget`` bytes: each document cut to an equal share of it (cut
    further until it fits, a few times); None if even that does not fit."""
    n = max(1, sum(len(h) for h in hits))
    chars = min(max_chars, max(16, (budget - 16 - 96 * n) // (2 * n)))  # ~96 bytes of keys, id, score per item
    for _ in range(8):
        parts, size = [], 16
        for row in hits:
            items = [{"document": _doc(h, chars), "score": h.score} if scores else _doc(h, chars) for h in row]
            part = json.dumps(items, ensure_ascii=False).encode()
            size += len(part) + 2
            if size > budget:
                break
            parts.append(part)
        else:
            return b'{"result": [' + b", ".join(parts) + b"]}"
        chars = chars * 2 // 3
        if chars < 16:
            return None
    return None



def _nofile() -> int | None:
    """The soft ``RLIMIT_NOFILE``, or None where there is none (Windows) or it is unlimited."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else soft


def _open_fds() -> int | None:
    """How many descriptors this process has open, or None where that cannot be read."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder)) - 1  # less the one listdir used
        except OSError:
            continue
    return None


def connection_cap(requested: int, headroom: int = FD_HEADROOM) -> int:
    """``requested`` open connections, lowered to what the soft ``RLIMIT_NOFILE`` leaves: the limit
    less the descriptors open now, less ``headroom`` (at least 1). Unchanged where there is no such
    limit (Windows) or it is unlimited."""
    soft = _nofile()
    if soft is None:
        return requested
    used = _open_fds()
    if used is None:  # count the low descriptors in use instead
        used = 0
        for fd in range(min(soft, 4096)):
            try:
                os.fstat(fd)
                used += 1
            except OSError:
                pass
    return max(1, min(requested, soft - used - headroom))


class RetrieverServer:
    """The server of the module docstring: bound at construction (``server_address`` is known at
    once), serving in :meth:`serve_forever` until :meth:`shutdown` (from another thread).

    Counters (read them from any thread): ``refused`` (newcomers answered 503: every open
    connection was searching), ``evicted`` (waiting connections closed to admit a newcomer),
    ``timed_out`` (connections closed at their request deadline). ``max_connections`` is the
    effective cap (``limits.max_connections`` within the descriptor limit, :func:`connection_cap`)."""

    def __init__(self, retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                 limits: ServerLimits | None = None) -> None:
        self.retriever, self.limits = retriever, limits or ServerLimits()
        self.num_docs = len(retriever) if hasattr(retriever, "__len__") else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=1024)
        self.server_address: tuple[Any, ...] = self._sock.getsockname()
        self.max_connections = connection_cap(self.limits.max_connections)
        if self.max_connections < self.limits.max_connections:
            log.warning("serving at most %d connections, not %d: the process may open only %s descriptors "
                        "(ulimit -n)", self.max_connections, self.limits.max_connections, _nofile())
        self.refused = self.evicted = self.timed_out = 0
        self._conns: set[_Conn] = set()
        self._refusing: set[asyncio.Task] = set()  # newcomers being answered 503
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._done = threading.Event()
        self._started = threading.Event()
        self._closed = False

    # -- life cycle -------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve in the calling thread until :meth:`shutdown`."""
        self._done.clear()
        try:
            asyncio.run(self._main())
        finally:
            self._done.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait until it has returned (a no-op if it never ran)."""
        if not self._started.is_set() or self._done.is_set():
            return
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop already closed
                pass
        self._done.wait()

    def server_close(self) -> None:
        """Close the listening socket (after :meth:`shutdown`, or instead of serving)."""
        if not self._closed:
            self._closed = True
            self._sock.close()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        pool = ThreadPoolExecutor(self.limits.max_concurrent, thread_name_prefix="stoa-retrieve")
        self._pool = pool
        self._sock.setblocking(False)
        acceptor = asyncio.create_task(self._accept_loop())
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            acceptor.cancel()
            await asyncio.gather(acceptor, return_exceptions=True)
            for c in list(self._conns):
                c.close()
            await asyncio.gather(*(c.task for c in list(self._conns) if c.task is not None), return_exceptions=True)
            pool.shutdown(wait=False, cancel_futures=True)
            self.server_close()

    # -- connections ------------------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        """Accept one connection at a time, making room for it before the next: so the process
        never holds more than ``max_connections`` + 1 connections (asyncio's own server accepts
        the whole backlog at once, and under a low descriptor limit ran out of descriptors
        before any eviction happened)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._evict()  # out of descriptors all the same (the process's other files): free one
                elif e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue  # the client left before it was accepted
                else:
                    log.warning("accept failed (%s); retrying", e)
                await asyncio.sleep(0.05)
                continue
            self._admit(sock)
            await asyncio.sleep(0)  # an evicted connection's socket is closed before the next accept

    def _evict(self) -> bool:
        """Close the connection that has waited longest for a request (none searching); False if
        every open connection is searching."""
        waiting = [c for c in self._conns if not c.searching]
        if not waiting:
            return False
        victim = min(waiting, key=lambda c: c.waiting_since)
        self._conns.discard(victim)
        self.evicted += 1
        victim.close()
        return True

    def _admit(self, sock: socket.socket) -> None:
        """Serve a newcomer, evicting for it at the cap; 503 when every open connection is searching."""
        if len(self._conns) >= self.max_connections and not self._evict():
            self.refused += 1
            task = asyncio.get_running_loop().create_task(self._busy(sock))
            self._refusing.add(task)
            task.add_done_callback(self._refusing.discard)
            return
        conn = _Conn(sock, time.monotonic())
        self._conns.add(conn)
        conn.task = asyncio.get_running_loop().create_task(self._connection(conn))

    async def _busy(self, sock: socket.socket) -> None:
        try:
            _, writer = await asyncio.open_connection(sock=sock)
        except OSError:
            sock.close()
            return
        writer.write(_BUSY_RESPONSE)
        writer.close()

    async def _connection(self, conn: _Conn) -> None:
        try:
            try:
                reader, writer = await asyncio.open_connection(sock=conn.sock, limit=self.limits.max_head_bytes)
            except (asyncio.CancelledError, OSError):
                conn.sock.close()
                return
            conn.writer = writer
            try:
                await self._serve(conn, reader, writer)
            except (asyncio.CancelledError, ConnectionError, OSError):
                writer.transport.abort()
            finally:
                writer.close()  # sends what is still buffered, then closes
        finally:
            self._conns.discard(conn)

    async def _serve(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lim = self.limits
        h = h11.Connection(h11.SERVER, max_incomplete_event_size=lim.max_head_bytes)
        while True:
            conn.waiting_since, conn.searching = time.monotonic(), False
            deadline = time.monotonic() + lim.request_timeout
            try:
                event = await self._next(h, reader, deadline)
                if isinstance(event, h11.ConnectionClosed):
                    return
                assert isinstance(event, h11.Request)
                code, body = await self._handle(h, reader, event, deadline, conn)
                close = False
            except _Refusal as r:
                code, body, close = r.code, json.dumps({"error": r.message}, ensure_ascii=False).encode(), r.close
            except h11.RemoteProtocolError as e:
                code, close = e.error_status_hint, True
                body = json.dumps({"error": f"malformed request: {e}"[:500]}).encode()
            except TimeoutError:
                self.timed_out += 1
                return
            close = close or h.their_state is not h11.DONE
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            if close:
                headers.append(("Connection", "close"))
            try:
                out = h.send(h11.Response(status_code=code, headers=headers, reason=http.HTTPStatus(code).phrase))
                out += h.send(h11.Data(data=body)) + h.send(h11.EndOfMessage())
            except h11.LocalProtocolError:  # no answer is possible here (the client broke the protocol)
                return
            writer.write(out)
            await asyncio.wait_for(writer.drain(), lim.request_timeout)
            if close or h.our_state is not h11.DONE or h.their_state is not h11.DONE:
                return
            h.start_next_cycle()

    async def _next(self, h: h11.Connection, reader: asyncio.StreamReader, deadline: float) -> Any:
        """The next h11 event, reading (under the request deadline) while h11 needs data."""
        while True:
            event = h.next_event()
            if event is not h11.NEED_DATA:
                return event
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            try:
                data = await asyncio.wait_for(reader.read(65536), left)
            except asyncio.TimeoutError:
                raise TimeoutError from None
            h.receive_data(data)

    async def _handle(self, h: h11.Connection, reader: asyncio.StreamReader, req: h11.Request, deadline: float,
                      conn: _Conn) -> tuple[int, bytes]:
        lim = self.limits
        method, path = req.method.decode("latin-1"), req.target.decode("latin-1").split("?", 1)[0].rstrip("/")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in req.headers}
        if method == "GET":
            if path == "/health":
                return 200, json.dumps({"status": "ok", "num_docs": self.num_docs}).encode()
            raise _Refusal(404, f"no route GET {path[:200]}", close="content-length" in headers)
        if method != "POST" or path != "/retrieve":
            raise _Refusal(404, f"no route {method[:10]} {path[:200]} (use POST /retrieve)", close=True)
        if "transfer-encoding" in headers:
            raise _Refusal(411, "send the body with a Content-Length, not chunked", close=True)
        try:
            length = int(headers.get("content-length", ""))
        except ValueError:
            raise _Refusal(411, "Content-Length required", close=True) from None
        if not 0 <= length <= lim.max_body_bytes:
            raise _Refusal(413, f"body over {lim.max_body_bytes} bytes", close=True)
        parts = []
        while True:
            event = await self._next(h, reader, deadline)
            if isinstance(event, h11.EndOfMessage):
                break
            if not isinstance(event, h11.Data):  # ConnectionClosed mid-body
                raise TimeoutError
            parts.append(bytes(event.data))
        body = b"".join(parts)
        try:
            queries, k, scores = self._validate(json.loads(body))
        except RecursionError:
            raise _Refusal(400, "the body is nested too deeply") from None
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise _Refusal(400, str(e)[:500]) from None
        budget = min(lim.max_response_bytes, lim.max_amplification * max(length, 1))
        conn.searching = True
        try:
            answer = await asyncio.get_running_loop().run_in_executor(self._pool, self._search, queries, k,
                                                                      scores, budget)
        finally:
            conn.searching = False
        if answer is None:
            raise _Refusal(413, f"the answer would be over {budget} bytes ({lim.max_amplification} x the request, "
                                f"at most {lim.max_response_bytes}) even with documents cut: ask for fewer "
                                "queries or a smaller topk")
        return 200, answer

    def _search(self, queries: list[str], k: int, scores: bool, budget: int) -> bytes | None:
        """Runs in the search pool (``max_concurrent`` threads): the hits and their JSON answer."""
        hits: list[list[Hit]] = []
        try:
            for start in range(0, len(queries), 32):
                hits += [list(h[:k]) for h in self.retriever.search(queries[start : start + 32], k)]
        except Exception as e:  # report backend failures to the client, keep serving
            raise _Refusal(500, f"retrieval failed: {type(e).__name__}: {e}"[:2000]) from None
        return _answer(hits, scores, budget, self.limits.max_doc_chars)

    def _validate(self, req: Any) -> tuple[list[str], int, bool]:
        lim = self.limits
        if not isinstance(req, dict):
            raise ValueError("the body must be a JSON object")
        unknown = set(req) - {"queries", "topk", "return_scores"}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)[:10]}")
        queries = req.get("queries")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            raise ValueError("'queries' must be a list of strings")
        if not 1 <= len(queries) <= lim.max_queries:
            raise ValueError(f"between 1 and {lim.max_queries} queries per request")
        if any(len(q) > lim.max_query_chars for q in queries):
            raise ValueError(f"a query is over {lim.max_query_chars} characters")
        k = req.get("topk")
        k = lim.default_topk if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= lim.max_topk:
            raise ValueError(f"'topk' must be an int in [1, {lim.max_topk}]")
        if len(queries) * k > lim.max_results:
            raise ValueError(f"{len(queries)} queries x topk {k} is over {lim.max_results} documents per request")
        scores = req.get("return_scores", False)
        if not isinstance(scores, bool):
            raise ValueError("'return_scores' must be a boolean")
        return queries, k, scores


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                limits: ServerLimits | None = None) -> RetrieverServer:
    """A ready (not yet serving) server; ``port=0`` picks a free port (``server.server_address``).
    Call ``serve_forever()`` (e.g. in a thread), then ``shutdown()`` and ``server_close()``. At most
    ``limits.max_concurrent`` searches run at once, in a thread pool (the retriever must be
    thread-safe for reads, as the BM25 ones are)."""
    return RetrieverServer(retriever, host, port, limits)


def serve(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None) -> None:
    """Serve until interrupted; prints ``serving on http://host:port`` once listening."""
    server = make_server(retriever, host, port, limits)
    h, p = server.server_address[:2]
    print(f"serving on http://{h}:{p} (POST /retrieve, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
