"""One conformance suite for every ObjectStore (LocalStore, and S3Store on a real SeaweedFS server),
plus key validation, open_store, crash safety and link refusal of LocalStore, secrets kept out of
S3Store's texts, and S3 retries, resumed and parallel ranged downloads through a faulty proxy."""

from __future__ import annotations

import http.client
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, urlparse

import pytest

from conftest import NO_S3_REASON, S3_ENDPOINT, make_s3_store
from stoa.transport.store import (
    KeyNotFound,
    LocalStore,
    ObjectStore,
    ObjectTooLarge,
    RangeNotSatisfiable,
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


def test_get_max_bytes_refuses_larger_objects(store):
    store.put("m/k", b"x" * 1000)
    store.put("m/empty", b"")
    assert store.get("m/k", max_bytes=1000) == b"x" * 1000
    assert store.get("m/k", max_bytes=10**9) == b"x" * 1000
    with pytest.raises(ObjectTooLarge) as e:
        store.get("m/k", max_bytes=999)
    assert (e.value.key, e.value.size, e.value.max_bytes) == ("m/k", 1000, 999)
    assert isinstance(e.value, StoreError) and "1000 bytes" in str(e.value)
    assert store.get("m/empty", max_bytes=0) == b""
    with pytest.raises(ObjectTooLarge):
        store.get("m/k", max_bytes=0)
    with pytest.raises(KeyNotFound):
        store.get("m/none", max_bytes=10)
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError):
            store.get("m/k", max_bytes=bad)


def test_get_max_bytes_on_a_large_object(store):
    data = os.urandom(1 << 16) * 176  # 11 MiB: several ranged pieces on S3
    store.put("m/big", data)
    with pytest.raises(ObjectTooLarge) as e:
        store.get("m/big", max_bytes=len(data) - 1)
    assert e.value.size == len(data)
    assert store.get("m/big", max_bytes=len(data)) == data


def test_get_range_returns_exactly_the_bytes_asked(store):
    data = bytes(range(256)) * 40
    store.put("run/r.bin", data)
    assert store.get_range("run/r.bin", 0, 8) == data[:8]
    assert store.get_range("run/r.bin", 1000, 5000) == data[1000:5000]
    assert store.get_range("run/r.bin", len(data) - 1, len(data)) == data[-1:]
    assert store.get_range("run/r.bin", 0, len(data)) == data
    assert store.get_range("run/r.bin", 17, 17) == b""
    for a, b in ((10, len(data) + 1), (len(data) + 5, len(data) + 9), (len(data) + 1, len(data) + 1)):
        with pytest.raises(RangeNotSatisfiable) as e:
            store.get_range("run/r.bin", a, b)
        assert e.value.size == len(data) and e.value.end == b and "run/r.bin" in str(e.value)
    with pytest.raises(KeyNotFound):
        store.get_range("nope/x", 0, 1)
    for a, b in ((5, 4), (-1, 4), (0, 1.5), (True, 3)):
        with pytest.raises(ValueError):
            store.get_range("run/r.bin", a, b)
    with pytest.raises(ValueError):
        store.get_range("../x", 0, 1)


def test_size(store):
    store.put("s/a", b"12345")
    store.put("s/e", b"")
    assert store.size("s/a") == 5 and store.size("s/e") == 0
    with pytest.raises(KeyNotFound):
        store.size("s/none")
    with pytest.raises(KeyNotFound):
        store.size("s")  # a folder is not an object
    with pytest.raises(ValueError):
        store.size("a//b")


def test_list_start_after(store):
    keys = ["q/a/1", "q/a/2", "q/b/1", "q/b/10", "q/b/2", "q/c", "r/z"]
    for k in keys:
        store.put(k, b"1")
    assert store.list("q/", start_after="q/a/2") == ["q/b/1", "q/b/10", "q/b/2", "q/c"]
    assert store.list("q/", start_after="q/b/1") == ["q/b/10", "q/b/2", "q/c"]
    assert store.list("q/b/", start_after="q/a/zzz") == ["q/b/1", "q/b/10", "q/b/2"]  # before the prefix: all
    assert store.list("q/", start_after="q/c") == []
    assert store.list("q/", start_after="q/b") == ["q/b/1", "q/b/10", "q/b/2", "q/c"]  # not a key itself
    assert store.list("", start_after="q/c") == ["r/z"]
    assert store.list("q/", start_after=None) == store.list("q/") == keys[:6]
    with pytest.raises(ValueError):
        store.list("q/", start_after=3)  # type: ignore[arg-type]


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


