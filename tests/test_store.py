"""One conformance suite for every ObjectStore (LocalStore, and S3Store on a real SeaweedFS server),
plus key validation, open_store, crash safety of LocalStore and S3 retries through a faulty proxy."""

from __future__ import annotations

import http.client
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest

from conftest import NO_S3_REASON, S3_ENDPOINT, make_s3_store
from stoa.transport.store import (
    KeyNotFound,
    LocalStore,
    ObjectStore,
    S3Config,
    S3Store,
    StoreError,
    open_store,
    validate_key,
)

needs_s3 = pytest.mark.skipif(not S3_ENDPOINT, reason=NO_S3_REASON)

# --------------------------------------------------------------------------------------------
# Conformance: every store behaves the same
# --------------------------------------------------------------------------------------------


def test_is_an_object_store(store):
    assert isinstance(store, ObjectStore)


def test_put_get_overwrite_and_binary(store):
    every_byte = bytes(range(256)) * 3
    store.put("run/a.bin", every_byte)
    assert store.get("run/a.bin") == every_byte
    store.put("run/a.bin", b"second")
    assert store.get("run/a.bin") == b"second"
    store.put("run/empty", b"")
    assert store.get("run/empty") == b"" and store.exists("run/empty")
    store.put("run/ünï cödé.txt", b"x")
    assert store.get("run/ünï cödé.txt") == b"x"
    with pytest.raises(TypeError):
        store.put("run/s", "not bytes")


def test_missing_key(store):
    assert not store.exists("nope/x")
    with pytest.raises(KeyNotFound) as e:
        store.get("nope/x")
    assert isinstance(e.value, KeyError) and isinstance(e.value, StoreError)
    assert "nope/x" in str(e.value)
    store.put("dir/file", b"1")
    with pytest.raises(KeyNotFound):
        store.get("dir")  # a "folder" is not an object
    assert not store.exists("dir")


def test_list_is_sorted_and_uses_string_prefixes(store):
    keys = ["r/b/2", "r/a", "r/b/10", "r/b1/x", "r/c/d/e/f", "s/other", "r/b/1"]
    for k in keys:
        store.put(k, k.encode())
    assert store.list("r/") == sorted(k for k in keys if k.startswith("r/"))
    assert store.list("r/b") == ["r/b/1", "r/b/10", "r/b/2", "r/b1/x"]
    assert store.list("r/b/") == ["r/b/1", "r/b/10", "r/b/2"]
    assert store.list("r/c/d/e/f") == ["r/c/d/e/f"]
    assert store.list("zzz/") == [] and store.list("r/q") == []
    assert store.list("") == sorted(keys)


def test_delete_is_idempotent(store):
    store.put("d/x/y", b"1")
    store.put("d/z", b"2")
    store.delete("d/x/y")
    store.delete("d/x/y")
    store.delete("never/was")
    assert not store.exists("d/x/y")
    assert store.list("d/") == ["d/z"]
    store.put("d/x/y", b"3")  # the folder comes back after being pruned
    assert store.get("d/x/y") == b"3"


def test_put_if_absent(store):
    assert store.put_if_absent("once/k", b"first") is True
    assert store.put_if_absent("once/k", b"second") is False
    assert store.get("once/k") == b"first"
    store.delete("once/k")
    assert store.put_if_absent("once/k", b"third") is True
    assert store.get("once/k") == b"third"


