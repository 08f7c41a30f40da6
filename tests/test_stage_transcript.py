"""Signed per-step transcripts and blame: stages (threads of this process, over TCP) sign every
answer of a cohort; the driver checks each signature as it comes, and a recomputation of the
stages from the recorded frames names the stage whose outputs its layers do not make. Also the
memory cap held while a stage runs. CPU only."""

from __future__ import annotations

import gc
import socket
import threading

import numpy as np
import pytest

from stoa.fleet.stages import transcript as T
from stoa.transport.frames import Frame, FrameError, read_frame, write_frame
from stoa.transport.signing import generate_private_key, key_id
from stoa.transport.store import LocalStore

torch = pytest.importorskip("torch", reason="the torch engine needs torch")

from test_torch_pipeline import CONFIG, MODEL, SAMPLING, assert_same_episodes, make_env, requests  # noqa: E402
from test_torch_pipeline import single, tiny  # noqa: E402,F401 - fixtures

PARTS = [(0, 1), (1, 3), (3, 4)]


def serve(service, signer, srv: socket.socket, stop: threading.Event, corrupt: float = 0.0) -> None:
    """A stage process's loop (:class:`stoa.fleet.stages.server.StageServer`'s frame handling):
    ``corrupt`` > 0 adds noise to every hidden state it answers (on the last stage: draws the next
    token id instead of the rule's), and signs the result."""
    conn, _ = srv.accept()
    g = torch.Generator().manual_seed(0)
    with conn:
        try:
            while not stop.is_set():
                f = read_frame(conn, 1 << 26)
                if f.op == "cohort":
                    signer.begin(f.meta.get("id"))
                    service.reset()
                    continue
                signer.received(f)
                out = service.handle(f)
                if out is None:
                    continue
                if corrupt and out.arrays and out.arrays[0].ndim == 3:  # hidden states: noise
                    y = torch.from_numpy(out.arrays[0])
                    out = Frame(out.op, out.meta, ((y + corrupt * y.std() * torch.randn(y.shape, generator=g)).numpy(),))
                elif corrupt and out.arrays:  # draws: another token than the rule's
                    out = Frame(out.op, out.meta, ((out.arrays[0] + 1) % MODEL.vocab_size, out.arrays[1]))
                write_frame(conn, signer.sign(out) if f.op in T.ANSWERED else out)
        except (FrameError, OSError):
            pass


class Pipe:
    """A driver (a :class:`StageRing` with links set by hand, no store discovery) and stages 1..N-1
    in threads, each signing with its key; ``liar`` adds noise, ``forger`` signs with another key."""

    def __init__(self, tiny, state, liar: int = 0, forger: int = 0, frames: bool = True) -> None:
        from stoa.backends.torch.pipeline import Stage
        from stoa.backends.torch.remote import RemotePipeline, StageService
        from stoa.fleet.stages.driver import StageLink, StageRing

        self.stop, self.keys = threading.Event(), {}
        self.ring = StageRing(LocalStore("/nonexistent"), "run", "p0", PARTS, MODEL.num_layers, True,
                              MODEL.hidden_size, MODEL.vocab_size, 1 << 26, keep=2, frames=frames)
        for i, part in enumerate(PARTS[1:], 1):
            key = self.keys[i] = generate_private_key()
            signer = T.StepSigner(generate_private_key() if i == forger else key, "run", "p0", i)
            srv = socket.create_server(("127.0.0.1", 0))
            service = StageService(Stage(tiny, part, state), CONFIG.max_batch, 1024)
            threading.Thread(target=serve, args=(service, signer, srv, self.stop, 0.5 if i == liar else 0.0),
                             daemon=True).start()
            link = StageLink("127.0.0.1", srv.getsockname()[1], 1 << 26)
            self.ring.links[i], self.ring.remote[i - 1].channel = link, link
            self.ring.recorders[i] = T.Recorder("run", "p0", i, key.public_key())
        self.engine = RemotePipeline(tiny, Stage(tiny, PARTS[0], state), self.ring.remote, version=0, config=CONFIG)
        self.engine.begin = lambda: self.ring.begin(1)  # the version of the published shares

    def close(self) -> None:
        self.stop.set()
        self.ring.drop()


