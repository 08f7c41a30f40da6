"""The stage channel: frames checked field by field, and a pipeline whose later stages serve over
real TCP connections (threads of this process) playing the single engine's episodes."""

from __future__ import annotations

import json
import socket
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from stoa.fleet.stages import discovery
from stoa.transport.frames import MAGIC, Frame, FrameError, encode, read_frame, write_frame
from stoa.transport.store import LocalStore


def roundtrip(data: bytes, max_payload: int = 1 << 20) -> Frame:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        return read_frame(b, max_payload)


def raw(header: dict, payload: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return MAGIC + struct.pack(">I", len(h)) + h + payload


def test_frames_round_trip_and_refuse_what_breaks_the_format():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    f = roundtrip(encode(Frame("forward", {"longest": 3}, (x, np.array([0, 1], dtype=np.int64)))))
    assert f.op == "forward" and f.meta == {"longest": 3}
    assert np.array_equal(f.arrays[0], x) and f.arrays[0].dtype == np.float32 and f.arrays[1].tolist() == [0, 1]
    with pytest.raises(FrameError, match="over this end's limit"):  # sizes are checked before anything is read
        roundtrip(raw({"op": "forward", "meta": {}, "arrays": [{"dtype": "float32", "shape": [1 << 20, 1 << 10]}]}))
    with pytest.raises(FrameError, match="bad array spec"):
        roundtrip(raw({"op": "forward", "meta": {}, "arrays": [{"dtype": "object", "shape": [1]}]}))
    with pytest.raises(FrameError, match="bad array spec"):
        roundtrip(raw({"op": "forward", "meta": {}, "arrays": [{"dtype": "float32", "shape": [-1]}]}))
    with pytest.raises(FrameError, match="bad frame header"):
        roundtrip(raw({"op": "forward", "meta": {}, "arrays": [], "extra": 1}))
    with pytest.raises(FrameError, match="not JSON"):
        roundtrip(MAGIC + struct.pack(">I", 3) + b"\x80ab")
    with pytest.raises(FrameError, match="not a stage frame"):
        roundtrip(b"\x80\x04pickle..")
    with pytest.raises(FrameError, match="over 65536"):
        roundtrip(MAGIC + struct.pack(">I", 1 << 30))
    with pytest.raises(FrameError, match="ended"):  # a frame cut short
        roundtrip(raw({"op": "forward", "meta": {}, "arrays": [{"dtype": "int64", "shape": [4]}]}, b"\0" * 8))
    with pytest.raises(FrameError):
        encode(Frame("forward", {}, (np.zeros(2, dtype=np.float64),)))


def test_announcements_are_signed_by_the_key_they_carry_and_validated(tmp_path):
    import dataclasses

    from stoa.transport.signing import generate_private_key, key_id, sign_document

    st, me, other = LocalStore(tmp_path), generate_private_key(), generate_private_key()
    a = discovery.Announcement(1, 2, (1, 2), "127.0.0.1", 4242, "", 1.0)
    discovery.announce(st, "run", "p0", a, me)
    got = discovery.read_announcement(st, "run", "p0", 1)
    assert got.key_id == key_id(me.public_key()) and got.stale() and "BEGIN CERTIFICATE" in got.cert
    assert dataclasses.replace(got, key_id="", key="", cert="") == a
    assert discovery.read_announcement(st, "run", "p0", 2) is None
    # Whoever can write to the store can replace an announcement, but not speak for another key.
    body = json.loads(json.loads(st.get("run/stages/p0/1.json"))["body"])
    for forged, why in (({**body, "port": 6666}, "the key it carries"),  # signed by another key, claims mine
                        ({**body, "key": other.public_key().public_bytes_raw().hex()}, "key id"),
                        ({**body, "key": other.public_key().public_bytes_raw().hex(), "key_id": key_id(other.public_key())},
                         "certificate")):
        st.put("run/stages/p0/1.json", sign_document(discovery.KIND, forged, other))
        with pytest.raises(ValueError):
            discovery.read_announcement(st, "run", "p0", 1)
    st.put("run/stages/p0/1.json", b'{"format": "stoa.stage.announce/1", "index": 1}')  # unsigned
    with pytest.raises(ValueError, match="not a signed stage announcement"):
        discovery.read_announcement(st, "run", "p0", 1)
    st.put("run/stages/p0/1.json", b"x" * 9000)
    with pytest.raises(ValueError, match="over 8192"):
        discovery.read_announcement(st, "run", "p0", 1)
    with pytest.raises(ValueError, match="pipeline id"):
        discovery.read_announcement(st, "run", "../x", 1)
    allowed = discovery.Allowed(frozenset({"a" * 16}), {"b" * 16})
    assert allowed.refusal("a" * 16, "stage 1") is None and allowed.refusal("b" * 16, "stage 1") is None
    assert "neither named here" in allowed.refusal("c" * 16, "stage 1")


def _tls_stage(stage_key, allowed_driver_cert: bytes, srv: socket.socket, got: list) -> None:
    """A stage's side of one link: mutual TLS pinned to one driver, then a hello answered."""
    from stoa.fleet.stages import tls

    conn, _ = srv.accept()
    try:
        with tls.context("server", stage_key, allowed_driver_cert).wrap_socket(conn, server_side=True) as link:
            got.append(read_frame(link, 1 << 20).op)
            write_frame(link, Frame("hello", {"part": [1, 2], "layers": 2}))
    except OSError as e:
        got.append(type(e).__name__)
    finally:
        conn.close()


def test_a_driver_and_its_stages_know_whose_end_they_talk_to(tmp_path):
    """The ring connects to a stage only over mutual TLS pinned to keys each side accepts: a stage
    whose key is not accepted gets nothing sent; a stage speaking TLS with another key than the
    one announced, or refusing the driver's key, fails the handshake."""
    from stoa.fleet.stages import tls
    from stoa.fleet.stages.driver import StageRefused, StageRing
    from stoa.transport.signing import generate_private_key, key_id

    st, run_key = LocalStore(tmp_path), generate_private_key()
    driver, stage, impostor = generate_private_key(), generate_private_key(), generate_private_key()
    cases = [  # (key the stage announces, key it speaks TLS with, driver cert it accepts, driver's --stage-keys, outcome)
        (stage, stage, tls.certificate(driver), [key_id(stage.public_key())], "hello"),
        (stage, stage, tls.certificate(driver), [], "neither named here"),
        (stage, impostor, tls.certificate(driver), [key_id(stage.public_key())], "SSL"),
        (stage, stage, tls.certificate(impostor), [key_id(stage.public_key())], "SSL"),
    ]
    for announced, speaks, accepts, named, outcome in cases:
        srv = socket.create_server(("127.0.0.1", 0))
        got: list = []
        t = threading.Thread(target=_tls_stage, args=(speaks, accepts, srv, got), daemon=True)
        t.start()
        discovery.announce(st, "run", "p0", discovery.Announcement(1, 2, (1, 2), "127.0.0.1", srv.getsockname()[1],
                                                                   "", __import__("time").time()), announced)
        ring = StageRing(st, "run", "p0", [(0, 1), (1, 2)], 2, True, 8, 16, 1 << 20, driver, run_key.public_key(),
                         named)
        if outcome == "hello":
            assert ring.connect() and ring.ready() and got == ["hello"]
            assert discovery.read_announcement(st, "run", "p0", 0).key_id == key_id(driver.public_key())
        else:
            with pytest.raises(StageRefused, match=outcome):
                ring.connect()
            assert not ring.ready() and "hello" not in got
        ring.drop()
        srv.close()


def test_advertise_names_the_host_and_optionally_the_port_a_stage_announces(tmp_path):
    from types import SimpleNamespace

    from stoa.fleet.stages.server import StageServer
    from stoa.transport.signing import generate_private_key

    parse = discovery.parse_advertise
    assert parse("10.0.0.7") == ("10.0.0.7", None) and parse("stage.example:7000") == ("stage.example", 7000)
    assert parse("[::1]:9") == ("::1", 9) and parse("[fe80::1]") == ("fe80::1", None) and parse("::1") == ("::1", None)
    for bad in ["", "h:", ":80", "h:0", "h:65536", "h:8o", "[::1", "[::1]x", "a b:1", "h/x:1", "x" * 256, "h:+1"]:
        with pytest.raises(ValueError, match="advertise"):
            parse(bad)
    st, pub = LocalStore(tmp_path / "store"), generate_private_key().public_key()
    server = StageServer(st, "run", pub, "p0", 1, 2, tmp_path / "c", port=0, advertise="127.0.0.1:6001")
    server.stage, server.port = SimpleNamespace(part=(1, 2)), 40123  # as after it starts listening
    discovery.announce(st, "run", "p0", server.announcement(), server.key)
    got = discovery.read_announcement(st, "run", "p0", 1)
    assert (got.host, got.port, got.part) == ("127.0.0.1", 6001, (1, 2))  # the proxy's port, not the one listened on
    plain = StageServer(st, "run", pub, "p0", 1, 2, tmp_path / "c", host="0.0.0.0", advertise="10.0.0.7")
    plain.stage, plain.port = SimpleNamespace(part=(1, 2)), 40123
    assert (plain.announcement().host, plain.announcement().port) == ("10.0.0.7", 40123)
    with pytest.raises(ValueError, match="advertise"):
        StageServer(st, "run", pub, "p0", 1, 2, tmp_path / "c", advertise="h:99999")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_a_process_reports_its_own_peak_memory_not_its_parents():
    """On Linux ``ru_maxrss`` carries the parent's peak across fork and exec: a stage started by a
    big process (a benchmark holding a model) would log the parent's peak as its own."""
    import subprocess
    import sys

    ballast = np.ones(300 << 20, np.uint8)  # 300 MiB touched in this (the parent) process
    code = ("import resource; from stoa.fleet.stages.server import peak_rss_mb; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, peak_rss_mb())")
    inherited, own = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                               check=True).stdout.split())
    assert ballast.sum() > 0 and inherited > 300 and own < 200, (inherited, own)