def _plant_links(tmp_path):
    """A store with honest objects, a file link and a folder link leading out of its root."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(b"trainer's private file")
    (outside / "sub" / "x").write_bytes(b"outside x")
    s = LocalStore(tmp_path / "store")
    s.put("run/honest", b"ok")
    os.symlink(outside / "secret.txt", tmp_path / "store" / "run" / "filelink")
    os.symlink(outside, tmp_path / "store" / "run" / "dirlink")
    os.symlink(outside, tmp_path / "store" / "toplink")
    return s, outside


def test_local_store_refuses_file_links(tmp_path):
    s, outside = _plant_links(tmp_path)
    for call in (lambda: s.get("run/filelink"), lambda: s.size("run/filelink"), lambda: s.delete("run/filelink"),
                 lambda: s.get("run/filelink", max_bytes=10)):
        with pytest.raises(StoreError, match="symbolic link"):
            call()
    assert not s.exists("run/filelink")
    assert s.list("run/") == ["run/honest"]  # a link is never an object
    # put replaces the link itself (rename never follows), so nothing outside changes
    s.put("run/filelink", b"new")
    assert (outside / "secret.txt").read_bytes() == b"trainer's private file"
    assert s.get("run/filelink") == b"new" and not os.path.islink(tmp_path / "store" / "run" / "filelink")
    assert s.get("run/honest") == b"ok"


def test_local_store_refuses_folder_links(tmp_path):
    s, outside = _plant_links(tmp_path)
    calls = {
        "get": lambda k: s.get(k), "size": lambda k: s.size(k), "delete": lambda k: s.delete(k),
        "put": lambda k: s.put(k, b"planted"), "put_if_absent": lambda k: s.put_if_absent(k, b"planted"),
        "quarantine-style put": lambda k: s.put(k + "/deeper/reason.json", b"{}"),
    }
    for key in ("run/dirlink/x", "run/dirlink/sub/x", "toplink/x", "toplink/sub/x"):
        for name, call in calls.items():
            with pytest.raises(StoreError, match="symbolic link") as e:
                call(key)
            assert f"{name.split()[-1]} {key!r}"[:-1] in str(e.value), name
        assert not s.exists(key)
    with pytest.raises(StoreError, match="symbolic link"):
        s.list("run/dirlink/")
    with pytest.raises(StoreError, match="symbolic link"):
        s.list("toplink/sub/")
    assert s.list("") == ["run/honest"] and s.list("run/d") == []
    # nothing was written or removed outside the root
    assert sorted(p.name for p in outside.rglob("*")) == ["secret.txt", "sub", "x"]
    assert (outside / "sub" / "x").read_bytes() == b"outside x"
    # honest keys beside the links still work end to end
    s.put("run/new/obj", b"v")
    assert s.put_if_absent("run/new/once", b"1") and s.get("run/new/once") == b"1"
    assert s.list("run/") == ["run/honest", "run/new/obj", "run/new/once"]
    s.delete("run/new/obj")
    assert s.get("run/new/obj".replace("obj", "once")) == b"1"


def test_local_store_refuses_a_linked_temp_folder(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "store").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "store" / ".stoa-tmp")
    with pytest.raises(StoreError, match="symbolic link"):
        LocalStore(tmp_path / "store")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_local_store_link_swapped_in_after_open(tmp_path):
    # The store holds no path across calls: a folder replaced by a link later is refused too.
    s = LocalStore(tmp_path / "store")
    s.put("run/w/a", b"1")
    (tmp_path / "outside").mkdir()
    os.rename(tmp_path / "store" / "run" / "w", tmp_path / "moved")
    os.symlink(tmp_path / "outside", tmp_path / "store" / "run" / "w")
    with pytest.raises(StoreError, match="symbolic link"):
        s.put("run/w/a", b"2")
    assert list((tmp_path / "outside").iterdir()) == []


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
        self.faults: list[str] = []  # consumed one per request: "503", "truncate", "flip", "replace", "norange"
        self.served: list[str] = []
        self.ranges: list[str | None] = []  # the Range header of each request
        self.body_bytes = 0  # response body bytes sent to the client
        self.on_replace = None  # called before forwarding a request with the "replace" fault
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
            srv.ranges.append(self.headers.get("Range"))
        if fault == "replace":  # another writer replaces the object between two ranged GETs
            srv.on_replace()
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
            if k.lower() not in ("transfer-encoding", "connection") and not (
                    fault == "norange" and k.lower() == "content-range"):  # a cache on the way that drops it
                self.send_header(k, v)
        if fault == "truncate":  # promise the whole body, send half, hang up
            self.send_header("Connection", "close")
            self.end_headers()
            with srv.lock:  # counted before the client can have it (a test may look at once)
                srv.body_bytes += len(data) // 2
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        self.end_headers()
        with srv.lock:  # counted before the client can have it (a test may look at once)
            srv.body_bytes += len(data)
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


@pytest.fixture
def faulty_proxy():
    proxy = _FaultyProxy(S3_ENDPOINT)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield proxy
    proxy.shutdown()
    proxy.server_close()


@needs_s3
def test_s3_max_bytes_does_not_download_the_body(s3_bucket, faulty_proxy):
    direct = make_s3_store(s3_bucket)
    via = S3Store(s3_bucket, direct.prefix, endpoint_url=f"http://127.0.0.1:{faulty_proxy.server_address[1]}",
                  config=S3Config(max_attempts=2))
    direct.put("big", os.urandom(3 << 20))
    with pytest.raises(ObjectTooLarge):
        via.get("big", max_bytes=1000)
    # one ranged GET of at most max_bytes + 1 bytes; the size came from its Content-Range
    assert faulty_proxy.ranges == ["bytes=0-1000"] and faulty_proxy.body_bytes <= 1001
    direct.put("empty", b"")
    assert via.get("empty", max_bytes=0) == b""  # no byte 0 to range over: a plain GET
    assert faulty_proxy.ranges[1:] == ["bytes=0-0", None]


@needs_s3
def test_s3_parallel_ranged_download_resumes_broken_pieces(s3_bucket, faulty_proxy):
    direct = make_s3_store(s3_bucket)
    cfg = S3Config(max_attempts=2, download_part_size=64 << 10, max_concurrency=4)
    via = S3Store(s3_bucket, direct.prefix, endpoint_url=f"http://127.0.0.1:{faulty_proxy.server_address[1]}",
                  config=cfg)
    data = os.urandom((1 << 20) + 17)
    direct.put("obj", data)
    faulty_proxy.faults = ["None", "truncate", "truncate"]
    assert via.get("obj") == data
    n_pieces = -(-len(data) // (64 << 10))
    assert len(faulty_proxy.served) == n_pieces + 2  # two broken pieces, each continued once
    starts = sorted(int(r.split("=")[1].split("-")[0]) for r in faulty_proxy.ranges)
    assert [x for x in starts if x % (64 << 10)] and len(set(starts)) == n_pieces + 2  # continuations mid-piece
    assert faulty_proxy.body_bytes == len(data)  # nothing was fetched twice


@needs_s3
def test_s3_ranged_read_fetches_only_its_range_resumes_and_refuses_a_whole_body(s3_bucket, faulty_proxy):
    direct = make_s3_store(s3_bucket)
    via = S3Store(s3_bucket, direct.prefix, endpoint_url=f"http://127.0.0.1:{faulty_proxy.server_address[1]}",
                  config=S3Config(max_attempts=2))
    data = os.urandom(1 << 20)
    direct.put("obj", data)
    assert via.get_range("obj", 1000, 201_000) == data[1000:201_000]
    assert faulty_proxy.ranges == ["bytes=1000-200999"] and faulty_proxy.body_bytes == 200_000
    faulty_proxy.faults = ["truncate"]
    assert via.get_range("obj", 5, 100_005) == data[5:100_005]  # the broken body continues where it stopped
    assert faulty_proxy.ranges[1] == "bytes=5-100004" and faulty_proxy.ranges[2].endswith("-100004")
    faulty_proxy.faults = ["norange"]
    with pytest.raises(StoreError, match="ignored a ranged GET"):
        via.get_range("obj", 10, 20)


@needs_s3
def test_s3_object_replaced_mid_download_restarts_on_the_new_version(s3_bucket, faulty_proxy):
    direct = make_s3_store(s3_bucket)
    via = S3Store(s3_bucket, direct.prefix, endpoint_url=f"http://127.0.0.1:{faulty_proxy.server_address[1]}",
                  config=S3Config(max_attempts=2, download_part_size=64 << 10, max_concurrency=1))
    old, new = os.urandom(300_000), os.urandom(300_000)
    direct.put("obj", old)
    faulty_proxy.on_replace = lambda: direct.put("obj", new)
    faulty_proxy.faults = ["None", "replace"]  # the second piece's If-Match no longer holds
    assert via.get("obj") == new  # never a mix of both versions
    assert "If-Match" not in faulty_proxy.served[0]
    faulty_proxy.on_replace = lambda: direct.put("obj", os.urandom(300_000))
    faulty_proxy.faults = ["None", "replace"] + ["None"] * 4 + ["replace"]
    with pytest.raises(StoreError, match="replaced during the download"):
        via.get("obj")  # replaced during both attempts: an error, not a loop


SECRET = "s3cr3t-Value/With+Chars"


def test_s3_credentials_never_shown(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    quiet = S3Config(max_attempts=1, connect_timeout_s=1, read_timeout_s=1)
    quoted = SECRET.replace("/", "%2F").replace("+", "%2B")
    stores = [
        S3Store("bkt", "p", endpoint_url=f"http://AKID:{quoted}@127.0.0.1:1", config=quiet),
        open_store(f"s3://AKID:{quoted}@bkt/p?endpoint=http://127.0.0.1:1", s3_config=quiet),
        # a URL inside a query value is itself percent-encoded
        open_store(f"s3://bkt/p?endpoint={quote(f'http://AKID:{quoted}@127.0.0.1:1', safe='')}", s3_config=quiet),
        S3Store("bkt", "p", endpoint_url="http://127.0.0.1:1", credentials=("AKID", SECRET), config=quiet),
    ]
    for s in stores:
        creds = s._client._request_signer._credentials
        assert (creds.access_key, creds.secret_key) == ("AKID", SECRET)  # the secret was parsed and used
        assert s.endpoint_url == "http://127.0.0.1:1"
        for text in (repr(s), str(s)):
            assert SECRET not in text and quoted not in text and "AKID" not in text
        for call in (lambda: s.get("k"), lambda: s.put("k", b"v"), lambda: s.list(""), lambda: s.exists("k")):
            with pytest.raises(StoreError) as e:
                call()
            assert SECRET not in str(e.value) and quoted not in str(e.value)
    for bad in (f"s3://AKID:{quoted}@/p", f"s3://AKID:{quoted}@bkt/p?colour=red", f"s3://:{quoted}@bkt"):
        with pytest.raises(ValueError) as e:
            open_store(bad)
        assert SECRET not in str(e.value) and quoted not in str(e.value)


@needs_s3
def test_s3_credentials_in_the_url_work_and_stay_hidden(s3_bucket, monkeypatch):
    key, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    host = S3_ENDPOINT.split("://")[1]
    s = open_store(f"s3://{key}:{secret}@{s3_bucket}/url-creds?endpoint=http://{host}")
    s.put("k", b"v")
    assert s.get("k") == b"v" and secret not in repr(s)
    bad = open_store(f"s3://{key}:not-{secret}@{s3_bucket}/url-creds?endpoint=http://{host}",
                     s3_config=S3Config(max_attempts=1))
    with pytest.raises(StoreError, match="SignatureDoesNotMatch|AccessDenied") as e:
        bad.get("k")
    assert f"not-{secret}" not in str(e.value)
