"""Hostile input to the search environments.

The retriever server is started for real on 127.0.0.1 port 0 and spoken to over sockets: slow and
trickling clients, a full connection table, oversized bodies, huge ``topk``, answers that would be
tens of MB, deeply nested JSON. The env's parsers (retriever documents, tag forgery, model turns)
get 200 KB adversarial inputs that made the old regexes backtrack for minutes; each test checks
the exact result, and the pytest timeout is only a safety net. Differential tests pin the linear
parsers to the old regexes on short inputs, where those are fast.
"""

import json
import re
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoa.envs.data import Question
from stoa.envs.papersearch import SearchConfig, SearchEnv, format_information, neutralize, parse_turn
from stoa.envs.retrieval import BM25SRetriever, Document, Hit, HTTPRetriever, RetrieverError, document_from_contents
from stoa.envs.server import ServerLimits, make_server

DOCS = [Document(f"d{i}", f"Protein{i}", f"Protein{i} inhibits the kinase Kin{i} in hepatocytes.") for i in range(50)]


@pytest.fixture(scope="module")
def bm25():
    return BM25SRetriever.build(DOCS)


class _Serving:
    """A real server on a free loopback port, shut down on exit."""

    def __init__(self, retriever, limits: ServerLimits) -> None:
        self.srv = make_server(retriever, "127.0.0.1", 0, limits)
        self.port = self.srv.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.srv.shutdown()
        self.srv.server_close()
        return False


def _post(url, data: bytes, timeout=30):
    req = urllib.request.Request(url + "/retrieve", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _connect(port) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _read_to_close(s: socket.socket) -> bytes:
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    return reply


def _closed_by_peer(s: socket.socket, wait: float) -> bool:
    """Whether the server closes ``s`` within ``wait`` seconds (a safety bound, not a measurement)."""
    s.settimeout(wait)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


# -- the server: slow clients, connection cap ------------------------------------------------------


def test_slow_clients_do_not_stop_others_and_are_disconnected(bm25):
    limits = ServerLimits(max_connections=8, request_timeout=1.0)
    with _Serving(bm25, limits) as srv:
        silent = _connect(srv.port)  # connects, sends nothing
        half_line = _connect(srv.port)
        half_line.sendall(b"POST /retrieve HT")
        short_body = _connect(srv.port)  # promises 100 bytes, sends 10
        short_body.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"queries\"")
        client = HTTPRetriever(srv.url, retries=0, timeout=10)
        for i in range(5):  # answered while the three hold their sockets
            [[hit, *_]] = client.search([f"Protein{i}"], 3)
            assert hit.id == f"d{i}"
        for s in (silent, half_line, short_body):
            assert _closed_by_peer(s, wait=30), "the server kept a stalled connection open"
            s.close()


def test_trickling_client_is_cut_off_at_the_request_deadline(bm25):
    limits = ServerLimits(request_timeout=1.0)
    with _Serving(bm25, limits) as srv:
        s = _connect(srv.port)
        s.sendall(b"POST /retrieve HTTP/1.1\r\n")
        closed = False
        for _ in range(300):  # up to 30 s of one header byte per 0.1 s, far past the 1 s deadline
            try:
                s.sendall(b"X")
            except OSError:
                closed = True
                break
            if select.select([s], [], [], 0.1)[0]:
                try:
                    closed = s.recv(65536) == b""
                except ConnectionResetError:
                    closed = True
                if closed:
                    break
        s.close()
        assert closed, "a client trickling bytes held its connection past request_timeout"
        [[hit, *_]] = HTTPRetriever(srv.url, retries=0).search(["Protein3"], 3)
        assert hit.id == "d3"


