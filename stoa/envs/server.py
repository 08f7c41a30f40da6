"""A retrieval server speaking the Search-R1 API, so many workers can share one big index.

``POST /retrieve`` with JSON ``{"queries": [str, ...], "topk": int (optional), "return_scores":
bool (optional)}`` answers ``{"result": [[item, ...] per query]}``. Each item is the document
``{"id", "contents", "title", "text"}`` (``contents`` is Search-R1's ``"<title>"\\n<text>``), wrapped
as ``{"document": doc, "score": float}`` when ``return_scores`` is true. ``GET /health`` answers
``{"status": "ok", "num_docs": n}``. Bad requests get HTTP 400/404/413 with ``{"error": message}``.

Start it with ``stoa retriever serve --index DIR`` (or :func:`make_server` in-process); query it
with :class:`stoa.envs.retrieval.HTTPRetriever` or any Search-R1 client.
"""

from __future__ import annotations

import json
import sys
import threading
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
    default_topk: int = 3
    """``topk`` when the request omits it (Search-R1's default)."""
    max_concurrent: int = 4
    """Requests searched at once; each holds a float32 score per document (64 MB for 16M)."""

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_queries, self.max_topk, self.max_query_chars) < 1:
            raise ValueError("every server limit must be >= 1")
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        if not 1 <= self.default_topk <= self.max_topk:
            raise ValueError("default_topk must lie in [1, max_topk]")


def _doc(h: Hit) -> dict[str, Any]:
    return {"id": h.id, "contents": f'"{h.title}"\n{h.text}', "title": h.title, "text": h.text}


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                limits: ServerLimits | None = None) -> ThreadingHTTPServer:
    """A ready (not yet serving) HTTP server; ``port=0`` picks a free port (``server.server_address``).
    Call ``serve_forever()`` (e.g. in a thread) and ``shutdown()``. One thread per connection;
    at most ``limits.max_concurrent`` searches run at once (the retriever must be thread-safe for
    reads, as the BM25 ones are)."""
    lim = limits or ServerLimits()
    slots = threading.BoundedSemaphore(lim.max_concurrent)
    num_docs = len(retriever) if hasattr(retriever, "__len__") else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            pass

        def _send(self, code: int, body: Any) -> None:
            raw = json.dumps(body, ensure_ascii=False).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "num_docs": num_docs})
            else:
                self._send(404, {"error": f"no route GET {self.path}"})

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": f"no route POST {self.path} (use /retrieve)"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._send(411, {"error": "Content-Length required"})
                return
            if not 0 <= length <= lim.max_body_bytes:
                self.close_connection = True
                self._send(413, {"error": f"body over {lim.max_body_bytes} bytes"})
                return
            try:
                req = json.loads(self.rfile.read(length))
                queries, k, scores = self._validate(req)
            except ValueError as e:
                self._send(400, {"error": str(e)})
                return
            try:
                with slots:
                    results = retriever.search(queries, k)
            except Exception as e:  # report backend failures to the client, keep serving
                self._send(500, {"error": f"retrieval failed: {type(e).__name__}: {e}"})
                return
            items = [[{"document": _doc(h), "score": h.score} if scores else _doc(h) for h in hits] for hits in results]
            self._send(200, {"result": items})

        def _validate(self, req: Any) -> tuple[list[str], int, bool]:
            if not isinstance(req, dict):
                raise ValueError("the body must be a JSON object")
            unknown = set(req) - {"queries", "topk", "return_scores"}
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
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
            scores = req.get("return_scores", False)
            if not isinstance(scores, bool):
                raise ValueError("'return_scores' must be a boolean")
            return queries, k, scores

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


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