# -- a remote pipeline over TCP --------------------------------------------------------------------

torch = pytest.importorskip("torch", reason="the torch engine needs torch")

from test_torch_pipeline import CONFIG, SAMPLING, assert_same_episodes, make_env, requests  # noqa: E402
from test_torch_pipeline import single, tiny  # noqa: E402,F401 - fixtures


def serve(service, srv: socket.socket, stop: threading.Event) -> None:
    conn, _ = srv.accept()
    with conn:
        try:
            while not stop.is_set():
                f = read_frame(conn, 1 << 26)
                out = service.handle(f)
                if out is not None:
                    write_frame(conn, out)
        except FrameError as e:
            try:
                write_frame(conn, Frame("error", {"message": str(e)}))
            except OSError:
                pass


class Link:
    """A TCP channel to one stage that counts what came back: per ``want``, the rows asked for
    and the array bytes answered."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.rows: dict[str, int] = {}
        self.down: dict[str, int] = {}

    def send(self, f: Frame) -> None:
        write_frame(self.sock, f)

    def request(self, f: Frame) -> Frame:
        self.send(f)
        return self.receive(f)

    def receive(self, f: Frame | None = None) -> Frame:
        out = read_frame(self.sock, 1 << 26)
        want = str(f.meta.get("want")) if f is not None else "queued"
        self.rows[want] = self.rows.get(want, 0) + (f.arrays[0].shape[0] if f is not None and f.arrays else 0)
        self.down[want] = self.down.get(want, 0) + sum(a.nbytes for a in out.arrays)
        return out


@pytest.mark.parametrize("parts,micro", [([(0, 2), (2, 4)], 1), ([(0, 1), (1, 3), (3, 4)], 1),
                                         ([(0, 2), (2, 4)], 2), ([(0, 1), (1, 3), (3, 4)], 3)])
def test_a_remote_pipeline_plays_the_single_engines_episodes(tiny, single, parts, micro):  # noqa: F811
    from stoa.backends.torch.pipeline import Stage
    from stoa.backends.torch.remote import RemotePipeline, RemoteStage, StageService

    stop, threads, remote = threading.Event(), [], []
    spec_layers = parts[-1][1]
    for part in parts[1:]:
        st = Stage(tiny, part, single.state)
        srv = socket.create_server(("127.0.0.1", 0))
        t = threading.Thread(target=serve, args=(StageService(st, CONFIG.max_batch, 1024), srv, stop), daemon=True)
        t.start()
        threads.append(t)
        remote.append(RemoteStage(part, spec_layers, st.decoder.spec.hidden_size, st.decoder.spec.vocab_size,
                                  Link(srv.getsockname()[1])))
    pipe = RemotePipeline(tiny, Stage(tiny, parts[0], single.state), remote, config=CONFIG)
    pipe.micro = micro  # micro-batches go round one behind the other: the same episodes
    from stoa.fleet.parity import join_check

    assert join_check(pipe, tiny) is None and pipe.built_config == single.built_config  # a driver's join check
    want = single.rollout(make_env, requests(), SAMPLING)
    got = pipe.rollout(make_env, requests(), SAMPLING)
    assert_same_episodes(got, want)
    assert any(len(e.segments) > 2 for e in got)
    # The last stage draws: no logits cross a link, 12 bytes a drawn row come back (id and log-prob).
    last = remote[-1].channel
    drawn = last.rows.get("draw", 0) if micro == 1 else sum(e.num_model_tokens for e in got)
    assert "logits" not in last.rows and drawn >= sum(e.num_model_tokens for e in got) > 0
    if micro == 1:
        assert last.down["draw"] == 12 * last.rows["draw"]
    else:  # the draws were sent ahead and collected later, micro-batch by micro-batch
        assert "draw" not in last.rows and last.down["queued"] > 0
    from stoa.backends.torch.remote import micro_batches

    assert micro_batches(3, 0.0005) == 1 and micro_batches(3, 0.04) == 3  # a quick link needs none
    # A draw with sampling settings out of bounds is refused before it touches a tensor.
    service = StageService(Stage(tiny, parts[-1], single.state), CONFIG.max_batch, 1024)
    service.handle(Frame("slots", {"slots": 2}))
    draw = {"longest": 1, "want": "draw", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "sampler": "auto"}
    arrays = (np.zeros((1, 1, 128), np.float32), np.zeros(1, np.int64), np.zeros(1, np.int64))
    assert service.handle(Frame("forward", draw, arrays)).arrays[0].shape == (1,)
    for key, value in (("temperature", 0.0), ("top_p", 1.5), ("top_k", -1), ("sampler", "gpu!")):
        with pytest.raises(FrameError, match=key):
            service.handle(Frame("forward", {**draw, key: value}, arrays))
    # A frame outside the stage's bounds is refused and closes the connection.
    out = remote[0].channel.request(Frame("forward", {"longest": 5, "want": "hidden"},
                                          (np.zeros((99, 1, 128), np.float32), np.zeros(99, np.int64))))
    assert out.op == "error" and "rows" in out.meta["message"]
    stop.set()


def test_a_stage_that_leaves_because_the_run_finished_drops_no_cohort(tmp_path):
    """The stages stop when the run's finish marker appears; a driver mid-cohort then loses its
    connection. That is the end of the run, not a failed stage: the driver stops, counting nothing."""
    from types import SimpleNamespace

    from stoa.fleet.stages.driver import PipelineWorker, StageRing, StageWeights
    from stoa.transport.exchange import mark_finished
    from stoa.transport.signing import generate_private_key

    key, st = generate_private_key(), LocalStore(tmp_path / "store")
    w = PipelineWorker(st, "run", key.public_key(), "drv", tmp_path / "cache", pipeline="p0", stages=2)
    ring = StageRing(st, "run", "p0", [(0, 1), (1, 2)], 2, True, 8, 16, 1 << 20)
    w.weights = StageWeights(st, "run", key.public_key(), (0, 1), 2, True, ring)

    def broken(*_):
        raise BrokenPipeError(32, "Broken pipe")

    w.engine = SimpleNamespace(rollout=broken)
    cohort = SimpleNamespace(seq=3, requests=[], sampling=None)
    assert w._generate(None, cohort)[0] == [] and w.rig.dropped_cohorts == 1 and not w._stop  # a failed stage
    mark_finished(st, "run", key, 4)
    assert w._generate(None, cohort)[0] == [] and w.rig.dropped_cohorts == 1 and w._stop
    assert w._stop_reason == "the run finished" and w.weights.damaged