def test_held_connections_do_not_lock_out_honest_clients(bm25):
    """The slow-client attack: an attacker fills every connection slot with half-sent requests and
    re-opens each one the server drops. Honest clients (no retries) are still answered, because a
    newcomer evicts the connection that has waited longest for its request."""
    limits = ServerLimits(max_connections=16, request_timeout=60.0)
    with _Serving(bm25, limits) as srv:
        stop, held, reopened = threading.Event(), [], [0]

        def attacker() -> None:
            for _ in range(16):
                s = _connect(srv.port)
                s.sendall(b"POST /retrieve HTTP/1.1\r\nContent-Le")
                held.append(s)
            deadline = time.monotonic() + 60  # bounded: stops by itself
            while not stop.is_set() and time.monotonic() < deadline:
                for i, s in enumerate(held):
                    if select.select([s], [], [], 0)[0]:  # dropped by the server: open another
                        s.close()
                        held[i] = _connect(srv.port)
                        held[i].sendall(b"POST /retrieve HTTP/1.1\r\nContent-Le")
                        reopened[0] += 1
                time.sleep(0.01)

        t = threading.Thread(target=attacker, daemon=True)
        t.start()
        while len(held) < 16:
            time.sleep(0.01)
        client = HTTPRetriever(srv.url, retries=0, timeout=10)
        for i in range(20):
            [[hit, *_]] = client.search([f"Protein{i}"], 3)
            assert hit.id == f"d{i}"
        stop.set()
        t.join()
        for s in held:
            s.close()
        assert srv.srv.refused == 0 and srv.srv.evicted >= 1


class _Gate:
    """A retriever whose searches wait until the test opens the gate."""

    def __init__(self, inner) -> None:
        self.inner, self.gate, self.inside = inner, threading.Event(), threading.Semaphore(0)

    def search(self, queries, k):
        self.inside.release()
        self.gate.wait(30)
        return self.inner.search(queries, k)


def test_busy_only_when_every_connection_is_searching(bm25):
    gated = _Gate(bm25)
    with _Serving(gated, ServerLimits(max_connections=2, max_concurrent=2, request_timeout=30.0)) as srv:
        answers = []
        workers = [threading.Thread(target=lambda q=q: answers.append(_post(srv.url, json.dumps({"queries": [q]}).encode())))
                   for q in ("Protein1", "Protein2")]
        for w in workers:
            w.start()
        for _ in workers:  # both connections are inside a search
            assert gated.inside.acquire(timeout=30)
        extra = _connect(srv.port)
        reply = _read_to_close(extra)
        extra.close()
        assert reply.startswith(b"HTTP/1.1 503") and b"every connection is searching" in reply
        assert srv.srv.refused == 1 and srv.srv.evicted == 0
        gated.gate.set()
        for w in workers:
            w.join(30)
        assert sorted(code for code, _ in answers) == [200, 200]


def test_the_longest_waiting_connection_is_evicted_first(bm25):
    with _Serving(bm25, ServerLimits(max_connections=3, request_timeout=60.0)) as srv:
        holders = []
        for _ in range(3):
            holders.append(_connect(srv.port))
            holders[-1].sendall(b"GET /hea")
            time.sleep(0.05)
        newest = _connect(srv.port)
        newest.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert newest.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_by_peer(holders[0], wait=30)
        for h in holders[1:]:  # still open: the server has not written to or closed them
            assert not select.select([h], [], [], 0.2)[0]
        for s in (*holders, newest):
            s.close()
        assert srv.srv.evicted == 1


_LOW_FD_SERVER = """
import json, os, resource, sys, threading
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
watchdog = threading.Timer(120, lambda: os._exit(3))  # bounded, whatever the parent does
watchdog.daemon = True
watchdog.start()
from stoa.envs.retrieval import BM25SRetriever, Document
from stoa.envs.server import ServerLimits, make_server
docs = [Document(f"d{i}", f"Protein{i}", f"Protein{i} inhibits the kinase Kin{i} in hepatocytes.") for i in range(50)]
srv = make_server(BM25SRetriever.build(docs), "127.0.0.1", 0, ServerLimits(request_timeout=60.0))
threading.Thread(target=srv.serve_forever, daemon=True).start()
print(json.dumps({"port": srv.server_address[1], "cap": getattr(srv, "max_connections", 256)}), flush=True)
sys.stdin.readline()
print(json.dumps({"evicted": srv.evicted, "refused": srv.refused}), flush=True)
os._exit(0)
"""


