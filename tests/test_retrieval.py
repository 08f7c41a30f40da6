"""Retrieval: BM25 scores against hand-computed values, bm25s vs rank-bm25, saving and loading
memory-mapped, the Search-R1 HTTP server and a client that validates what it receives."""

import json
import math
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from stoa.envs import check_env
from stoa.envs.papersearch import SearchConfig, SearchEnv
from stoa.envs.retrieval import (
    BM25SRetriever, Document, HTTPRetriever, RankBM25Retriever, Retriever, RetrieverError, bm25_tokenize,
    document_from_contents, load_retriever,
)
from stoa.envs.server import ServerLimits, make_server
from stoa.envs.synthetic import SyntheticConfig, SyntheticSearchEnv, generate

DOCS = [
    Document("a", "Apples", "apple apple banana"),
    Document("b", "", "banana cherry"),
    Document("c", "Cherries", "cherry cherry cherry durian elderberry fig"),
]


@pytest.fixture(scope="module")
def synthetic_docs():
    return generate(SyntheticConfig(seed=0)).docs


@pytest.fixture(scope="module")
def bm25(synthetic_docs):
    return BM25SRetriever.build(synthetic_docs)


def test_tokenizer_rules():
    assert bm25_tokenize("Which kinase does the protein KX-41 inhibit?") == ["kinase", "protein", "kx", "41", "inhibit"]
    assert bm25_tokenize("") == [] and bm25_tokenize("the of a") == []
    assert bm25_tokenize("Ünïcode Café") == ["ünïcode", "café"]


def test_bm25s_scores_equal_lucene_bm25_by_hand():
    r = BM25SRetriever.build(DOCS, k1=1.5, b=0.75)
    lens = [len(bm25_tokenize(f"{d.title}\n{d.text}" if d.title else d.text)) for d in DOCS]  # 4, 2, 7
    assert lens == [4, 2, 7]
    avg = sum(lens) / 3

    def score(tf, df, dl):  # Lucene's BM25: no (k1 + 1) factor in the numerator (rank-preserving)
        idf = math.log(1 + (3 - df + 0.5) / (df + 0.5))
        return idf * tf / (tf + 1.5 * (0.25 + 0.75 * dl / avg))

    hits = r.search(["cherry"], 3)[0]
    assert [h.id for h in hits] == ["c", "b"]  # "a" shares no term: not returned
    assert hits[0].score == pytest.approx(score(3, 2, 7), rel=1e-5)
    assert hits[1].score == pytest.approx(score(1, 2, 2), rel=1e-5)
    hits = r.search(["apple banana"], 3)[0]
    assert hits[0].id == "a" and hits[0].score == pytest.approx(score(2, 1, 4) + score(1, 2, 4), rel=1e-5)  # "apples" is its own term


def test_search_edge_cases(bm25):
    assert bm25.search(["", "the of", "zzzunknownzzz"], 3) == [[], [], []]
    assert len(bm25.search(["inhibits kinase"], 10_000)[0]) <= len(bm25)
    with pytest.raises(ValueError):
        bm25.search(["x"], 0)
    queries = ["Gahal", "kinase hepatocytes", "Tivorin gene"]
    assert bm25.search(queries, 3) == [bm25.search([q], 3)[0] for q in queries]
    hits = bm25.search(["kinase hepatocytes"], 5)[0]
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert isinstance(bm25, Retriever)


def test_rank_bm25_agrees_with_bm25s_on_distinctive_queries(synthetic_docs, bm25):
    ref = RankBM25Retriever.build(synthetic_docs)
    titles = sorted({d.title for d in synthetic_docs})[:50]
    for a, b in zip(bm25.search(titles, 3), ref.search(titles, 3)):
        assert {h.id for h in a} == {h.id for h in b}
    answers = [d.text.split()[-3] for d in synthetic_docs[:60] if " in " in d.text]  # object names, unique
    for a, b in zip(bm25.search(answers, 1), ref.search(answers, 1)):
        assert a[0].id == b[0].id


def test_save_and_load_memory_mapped(bm25, tmp_path):
    bm25.save(tmp_path / "idx")
    loaded = load_retriever(tmp_path / "idx")
    assert isinstance(loaded._model.scores["data"], np.memmap)
    assert len(loaded) == len(bm25)
    queries = ["Gahal", "receptor neurons", "nothing-matches-this"]
    assert loaded.search(queries, 3) == bm25.search(queries, 3)
    assert loaded.document(5) == bm25.document(5)
    with pytest.raises(FileExistsError):
        bm25.save(tmp_path / "idx")