def honest_service(tiny, state):
    from stoa.backends.torch.pipeline import Stage
    from stoa.backends.torch.remote import StageService

    return lambda i: StageService(Stage(tiny, PARTS[i], state), CONFIG.max_batch, 1024).handle


def test_an_honest_transcript_replays_and_a_lying_stage_is_named(tiny, single):  # noqa: F811
    honest = Pipe(tiny, single.state)
    try:
        want = single.rollout(make_env, requests(3, 2), SAMPLING)
        assert_same_episodes(honest.engine.rollout(make_env, requests(3, 2), SAMPLING), want)  # signing changes nothing
        t = honest.ring.transcript
        assert sorted(t.steps) == [1, 2] and all(len(s) > 5 for s in t.steps.values())
        assert all(T.check_step(s.signed, honest.keys[i].public_key())["step"] == k
                   for i, steps in t.steps.items() for k, s in enumerate(steps))
        assert T.blame(t, honest_service(tiny, single.state)) is None  # every stage's outputs are its layers'
        first = t.cohort
        honest.engine.rollout(make_env, requests(2, 2), SAMPLING)  # a new cohort, a new id, steps from 0
        assert honest.ring.transcript.cohort != first and len(honest.ring.kept) == 2
        assert T.blame(honest.ring.transcript, honest_service(tiny, single.state)) is None
    finally:
        honest.close()
    liar = Pipe(tiny, single.state, liar=1)
    try:
        liar.engine.rollout(make_env, requests(3, 2), SAMPLING)  # its signatures verify: it signs its lie
        got = T.blame(liar.ring.transcript, honest_service(tiny, single.state))
        assert got is not None and got.stage == 1 and got.key_id == key_id(liar.keys[1].public_key())
        assert got.step == 0 and "off by" in got.why  # its first answer already differs
        # Stage 2 computed honestly on the liar's activations: judged on its own inputs, it is not blamed.
        assert T.blame(liar.ring.transcript, honest_service(tiny, single.state), [2]) is None
    finally:
        liar.close()


def test_a_step_that_does_not_verify_refuses_the_stage(tiny, single):  # noqa: F811
    p = Pipe(tiny, single.state, forger=2)
    try:
        with pytest.raises(T.TranscriptError, match="signed by key") as e:
            p.engine.rollout(make_env, requests(2, 2), SAMPLING)
        assert e.value.stage == 2
    finally:
        p.close()
    # A signed step replayed against other frames: the signature holds, the step is not theirs.
    key = generate_private_key()
    rec, signer = T.Recorder("run", "p0", 1, key.public_key()), T.StepSigner(key, "run", "p0", 1)
    rec.begin(T.Transcript(T.new_cohort()))
    signer.begin(rec.transcript.cohort)
    x = Frame("forward", {"longest": 1, "want": "hidden"}, (np.zeros((1, 1, 4), np.float32), np.zeros(1, np.int64)))
    signer.received(x)
    rec.sent(x)
    answer = signer.sign(Frame("out", {}, (np.ones((1, 1, 4), np.float32),)))
    tampered = Frame("out", answer.meta, (np.full((1, 1, 4), 2.0, np.float32),))
    with pytest.raises(T.TranscriptError, match="fields output"):
        rec.answered(tampered)
    with pytest.raises(T.TranscriptError, match="unsigned"):
        rec.sent(x)
        rec.answered(Frame("out", {}, answer.arrays))
    body = T.check_step(answer.meta[T.SIGNED].encode(), key.public_key())
    assert body["stage"] == 1 and body["step"] == 0 and body["cohort"] == rec.transcript.cohort
    with pytest.raises(T.TranscriptError):
        T.check_step(answer.meta[T.SIGNED].encode(), generate_private_key().public_key())


