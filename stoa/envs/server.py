"""A retrieval server speaking the Search-R1 API, so many workers can share one big index.

``POST /retrieve`` with JSON ``{"queries": [str, ...], "topk": int (optional), "return_scores":
bool (optional)}`` answers ``{"result": [[item, ...] per query]}``. Each item is the document
``{"id", "contents", "title", "text"}`` (``contents`` is Search-R1's ``"<title>"\\n<text>``), wrapped
as ``{"document": doc, "score": float}`` when ``return_scores`` is true. ``GET /health`` answers
``{"status": "ok", "num_docs": n}``. Bad requests get HTTP 400/404/411/413 with ``{"error": message}``;
a server at its connection cap answers 503 at once and closes.

Bounds (:class:`ServerLimits`; a request beyond one is refused, never truncated silently): the
request body size, queries per request, query length, ``topk``, ``queries x topk``, the size of
the answer (checked while it is built, so it is never held whole beyond the cap), concurrent
connections, concurrent searches, and the time to receive one request: a client that sends
nothing, or trickles bytes, is disconnected when ``request_timeout`` runs out, whatever it sends.

The answer is bounded relative to the request: at most ``max_amplification`` (256) times the
request body's bytes. Documents are cut (to ``max_doc_chars``, and to an equal share of that
budget; a cut text ends with ``…``) so that honest requests always get an answer; only a request
whose answer does not fit even then is refused (413). So no request gets back more than 256
bytes per byte it sent.

Start it with ``stoa retriever serve --index DIR`` (or :func:`make_server` in-process); query it
with :class:`stoa.envs.retrieval.HTTPRetriever` or any Search-R1 client.
"""

from __future__ import annotations

import io
import json
import math
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stoa.envs.retrieval import Hit, Retriever

__all__ = ["make_server", "serve", "ServerLimits"]


@dataclass(frozen=True)
class ServerLimits:
    """Request bounds; a request beyond them is refused, never truncated silently."""

    max_body_bytes: int = 1 << 20
    """Largest request body."""
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
    max_connections: int = 64
    """Open connections served at once (one thread each); more are answered 503 and closed."""
    request_timeout: float = 30.0
    """Seconds to receive one whole request (and to send its answer), idle keep-alive included."""

    def __post_init__(self) -> None:
        ints = (self.max_body_bytes, self.max_queries, self.max_topk, self.max_query_chars, self.max_results,
                self.max_response_bytes, self.max_concurrent, self.max_connections, self.max_doc_chars,
                self.max_amplification)
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


class _DeadlineReader(io.RawIOBase):
    """A socket's input under one deadline per request: each recv waits only for what is left,
    so a client trickling a byte at a time cannot hold a thread past the deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline = math.inf

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received before the deadline")
        self._sock.settimeout(left)
        return self._sock.recv_into(b)


_BUSY = json.dumps({"error": "server busy: too many open connections, retry later"}).encode()
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


class _Server(ThreadingHTTPServer):
    """One daemon thread per connection, at most ``max_connections`` at once."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: type, limits: ServerLimits) -> None:
        self._conns = threading.BoundedSemaphore(limits.max_connections)
        self.refused = 0
        """Connections answered 503 because the cap was reached."""
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._conns.acquire(blocking=False):
            self.refused += 1
            try:  # a fresh socket's send buffer is empty: this never blocks the accept loop
                request.setblocking(False)
                request.send(_BUSY_RESPONSE)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._conns.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._conns.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that went away is not news
            super().handle_error(request, client_address)


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


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                limits: ServerLimits | None = None) -> ThreadingHTTPServer:
    """A ready (not yet serving) HTTP server; ``port=0`` picks a free port (``server.server_address``).
    Call ``serve_forever()`` (e.g. in a thread) and ``shutdown()``. One thread per connection, at
    most ``limits.max_connections``; at most ``limits.max_concurrent`` searches run at once (the
    retriever must be thread-safe for reads, as the BM25 ones are)."""
    lim = limits or ServerLimits()
    slots = threading.BoundedSemaphore(lim.max_concurrent)
    num_docs = len(retriever) if hasattr(retriever, "__len__") else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            pass

        def setup(self) -> None:
            super().setup()
            self._reader = _DeadlineReader(self.connection)
            self.rfile = io.BufferedReader(self._reader)

        def handle_one_request(self) -> None:
            self._reader.deadline = time.monotonic() + lim.request_timeout
            super().handle_one_request()

        def _send(self, code: int, body: Any = None, raw: bytes | None = None) -> None:
            raw = json.dumps(body, ensure_ascii=False).encode() if raw is None else raw
            self.connection.settimeout(lim.request_timeout)  # sendall's total time, since 3.5
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(raw)

        def _refuse(self, code: int, message: str, *, close: bool = False) -> None:
            self.close_connection = self.close_connection or close
            self._send(code, {"error": message})

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "num_docs": num_docs})
            else:
                self._refuse(404, f"no route GET {self.path[:200]}")

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            if self.path.rstrip("/") != "/retrieve":
                self._refuse(404, f"no route POST {self.path[:200]} (use /retrieve)", close=True)
                return
            if self.headers.get("Transfer-Encoding") is not None:
                self._refuse(411, "send the body with a Content-Length, not chunked", close=True)
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._refuse(411, "Content-Length required", close=True)
                return
            if not 0 <= length <= lim.max_body_bytes:
                self._refuse(413, f"body over {lim.max_body_bytes} bytes", close=True)
                return
            body = self.rfile.read(length)
            try:
                queries, k, scores = self._validate(json.loads(body))
            except RecursionError:
                self._refuse(400, "the body is nested too deeply")
                return
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                self._refuse(400, str(e)[:500])
                return
            try:
                hits = self._search(queries, k)
            except Exception as e:  # report backend failures to the client, keep serving
                self._refuse(500, f"retrieval failed: {type(e).__name__}: {e}"[:2000])
                return
            budget = min(lim.max_response_bytes, lim.max_amplification * max(length, 1))
            answer = _answer(hits, scores, budget, lim.max_doc_chars)
            if answer is None:
                self._refuse(413, f"the answer would be over {budget} bytes ({lim.max_amplification} x the request, "
                                  f"at most {lim.max_response_bytes}) even with documents cut: ask for fewer "
                                  "queries or a smaller topk")
                return
            self._send(200, raw=answer)

        def _search(self, queries: list[str], k: int) -> list[list[Hit]]:
            out: list[list[Hit]] = []
            for start in range(0, len(queries), 32):
                with slots:
                    out += [list(h[:k]) for h in retriever.search(queries[start : start + 32], k)]
            return out

        def _validate(self, req: Any) -> tuple[list[str], int, bool]:
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

    return _Server((host, port), Handler, lim)


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