def test_build_streaming_to_disk(synthetic_docs, bm25, tmp_path):
    streamed = BM25SRetriever.build((d for d in synthetic_docs), out=tmp_path / "s")
    queries = ["Gahal", "receptor neurons", "Tivorin gene"]
    assert streamed.search(queries, 3) == bm25.search(queries, 3)
    assert isinstance(streamed._model.scores["indices"], np.memmap)
    assert load_retriever(tmp_path / "s").search(queries, 3) == bm25.search(queries, 3)
    with pytest.raises(FileExistsError):
        BM25SRetriever.build(synthetic_docs, out=tmp_path / "s")
    with pytest.raises(ValueError, match="empty corpus"):
        BM25SRetriever.build([], out=tmp_path / "empty")


def test_corrupt_or_incomplete_index_is_refused(bm25, tmp_path):
    folder = bm25.save(tmp_path / "idx")
    manifest = json.loads((folder / "stoa_index.json").read_text())
    (folder / "stoa_index.json").write_text(json.dumps({**manifest, "tokenizer": "other"}))
    with pytest.raises(RetrieverError, match="tokenizer"):
        load_retriever(folder)
    (folder / "stoa_index.json").write_text(json.dumps({**manifest, "num_docs": 5}))
    with pytest.raises(RetrieverError, match="manifest says 5"):
        load_retriever(folder)
    (folder / "stoa_index.json").write_text(json.dumps(manifest))
    np.save(folder / "docs.offsets.npy", np.arange(901, dtype=np.int64))
    with pytest.raises(RetrieverError, match="corrupt"):
        load_retriever(folder)
    (folder / "stoa_index.json").unlink()
    with pytest.raises(RetrieverError, match="did not finish"):
        load_retriever(folder)


@pytest.mark.parametrize("contents, title, text", [
    ('"Aaron"\nAaron is a prophet.', "Aaron", "Aaron is a prophet."),
    ("TITLE: Imatinib in CML. ABSTRACT: Imatinib inhibits BCR-ABL.", "Imatinib in CML", "Imatinib inhibits BCR-ABL."),
    ("Just text.", "", "Just text."),
    ("Plain title\nline one\nline two", "Plain title", "line one\nline two"),
])
def test_document_from_contents(contents, title, text):
    d = document_from_contents(contents, "7")
    assert (d.id, d.title, d.text) == ("7", title, text)


# -- HTTP --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(bm25):
    srv = make_server(bm25, "127.0.0.1", 0, ServerLimits(max_queries=8, max_body_bytes=4096))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url + "/retrieve", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_round_trip_matches_local(server, bm25):
    client = HTTPRetriever(server)
    queries = ["Gahal", "kinase podocytes", "", "nothing-matches-this"]
    remote, local = client.search(queries, 3), bm25.search(queries, 3)
    assert [[(h.id, h.title, h.text) for h in q] for q in remote] == [[(h.id, h.title, h.text) for h in q] for q in local]
    assert all(a.score == pytest.approx(b.score) for qa, qb in zip(remote, local) for a, b in zip(qa, qb))
    assert len(HTTPRetriever(server, max_batch=2).search(queries * 3, 2)) == 12  # split into several requests


def test_concurrent_clients_get_their_own_answers(server, bm25, synthetic_docs):
    titles = sorted({d.title for d in synthetic_docs})[:32]
    expected = {t: bm25.search([t], 3)[0] for t in titles}
    got, errors = {}, []

    def ask(t):
        try:
            got[t] = HTTPRetriever(server).search([t], 3)[0]
        except Exception as e:  # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=ask, args=(t,)) for t in titles]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert {t: [h.id for h in hs] for t, hs in got.items()} == {t: [h.id for h in hs] for t, hs in expected.items()}