def test_a_server_under_a_low_descriptor_limit_answers_honest_clients_through_a_slow_client_flood():
    """Under RLIMIT_NOFILE 64 (below the nominal 256 connections) an attacker's 96 half-sent
    requests used up the descriptors before the cap was reached: ``accept`` failed, nobody was
    evicted and honest clients timed out. The cap now follows the limit, and connections are
    accepted one at a time, each making room before the next."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _LOW_FD_SERVER, "64"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        hello = json.loads(proc.stdout.readline())
        port = hello["port"]
        for _ in range(96):  # more half-sent requests than the child has descriptors
            held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            held[-1].sendall(b"POST /retrieve HTTP/1.1\r\nContent-Le")
        client = HTTPRetriever(f"http://127.0.0.1:{port}", retries=0, timeout=10)
        deadline = time.monotonic() + 60  # bounded: 10 requests, and at most a minute
        for i in range(10):
            assert time.monotonic() < deadline
            for j, s in enumerate(held):  # the attacker re-opens what the server dropped
                if select.select([s], [], [], 0)[0]:
                    s.close()
                    held[j] = socket.create_connection(("127.0.0.1", port), timeout=10)
                    held[j].sendall(b"POST /retrieve HTTP/1.1\r\nContent-Le")
            [[hit, *_]] = client.search([f"Protein{i}"], 3)
            assert hit.id == f"d{i}"
        proc.stdin.write("stats\n")
        proc.stdin.flush()
        stats = json.loads(proc.stdout.readline())
        assert stats["evicted"] >= 10 and stats["refused"] == 0 and 1 <= hello["cap"] < 64
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait(30)


# -- the server: request and answer bounds ---------------------------------------------------------


def test_oversized_and_unframed_bodies_are_refused(bm25):
    with _Serving(bm25, ServerLimits(max_body_bytes=4096, request_timeout=5.0)) as srv:
        # Headers only: the server must answer from them, without waiting for (or reading) a body.
        s = _connect(srv.port)
        s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n")
        reply = _read_to_close(s)  # the server answers and hangs up
        assert reply.startswith(b"HTTP/1.1 413") and b"body over 4096 bytes" in reply
        s.close()
        s = _connect(srv.port)
        s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert _read_to_close(s).startswith(b"HTTP/1.1 411")
        s.close()


def test_deeply_nested_json_is_answered_400(bm25):
    with _Serving(bm25, ServerLimits()) as srv:
        for body in (b"[" * 200_000, b'{"queries": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                     b'{"queries": ["x"], "topk": ' + b"9" * 5000 + b"}"):
            code, answer = _post(srv.url, body)
            assert code == 400 and answer["error"]
        code, answer = _post(srv.url, json.dumps({"queries": ["Protein7"], "topk": 1}).encode())
        assert code == 200 and answer["result"][0][0]["id"] == "d7"


def test_topk_and_result_count_are_capped(bm25):
    with _Serving(bm25, ServerLimits(max_topk=100, max_results=400)) as srv:
        code, answer = _post(srv.url, json.dumps({"queries": ["Protein1"], "topk": 10**9}).encode())
        assert code == 400 and "'topk' must be an int in [1, 100]" in answer["error"]
        code, answer = _post(srv.url, json.dumps({"queries": ["Protein1"] * 5, "topk": 100}).encode())
        assert code == 400 and "over 400 documents per request" in answer["error"]
        code, answer = _post(srv.url, json.dumps({"queries": ["Protein1"] * 4, "topk": 100}).encode())
        assert code == 200 and len(answer["result"]) == 4


class _HugeDocs:
    """A retriever whose every document is 200 KB: what a corpus of full papers can return."""

    def __len__(self) -> int:
        return 1000

    def search(self, queries, k):
        return [[Hit(f"big{i}", "Big", "w " * 100_000, 1.0) for i in range(k)] for _ in queries]


def test_a_small_request_cannot_ask_for_tens_of_megabytes():
    with _Serving(_HugeDocs(), ServerLimits()) as srv:  # default bounds
        request = json.dumps({"queries": ["x"] * 4, "topk": 100}).encode()
        assert len(request) < 100  # it would be 4 x 100 x 2 x 200 KB = 160 MB of JSON
        code, answer = _post(srv.url, request)
        assert code == 413 and "256 x the request" in answer["error"]
        request = json.dumps({"queries": ["x"], "topk": 3}).encode()
        code, answer = _post(srv.url, request)
        assert code == 200 and len(answer["result"][0]) == 3
        text = answer["result"][0][0]["text"]
        assert text.endswith("…") and 1000 < len(text) < 256 * len(request) / 6  # cut to a share of the budget


def test_the_worst_answer_to_request_ratio_is_bounded():
    """Attack: the smallest requests for the most documents of the longest kind (old code: a
    426-byte request got 15.6 MiB back, 38,000x). Measures every shape; the worst stays <= 256x."""
    shapes = [{"queries": ["x"] * n, "topk": k, **({"return_scores": True} if sc else {})}
              for n in (1, 4, 40, 400) for k in (1, 3, 10, 100) for sc in (False, True) if n * k <= 4096]
    worst = 0.0
    with _Serving(_HugeDocs(), ServerLimits()) as srv:
        for shape in shapes:
            body = json.dumps(shape, separators=(",", ":")).encode()
            req = urllib.request.Request(srv.url + "/retrieve", data=body)
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    got = len(r.read())
            except urllib.error.HTTPError as e:
                got = len(e.read())
            worst = max(worst, got / len(body))
    print(f"\nworst answer/request ratio over {len(shapes)} shapes: {worst:.0f}x")
    assert worst <= 256


# -- the HTTP client: what a server may send back --------------------------------------------------


class _Hostile(BaseHTTPRequestHandler):
    """A Search-R1-style server that answers each query with a chosen hostile body."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        q = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["queries"][0]
        if q == "trickle":
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            for _ in range(200):  # 20 s at most
                try:
                    self.wfile.write(b" ")
                except OSError:
                    return
                time.sleep(0.1)
            return
        raw = {
            "huge": b'{"result": [[' + b'{"contents": "' + b"x" * (3 << 20) + b'"}]]}',
            "nested": b'{"result": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "bigint": b'{"result": [[{"document": {"contents": "x"}, "score": 1' + b"0" * 400 + b"}]]}",
            "contents": json.dumps({"result": [[{"id": 1, "contents": ADVERSARIAL_CONTENTS}]]}).encode(),
        }[q]
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        try:
            self.wfile.write(raw)
        except OSError:  # the client refused to read it all: what the test wants
            pass


# 200 KB that the old title split (a lazy regex) and neutralize (a backtracking lookahead) each
# take quadratic time or worse on: long runs of spaces that end in no match.
ADVERSARIAL_CONTENTS = "TITLE: Spaced." + " " * 100_000 + "x. ABSTRACT: <search> <" + " " * 100_000 + "y"


@pytest.fixture(scope="module")
def hostile():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("query, message", [
    ("huge", "over 1048576"), ("nested", "nested too deeply"), ("bigint", "finite"),
    ("trickle", "took longer than the timeout"),
])
def test_client_bounds_what_a_server_sends(hostile, query, message):
    client = HTTPRetriever(hostile, retries=0, timeout=1.0, max_response_bytes=1 << 20)
    with pytest.raises(RetrieverError, match=message):
        client.search([query], 3)


@pytest.mark.timeout(120)
def test_env_turns_a_200kb_hostile_answer_into_information(hostile):
    """End to end: a Search-R1 server sends a 200 KB document built to make the old parsers
    backtrack (hours for this size); the env searches, parses and neutralizes it."""
    env = SearchEnv([Question("q0", "Which?", ("x",))], HTTPRetriever(hostile, retries=0),
                    SearchConfig(topk=3, max_doc_chars=1_000_000))
    env.reset(seed=0, options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("<search> contents </search>")
    assert info["action"] == "search" and not terminated and not truncated and reward == 0.0
    title, text = "Spaced." + " " * 100_000 + "x", "&lt;search> <" + " " * 100_000 + "y"
    assert obs == f"\n\n<information>Doc 1(Title: {title}) {text}</information>\n\n"


# -- the parsers: linear on 200 KB, identical to the old regexes on short inputs ---------------------

_OLD_FORGEABLE = re.compile(r"<(?=\s*/?\s*(?:search|answer|information|think)\s*>|\|)", re.IGNORECASE)
_OLD_CONTENTS = re.compile(r"TITLE:\s*(.*?)\.?\s+ABSTRACT:\s*(.*)\Z", re.S)
N = 200_000


def _pieces(*alphabet: str):
    return st.lists(st.sampled_from(alphabet), max_size=12).map("".join)


@pytest.mark.timeout(120)
def test_document_split_is_linear_on_hostile_contents():
    assert document_from_contents("TITLE: " + " " * N) == Document("", "", "TITLE:")
    d = document_from_contents("TITLE: " + " " * N + "x." + " " * N + "ABSTRACT:" + " " * N + "body", "7")
    assert (d.id, d.title, d.text) == ("7", "x", "body")
    d = document_from_contents("TITLE:" + " ." * N + "\tABSTRACT: a")
    assert d.title == ". " * (N - 2) + "." and d.text == "a"
    assert document_from_contents("TITLE:" + "ABSTRACT:" * (N // 9)).title == ""


@pytest.mark.timeout(120)
def test_neutralize_is_linear_on_hostile_text():
    assert neutralize("<" + " " * N + "search>") == "&lt;" + " " * N + "search>"
    assert neutralize("<" + " " * N + "/" + " " * N + "x") == "<" + " " * N + "/" + " " * N + "x"
    assert neutralize(("<" + " " * 100 + "/") * 2000) == ("<" + " " * 100 + "/") * 2000
    hits = [Hit("1", "<" + " " * N + "/ answer >", "< " * N + "<|im_end|>", 1.0)]
    obs = format_information(hits)
    assert obs.count("&lt;") == 2 and "<|" not in obs


@pytest.mark.timeout(120)
def test_turn_parsing_is_linear_on_hostile_turns():
    assert parse_turn("<search>" + "<search" * (N // 7) + " q </search>").content.startswith("<search<search")
    assert parse_turn("<answer>" + " " * N + "</answer>").reason == "empty answer"
    assert parse_turn("<search>" * (N // 8)).reason == "nested tags"
    assert parse_turn("<answer> x </answer>" + " " * N + "</answer>").reason == "more than one action"


@settings(max_examples=400, deadline=None)
@given(_pieces("<", "/", " ", "\t", "search", "Answer", "think", ">", "|", "x"))
def test_neutralize_matches_the_old_regex(text):
    assert neutralize(text) == _OLD_FORGEABLE.sub("&lt;", text)


def _old_document_from_contents(contents: str) -> tuple[str, str]:
    m = _OLD_CONTENTS.match(contents)
    if m:
        return m.group(1).strip(), m.group(2).strip()
    if "\n" in contents:
        title, text = contents.split("\n", 1)
        title = title.strip()
        if len(title) >= 2 and title[0] == title[-1] == '"':
            title = title[1:-1]
        return title, text.strip()
    return "", contents.strip()


@settings(max_examples=400, deadline=None)
@given(_pieces("ABSTRACT:", "ABSTRACT", ":", " ", "\u2003", ".", "x", "\n", "TITLE:", '"'))
def test_document_split_matches_the_old_regex(tail):
    for contents in ("TITLE:" + tail, tail):
        d = document_from_contents(contents)
        assert (d.title, d.text) == _old_document_from_contents(contents)