def test_the_driver_spot_checks_before_upload_and_drops_a_lying_stage(tiny, single, tmp_path):  # noqa: F811
    """The driver recomputes the stages of a cohort from the run's signed shares before it uploads:
    an honest cohort passes; a lying stage's cohort is not uploaded (so the trainer never sees it
    and never charges the driver's key), the stage is dropped, and its key is refused on reconnect."""
    from stoa.fleet.stages import discovery
    from stoa.fleet.stages.driver import StageRefused, StageWeights
    from stoa.fleet.stages.spotcheck import SpotCheck
    from stoa.transport.chain import WeightPublisher

    store, run_key = LocalStore(tmp_path), generate_private_key()
    WeightPublisher(store, "run", run_key).publish(1, single.state)

    def weights(p: Pipe, probation: int) -> StageWeights:
        w = StageWeights(store, "run", run_key.public_key(), PARTS[0], MODEL.num_layers, True, p.ring)
        w.live = p.engine
        w.check = SpotCheck(store, "run", run_key.public_key(), tiny, PARTS, MODEL.num_layers, True, "auto",
                            CONFIG.max_batch, 1024, rate=0.0, probation=probation, seed=0)
        return w

    honest = Pipe(tiny, single.state)
    try:
        w = weights(honest, 1)
        honest.engine.rollout(make_env, requests(2, 2), SAMPLING)
        assert w.check.due(honest.ring.transcript) == [1, 2] and w.verified()
        assert w.check.bytes_read > 0 and sorted(w.check.passed.values()) == [1, 1]
        honest.engine.rollout(make_env, requests(2, 2), SAMPLING)
        assert w.check.due(honest.ring.transcript) == [] and w.verified()  # past probation, rate 0: none checked
    finally:
        honest.close()
    liar = Pipe(tiny, single.state, liar=2)
    try:
        w = weights(liar, 2)
        liar.engine.rollout(make_env, requests(2, 2), SAMPLING)
        assert not w.verified()  # not uploaded
        assert [b.stage for b in w.blames] == [2] and 2 not in liar.ring.links and w.damaged
        assert "values differ" in w.blames[0].why  # the last stage drew other tokens than the rule's
        bad = key_id(liar.keys[2].public_key())
        assert bad in liar.ring.blamed and w.check.passed.get(key_id(liar.keys[1].public_key())) == 1
        discovery.announce(store, "run", "p0", discovery.Announcement(2, 3, PARTS[2], "127.0.0.1", 9, "", 1e12),
                           liar.keys[2])
        liar.ring.store, liar.ring.key, liar.ring.stage_keys = store, generate_private_key(), frozenset({bad})
        with pytest.raises(StageRefused, match="blamed"):  # named by the driver's own operator, still refused
            liar.ring.connect()
    finally:
        liar.close()
    # Unchecked (no probation, rate 0), the cohort would go up; once the trainer's report counts a
    # rejection, the driver recomputes the kept transcripts and names the same stage.
    late = Pipe(tiny, single.state, liar=1)
    try:
        w = weights(late, 0)
        late.engine.rollout(make_env, requests(2, 2), SAMPLING)
        assert w.verified() and not w.blames
        found = w.blame_kept()
        assert found is not None and found.stage == 1 and 1 not in late.ring.links
        assert key_id(late.keys[1].public_key()) in late.ring.blamed
    finally:
        late.close()


def test_a_transcript_without_frames_holds_signatures_only(tiny, single):  # noqa: F811
    p = Pipe(tiny, single.state, frames=False)
    try:
        p.engine.rollout(make_env, requests(2, 2), SAMPLING)
        t = p.ring.transcript
        assert t.nbytes() < 1 << 16 and all(not s.sent for steps in t.steps.values() for s in steps)
        with pytest.raises(ValueError, match="kept no frames"):
            T.blame(t, honest_service(tiny, single.state))
    finally:
        p.close()