def test_put_if_absent_race_has_one_winner(store):
    n, results = 8, {}
    barrier = threading.Barrier(n)

    def race(i: int) -> None:
        barrier.wait()
        results[i] = store.put_if_absent("race/k", f"writer {i}".encode())

    threads = [threading.Thread(target=race, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results.items() if won]
    assert len(results) == n and len(winners) == 1
    assert store.get("race/k") == f"writer {winners[0]}".encode()


def test_readers_never_see_partial_writes(store):
    size = 1 << 20
    blobs = [bytes([65 + i]) * size for i in range(3)]
    store.put("torn/k", blobs[0])
    stop, seen, bad = threading.Event(), set(), []

    def reader() -> None:
        while not stop.is_set():
            got = store.get("torn/k")
            if got not in blobs:
                bad.append(len(got))
            seen.add(got[:1])

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(30):
            store.put("torn/k", blobs[i % 3])
    finally:
        stop.set()
        t.join()
    assert not bad, f"saw partial objects of sizes {bad[:5]}"
    assert seen  # the reader really ran


def test_large_object_roundtrip(store):
    # Over S3_TEST_CONFIG's 5 MiB threshold: the S3 store uploads this in three parts.
    data = os.urandom(1 << 16) * 176  # 11 MiB
    store.put("big/one", data)
    assert store.get("big/one") == data
    assert store.put_if_absent("big/two", data) is True
    assert store.put_if_absent("big/two", b"small") is False
    assert store.put_if_absent("big/two", data[::-1]) is False  # a multipart upload is conditional too
    assert store.get("big/two") == data


BAD_KEYS = ["", "/abs", "a//b", "a/", "a/../b", "..", "./a", "a/./b", "a\x00b", "a\nb", "a\x7fb",
            "a\\b", ".stoa-tmp/x", "x" * 1025]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_are_refused_everywhere(store, key):
    for call in (lambda: store.put(key, b"x"), lambda: store.get(key), lambda: store.exists(key),
                 lambda: store.delete(key), lambda: store.put_if_absent(key, b"x")):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError):
        store.list("/abs")
    assert store.list("") == []