def test_search_r1_wire_format(server):
    code, body = post(server, {"queries": ["Gahal"], "topk": 2})
    assert code == 200 and len(body["result"][0]) == 2
    doc = body["result"][0][0]
    assert doc["contents"] == f'"{doc["title"]}"\n{doc["text"]}' and doc["title"] == "Gahal"
    code, body = post(server, {"queries": ["Gahal"], "return_scores": True})
    assert code == 200 and len(body["result"][0]) == 3  # default topk
    assert set(body["result"][0][0]) == {"document", "score"} and body["result"][0][0]["score"] > 0
    with urllib.request.urlopen(server + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok", "num_docs": 900}


@pytest.mark.parametrize("body, code, message", [
    ({"queries": "Gahal"}, 400, "list of strings"),
    ({"queries": []}, 400, "between 1 and 8"),
    ({"queries": ["a"] * 9}, 400, "between 1 and 8"),
    ({"queries": ["a"], "topk": 0}, 400, "topk"),
    ({"queries": ["a"], "topk": True}, 400, "topk"),
    ({"queries": ["a"], "return_scores": "yes"}, 400, "return_scores"),
    ({"queries": ["a"], "extra": 1}, 400, "unknown fields"),
    ([1, 2], 400, "JSON object"),
    (b"{not json", 400, ""),
    (b"x" * 5000, 413, "body over"),
])
def test_server_rejects_bad_requests(server, body, code, message):
    got, answer = post(server, body, raw=isinstance(body, bytes))
    assert got == code and message in answer["error"]
    assert post(server, {"queries": ["Gahal"]})[0] == 200  # still serving


def test_env_over_http_passes_check_env(server):
    questions = SyntheticSearchEnv("test").questions
    env = SearchEnv(questions, HTTPRetriever(server), SearchConfig(max_turns=3))
    check_env(env)


class _Junk(BaseHTTPRequestHandler):
    """A misbehaving server: the response body is chosen by the request's first query."""

    replies = {
        "notjson": (200, b"<html>"),
        "count": (200, json.dumps({"result": [[], []]}).encode()),
        "toomany": (200, json.dumps({"result": [[{"contents": "x"}] * 5]}).encode()),
        "nan": (200, b'{"result": [[{"document": {"contents": "x"}, "score": NaN}]]}'),
        "nodoc": (200, json.dumps({"result": [[{"document": {"id": 1}, "score": 1.0}]]}).encode()),
        "badid": (200, json.dumps({"result": [[{"document": {"id": [1], "contents": "x"}, "score": 1.0}]]}).encode()),
        "error": (500, b'{"error": "index exploded"}'),
        "plain": (200, json.dumps({"result": [[{"id": 3, "contents": '"T"\nbody'}]]}).encode()),
    }

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        q = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["queries"][0]
        code, raw = self.replies[q]
        self.send_response(code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture(scope="module")
def junk_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Junk)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("case, message", [
    ("notjson", "not JSON"), ("count", "1 entries"), ("toomany", "at most 3"), ("nan", "finite"),
    ("nodoc", "neither 'contents'"), ("badid", "id must be"), ("error", "HTTP 500: .*index exploded"),
])
def test_client_validates_responses(junk_server, case, message):
    with pytest.raises(RetrieverError, match=message):
        HTTPRetriever(junk_server).search([case], 3)


def test_client_accepts_search_r1_plain_documents(junk_server):
    [[hit]] = HTTPRetriever(junk_server).search(["plain"], 3)
    assert (hit.id, hit.title, hit.text, hit.score) == ("3", "T", "body", 0.0)


def test_client_reports_unreachable_server():
    with socket_closed_port() as port:
        with pytest.raises(RetrieverError, match="unreachable"):
            HTTPRetriever(f"http://127.0.0.1:{port}", retries=0, timeout=2).search(["x"], 3)
    with pytest.raises(ValueError):
        HTTPRetriever("127.0.0.1:8000")


class socket_closed_port:
    """A port that was free a moment ago (nothing listens on it)."""

    def __enter__(self):
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc):
        return False


# -- CLI ---------------------------------------------------------------------------------------------


def test_cli_build_then_serve(tmp_path):
    from typer.testing import CliRunner

    from stoa.cli import app

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "contents": f'"Doc {i}"\nword{i} shared text'}) + "\n" for i in range(20)))
    r = CliRunner().invoke(app, ["retriever", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx")])
    assert r.exit_code == 0 and "indexed 20 documents" in r.output, r.output
    proc = subprocess.Popen([sys.executable, "-m", "stoa", "retriever", "serve", "--index", str(tmp_path / "idx"),
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving on http://127.0.0.1:"), line
        url = line.split()[2]
        [[hit]] = HTTPRetriever(url).search(["word7"], 3)
        assert (hit.id, hit.title, hit.text) == ("7", "Doc 7", "word7 shared text")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