# -- the memory cap while running ----------------------------------------------------------------


def test_a_stage_refuses_a_kv_cache_over_its_cap(tiny, single):  # noqa: F811
    from stoa.backends.torch.pipeline import Stage
    from stoa.backends.torch.remote import StageService
    from stoa.fleet.stages.memory import RunningCap

    stage = Stage(tiny, PARTS[1], single.state)
    mem = stage.memory()
    fits = (mem.state + mem.weights + mem.kv_per_token * 4 * 256) / 2**20  # 4 rows of one 256-position block
    service = StageService(stage, 8, 1024, RunningCap(fits + 0.01, mem.state + mem.weights, mem.kv_per_token).kv_refusal)
    service.handle(Frame("slots", {"slots": 4}))
    service.handle(Frame("ensure", {"length": 200}))
    with pytest.raises(FrameError, match="over its memory cap"):
        service.handle(Frame("ensure", {"length": 300}))  # a second block of positions
    with pytest.raises(FrameError, match="over its memory cap"):
        service.handle(Frame("slots", {"slots": 8}))
    assert stage.cache.capacity == 256 and stage.cache.shape[0] == 4  # nothing was allocated for them
    x = (np.zeros((1, 1, MODEL.hidden_size), np.float32), np.array([299], np.int64))
    with pytest.raises(FrameError, match="over its memory cap"):  # a forward reaching past the block
        service.handle(Frame("forward", {"longest": 300, "want": "hidden"}, x))


def test_a_process_over_its_running_limit_refuses_further_work(tmp_path):
    from types import SimpleNamespace

    from stoa.fleet.stages.memory import RunningCap, rss_mib
    from stoa.fleet.stages.server import EXIT_CONFIG, StageServer

    gc.collect()  # earlier tests' garbage freed later would lower the resident set under the ballast
    cap = RunningCap(10.0, 1 << 20, 1024, headroom_mb=64.0)
    cap.ready()
    assert cap.limit_mb == pytest.approx(rss_mib() + 9.0 + 64.0, abs=8.0) and cap.over() is None
    ballast = np.ones(256 << 20, np.uint8)  # 256 MiB touched: over the limit
    why = cap.over()
    assert ballast.sum() and why and "over the running limit" in why
    del ballast
    assert cap.over() == why  # once over, for good
    assert RunningCap(None, 0, 0).over() is None and RunningCap(None, 0, 0).kv_refusal(10**6, 10**6) is None
    # The stage answers the frame in hand with the reason, stops serving and announcing, exits 2.
    server = StageServer(LocalStore(tmp_path / "s"), "run", generate_private_key().public_key(), "p0", 1, 2,
                         tmp_path / "c")
    server.cap, server.max_payload = cap, 1 << 20
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    with srv, a, b:
        write_frame(a, Frame("hello"))
        server._driver(b, "peer", SimpleNamespace(handle=lambda f: pytest.fail("served over the cap")))
        out = read_frame(a, 1 << 20)
    assert out.op == "error" and "over the running limit" in out.meta["message"]
    assert server.stop.is_set() and server.exit_code == EXIT_CONFIG


def test_an_announced_host_is_printable_and_shown_escaped(tmp_path):
    from stoa.fleet.stages import discovery
    from stoa.fleet.stages.driver import shown

    st, key = LocalStore(tmp_path), generate_private_key()
    for host in ("evil\n2026-01-01 INFO forged line", "a\x1b[31mred", "tab\there", "x" * 256):
        discovery.announce(st, "run", "p0", discovery.Announcement(1, 2, (1, 2), host, 1, "", 1.0), key)
        with pytest.raises(ValueError, match="not a stage announcement"):
            discovery.read_announcement(st, "run", "p0", 1)
    assert shown("evil\nline\x1b[31m" + "y" * 200) == "evil?line?[31m" + "y" * 63 + "..."