def test_validate_key_accepts_ordinary_keys():
    for k in ["a", "run-1/weights/000000000012/manifest.json", ".hidden/x", "a/..b/c.", "ü/ß"]:
        assert validate_key(k) == k
    with pytest.raises(ValueError):
        validate_key(b"bytes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# LocalStore specifics
# --------------------------------------------------------------------------------------------


def test_local_store_leaves_no_temp_files_and_hides_its_temp_folder(tmp_path):
    s = LocalStore(tmp_path)
    s.put("a/b", b"1")
    assert s.put_if_absent("a/c", b"2")
    assert not s.put_if_absent("a/c", b"3")
    assert os.listdir(tmp_path / ".stoa-tmp") == []
    assert s.list("") == ["a/b", "a/c"]
    assert (tmp_path / "a" / "b").read_bytes() == b"1"


def test_local_store_crash_before_rename_keeps_old_object(tmp_path, monkeypatch):
    s = LocalStore(tmp_path)
    s.put("k", b"old")

    def crash(*a, **k):
        raise OSError("simulated power loss")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(StoreError, match="simulated power loss"):
        s.put("k", b"new" * 1000)
    monkeypatch.undo()
    assert s.get("k") == b"old" and s.list("") == ["k"]
    assert os.listdir(tmp_path / ".stoa-tmp") == []


def test_local_store_sweeps_stale_temp_files(tmp_path):
    LocalStore(tmp_path)
    stale, fresh = tmp_path / ".stoa-tmp" / "put-old", tmp_path / ".stoa-tmp" / "put-new"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(stale, (0, 0))
    LocalStore(tmp_path)
    assert not stale.exists() and fresh.exists()


# --------------------------------------------------------------------------------------------
# open_store
# --------------------------------------------------------------------------------------------


def test_open_store_paths_and_urls(tmp_path, monkeypatch):
    for loc in (str(tmp_path / "p"), f"file://{tmp_path}/p", tmp_path / "p"):
        s = open_store(loc)
        assert isinstance(s, LocalStore) and s.root == (tmp_path / "p").resolve()
    monkeypatch.chdir(tmp_path)
    assert open_store("rel/dir").root == (tmp_path / "rel" / "dir").resolve()

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    s = open_store("s3://bkt/some/prefix/")
    assert isinstance(s, S3Store) and (s.bucket, s.prefix, s.endpoint_url) == ("bkt", "some/prefix", "http://127.0.0.1:1")
    s = open_store("s3://bkt?endpoint=http://127.0.0.1:2&region=auto")
    assert (s.bucket, s.prefix, s.endpoint_url) == ("bkt", "", "http://127.0.0.1:2")
    assert s._client.meta.region_name == "auto"
    for bad in ("s3://", "s3://b?color=red", "gs://b/p", "", "s3://b/../x"):
        with pytest.raises(ValueError):
            open_store(bad)


@needs_s3
def test_open_store_s3_roundtrip(s3_bucket):
    s = open_store(f"s3://{s3_bucket}/via-url?endpoint={S3_ENDPOINT}")
    s.put("k", b"v")
    assert s.get("k") == b"v" and s.list("") == ["k"]
    assert make_s3_store(s3_bucket).list("") == []  # prefixes isolate stores in one bucket


@needs_s3
def test_s3_bad_credentials_fail_clearly(s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    s = S3Store(s3_bucket, "creds", endpoint_url=S3_ENDPOINT, config=S3Config(max_attempts=1))
    with pytest.raises(StoreError, match="SignatureDoesNotMatch|AccessDenied|InvalidAccessKeyId"):
        s.put("k", b"v")


def test_s3_config_bounds():
    with pytest.raises(ValueError):
        S3Config(part_size=1 << 20)
    with pytest.raises(ValueError):
        S3Config(max_attempts=0)
    with pytest.raises(ValueError):
        S3Config(addressing_style="sideways")


# --------------------------------------------------------------------------------------------
# S3 retries: a proxy in front of the real server injects throttling and broken downloads
# --------------------------------------------------------------------------------------------


class _FaultyProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = urlparse(upstream).netloc
        self.faults: list[str] = []  # consumed one per request: "503", "truncate", "flip"
        self.served: list[str] = []
        self.lock = threading.Lock()


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # keep test output clean
        pass

    def _forward(self) -> None:
        srv: _FaultyProxy = self.server  # type: ignore[assignment]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with srv.lock:
            fault = srv.faults.pop(0) if srv.faults else None
            srv.served.append(f"{self.command} {fault}")
        if fault == "flip" and body:  # one bit damaged on the way to the server
            body = bytes([body[0] ^ 1]) + body[1:]
        if fault == "503":
            msg = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        conn = http.client.HTTPConnection(srv.upstream, timeout=30)
        conn.request(self.command, self.path, body=body, headers=dict(self.headers))
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection"):
                self.send_header(k, v)
        if fault == "truncate":  # promise the whole body, send half, hang up
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward


@needs_s3
def test_s3_retries_throttling_broken_downloads_and_damaged_uploads(s3_bucket):
    proxy = _FaultyProxy(S3_ENDPOINT)
    t = threading.Thread(target=proxy.serve_forever, daemon=True)
    t.start()
    try:
        direct = make_s3_store(s3_bucket)
        via = S3Store(s3_bucket, direct.prefix, endpoint_url=f"http://127.0.0.1:{proxy.server_address[1]}",
                      config=S3Config(max_attempts=4, read_timeout_s=10))
        proxy.faults = ["503"]
        via.put("k", b"x" * 100_000)
        assert direct.get("k") == b"x" * 100_000
        proxy.faults = ["truncate"]
        assert via.get("k") == b"x" * 100_000
        assert [s.split()[1] for s in proxy.served[-2:]] == ["truncate", "None"]
        proxy.faults = ["flip"]
        via.put("k", b"z" * 1000)  # the server refuses the damaged body (Content-MD5); it is sent again
        assert direct.get("k") == b"z" * 1000 and proxy.served[-2:] == ["PUT flip", "PUT None"]
        proxy.faults = ["503"]
        assert via.put_if_absent("k2", b"y") is True
        assert via.list("") == ["k", "k2"]
        assert [s.split()[1] for s in proxy.served[:2]] == ["503", "None"]
        impatient = S3Store(s3_bucket, direct.prefix, endpoint_url=via.endpoint_url, config=S3Config(max_attempts=2))
        proxy.faults = ["503"] * 2
        with pytest.raises(StoreError, match="SlowDown"):
            impatient.get("k")
        assert proxy.faults == []  # both attempts were made
    finally:
        proxy.shutdown()
        proxy.server_close()
