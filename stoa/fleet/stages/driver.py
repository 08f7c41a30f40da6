"""The driver of a pipeline: ``stoa worker --stages N --pipeline ID``.

A :class:`PipelineWorker` is a fleet :class:`~stoa.fleet.worker.worker.Worker` (the same loop,
key, numbers, bindings, uploads) built with a :class:`PipelineRig` (its one seam,
:mod:`stoa.fleet.worker.rig`), whose engine is a
:class:`~stoa.backends.torch.remote.RemotePipeline`: it holds stage 0 (the embeddings and the
first layers) and plays each cohort through stages 1 .. N-1, other processes found through the
store (:mod:`stoa.fleet.stages.discovery`). What changes against a whole-model worker:

* **weights**: :class:`StageWeights` follows the chain for stage 0's share only
  (:class:`~stoa.transport.chain.ShareSubscriber`), and before every cohort brings every remote
  stage to the cohort's version: each answers its share hashes, which must equal the ones the
  run's key signed in that version's manifest, else the stage is dropped and nothing is made;
* **failure**: a stage that dies or breaks the channel mid-cohort voids the cohort (nothing of it
  is uploaded; its number stays the worker's and is made again), the links are dropped, and the
  next cohort waits (backing off) until every stage is announced, reachable and at the version;
* **memory**: with ``max_memory_mb`` the worker refuses to start (exit 2) when stage 0's need is
  over it, and stops between cohorts (exit 2) when its resident set passes the running limit
  (:mod:`stoa.fleet.stages.memory`);
* **blame**: every remote stage signs each step of a cohort (:mod:`stoa.fleet.stages.transcript`),
  and before an upload the driver recomputes the stages its :class:`SpotCheck` picks from the
  cohort's transcript: a stage whose outputs differ is named, dropped and refused, and the cohort
  is not uploaded (:meth:`StageWeights.verified`); after a rejection the trainer reports, the kept
  transcripts are recomputed (:meth:`StageWeights.blame_kept`).

The batch is signed with the driver's key and judged by the trainer as any worker's: it
re-derives every token with the whole model, so a stage that computes wrong activations and
slips past the spot check gets the driver's batch refused, never trained on.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from stoa.backends.engine import stage_backend
from stoa.fleet.parity import join_check
from stoa.fleet.stages import discovery, tls
from stoa.fleet.stages.memory import RunningCap
from stoa.fleet.stages.spotcheck import SpotCheck
from stoa.fleet.stages.transcript import Blame, Recorder, Transcript, TranscriptError, new_cohort
from stoa.transport.frames import Frame, FrameError, read_frame, write_frame
from stoa.fleet.stages.server import model_shape, peak_rss_mb
from stoa.fleet.worker.worker import EXIT_CONFIG, Worker, WorkerExit
from stoa.transport import shares
from stoa.transport.chain import SyncResult
from stoa.transport.identity import printable, read_roster
from stoa.transport.signing import SignatureError
from stoa.transport.store import ObjectStore, StoreError

__all__ = ["PipelineRig", "PipelineWorker", "StageLink", "StageRefused", "StageRing", "StageWeights", "shown"]

log = logging.getLogger("stoa.worker")

_CONNECT_TIMEOUT_S = 5.0
_FRAME_TIMEOUT_S = 60.0


def shown(text: object, limit: int = 80) -> str:
    """A stranger's text (an announced host, a stage's message) as it may appear in a log line:
    printable ASCII only, at most ``limit`` characters (:func:`stoa.transport.identity.printable`)."""
    return printable(text, limit)


class StageRefused(ConnectionError):
    """A stage that cannot be used: gone, unannounced, stale, of other layers, or whose share
    hashes are not the signed ones."""


class StageLink:
    """A TCP connection to one stage process, speaking frames (a :class:`~stoa.backends.torch.remote.Channel`)."""

    def __init__(self, host: str, port: int, max_payload: int, context: ssl.SSLContext | None = None) -> None:
        raw = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock = context.wrap_socket(raw) if context is not None else raw  # the handshake, within the timeout
        except BaseException:
            raw.close()
            raise
        self.sock.settimeout(_FRAME_TIMEOUT_S)
        self.max_payload = max_payload
        self.sent = 0
        self.rtt = 0.0  # seconds of the hello's round trip (the driver's micro-batching)
        self.recorder: Recorder | None = None
        """Checks and records the stage's signed steps (set once the stage's key is known)."""

    def send(self, frame: Frame) -> None:
        self.sent += write_frame(self.sock, frame)
        if self.recorder is not None:
            self.recorder.sent(frame)

    def request(self, frame: Frame) -> Frame:
        self.send(frame)
        return self.receive(frame.op)

    def receive(self, op: str = "a frame") -> Frame:
        out = read_frame(self.sock, self.max_payload)
        if out.op == "error":
            raise StageRefused(f"the stage refused {op}: {shown(out.meta.get('message', ''), 400)}")
        if self.recorder is not None and out.op == "out":
            return self.recorder.answered(out)
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class StageRing:
    """The remote stages 1 .. N-1 of one pipeline: found, connected and checked.

    Args:
        store, run, pipeline: where the stages announce themselves.
        parts: every stage's layers (index 0: the driver's own).
        layers, tied, hidden, vocab: the model's shape.
        max_payload: most array bytes a stage's answer may carry.
        private_key: the driver's key (its announcement as stage 0, its side of each TLS link).
        public_key: the run's key (its roster says which stage keys are enrolled).
        stage_keys: key ids of the stages this driver accepts, besides the enrolled keys.
        keep: transcripts of the last cohorts kept with their frames (for blame after a
            rejection); the current cohort's is always kept.
        frames: whether transcripts keep the frames (needed to replay them), or only their
            hashes and signatures.
    """

    def __init__(self, store: ObjectStore, run: str, pipeline: str, parts: list[tuple[int, int]], layers: int,
                 tied: bool, hidden: int, vocab: int, max_payload: int, private_key: Any = None,
                 public_key: Any = None, stage_keys: Collection[str] = (), keep: int = 0, frames: bool = True) -> None:
        self.store, self.run, self.pipeline, self.parts = store, run, pipeline, parts
        self.key, self.public_key, self.stage_keys = private_key, public_key, frozenset(stage_keys)
        self.layers, self.tied, self.max_payload = layers, tied, max_payload
        self.links: dict[int, StageLink] = {}
        self.recorders: dict[int, Recorder] = {}
        self.remote = [stage_backend().RemoteStage(p, layers, hidden, vocab, _Gone(i)) for i, p in enumerate(parts) if i > 0]
        self.reconnects = 0
        self.blamed: dict[str, str] = {}
        """Stage key id -> why: keys this driver does not use again (this session)."""
        self.transcript: Transcript | None = None
        """The current (or last) cohort's transcript."""
        self.kept: collections.deque[Transcript] = collections.deque(maxlen=max(1, keep))
        self.frames = frames

    def begin(self, version: int | None) -> Transcript:
        """Open a new cohort's transcript: every stage is told the cohort's id (it starts its KV
        cache afresh and signs each answer from now on), and every link records its steps."""
        t = Transcript(new_cohort(), version, frames=self.frames)
        for i, link in sorted(self.links.items()):
            link.recorder = None
            link.send(Frame("cohort", {"id": t.cohort}))
            link.recorder = self.recorders[i]
            link.recorder.begin(t)
        self.transcript = t
        self.kept.append(t)
        return t

    def blame(self, i: int, why: str) -> None:
        """Stop using stage ``i``'s key (dropped now, refused at every later connect)."""
        rec = self.recorders.get(i)
        if rec is not None:
            from stoa.transport.signing import key_id, load_public_key

            self.blamed[key_id(load_public_key(rec.hex))] = why
        if i in self.links:
            self._lose(i)

    def ready(self) -> bool:
        return len(self.links) == len(self.parts) - 1

    def micro(self) -> int:
        """Micro-batches for the connected links (:func:`stoa.backends.torch.remote.micro_batches`)."""
        rtt = max((link.rtt for link in self.links.values()), default=0.0)
        return stage_backend().micro_batches(len(self.parts), rtt)

    def drop(self) -> None:
        """Close every link (after a failure mid-cohort: which stage broke is not always known)."""
        for i, link in self.links.items():
            link.close()
            self.remote[i - 1].channel = _Gone(i)
        self.links.clear()

    def connect(self) -> bool:
        """Connect every stage not connected; True when one was (the pipeline's caches are then stale).

        Raises:
            StageRefused: a stage is not announced, stale, unreachable or of other layers.
        """
        new = False
        enrolled: Collection[str] | None = None  # the roster, read once a connect and only if needed
        if not self.ready():
            self._announce()
        for i in range(1, len(self.parts)):
            if i in self.links:
                continue
            try:
                a = discovery.read_announcement(self.store, self.run, self.pipeline, i)
            except ValueError as e:
                raise StageRefused(f"stage {i}'s announcement: {e}") from None
            if a is None or a.stale():
                raise StageRefused(f"stage {i} of pipeline {self.pipeline} is {'not announced' if a is None else 'stale'}")
            if (a.stages, a.part) != (len(self.parts), self.parts[i]):
                raise StageRefused(f"stage {i} announces layers {a.part} of {a.stages} stages; this pipeline wants "
                                   f"{self.parts[i]} of {len(self.parts)}")
            if a.key_id in self.blamed:
                raise StageRefused(f"stage {i}'s key {a.key_id} was blamed for wrong outputs "
                                   f"({shown(self.blamed[a.key_id], 200)}): not used again")
            if enrolled is None and a.key_id not in self.stage_keys:
                enrolled = self._enrolled()
            why = discovery.Allowed(self.stage_keys, enrolled or ()).refusal(a.key_id, f"stage {i}")
            if why:
                raise StageRefused(why)
            try:
                link = StageLink(a.host, a.port, self.max_payload, tls.context("client", self.key, a.cert.encode("ascii")))
                t0 = time.perf_counter()
                hello = link.request(Frame("hello"))
                link.rtt = time.perf_counter() - t0
            except OSError as e:
                raise StageRefused(f"stage {i} at {shown(a.host)}:{a.port}: {type(e).__name__}: {shown(e, 300)}") from None
            if hello.op != "hello" or hello.meta.get("part") != list(self.parts[i]) or hello.meta.get("layers") != self.layers:
                link.close()
                raise StageRefused(f"stage {i} at {shown(a.host)}:{a.port} says {shown(hello.meta, 200)}")
            self.recorders[i] = Recorder(self.run, self.pipeline, i, a.key)
            self.links[i] = link
            self.remote[i - 1].channel = link
            self.reconnects += 1
            new = True
            log.info("connected stage %d (layers %s, key %s) at %s:%d", i, self.parts[i], a.key_id, shown(a.host),
                     a.port)
        return new

    def _announce(self) -> None:
        """Announce this driver as stage 0 (its key and certificate: what its stages accept)."""
        a = discovery.Announcement(0, len(self.parts), self.parts[0], "", 0, "", time.time())
        try:
            discovery.announce(self.store, self.run, self.pipeline, a, self.key)
        except StoreError as e:
            raise StageRefused(f"could not announce the driver: {e}") from None

    def _enrolled(self) -> Collection[str]:
        """Key ids the run's roster enrolls (none when it does not read)."""
        try:
            return set(read_roster(self.store, self.run, self.public_key).enrolled)
        except (SignatureError, StoreError) as e:
            log.warning("the run's roster does not read (%s): only --stage-keys are accepted", e)
            return set()

    def sync(self, version: int, signed: dict[str, str]) -> dict[int, float]:
        """Bring every stage to ``version`` and check its share hashes against ``signed`` (the
        version's manifest); the stages' peak RSS (MiB). A stage that fails is dropped.

        Raises:
            StageRefused: a stage could not get there, or answered other hashes.
        """
        rss = {}
        for i, link in list(self.links.items()):
            want = {k: signed.get(k) for k in shares.stage_shares(self.parts[i], self.layers, self.tied)}
            try:
                out = link.request(Frame("sync", {"version": int(version)}))
            except OSError:
                self._lose(i)
                raise
            got = out.meta.get("shares")
            if out.op != "synced" or out.meta.get("version") != version or got != want:
                self._lose(i)
                raise StageRefused(f"stage {i} answered version {shown(out.meta.get('version'), 40)} with share hashes that "
                                   f"are not the ones signed for version {version}: dropped")
            rss[i] = float(out.meta.get("peak_rss_mb", 0.0)) if isinstance(out.meta.get("peak_rss_mb"), (int, float)) else 0.0
        return rss

    def _lose(self, i: int) -> None:
        self.links.pop(i).close()
        self.remote[i - 1].channel = _Gone(i)


class _Gone:
    """The channel of a stage not connected: every use fails as a lost connection."""

    def __init__(self, i: int) -> None:
        self.i = i

    def send(self, frame: Frame) -> None:
        raise StageRefused(f"stage {self.i} is not connected")

    def request(self, frame: Frame) -> Frame:
        raise StageRefused(f"stage {self.i} is not connected")

    def receive(self) -> Frame:
        raise StageRefused(f"stage {self.i} is not connected")


class StageWeights:
    """The driver's weights: stage 0's share of the chain, and the remote stages kept at its
    version. Stands where a whole-model worker has :class:`~stoa.fleet.worker.follower.LiveWeights`
    (the members :class:`~stoa.fleet.worker.worker.Worker` uses)."""

    def __init__(self, store: ObjectStore, run: str, public_key: Any, part: tuple[int, int], layers: int, tied: bool,
                 ring: StageRing) -> None:
        from stoa.transport.chain import ShareSubscriber

        self.sub = ShareSubscriber(store, run, public_key, part, layers, tied)
        self.ring = ring
        self.live: Any = None  # the RemotePipeline, once built
        self.newest: int | None = None
        self.bytes_read = 0
        self.damaged = False
        self.stage_rss: dict[int, float] = {}
        self.check: SpotCheck | None = None
        """Recomputes stages of each cohort before its upload (set by the rig; None: no check)."""
        self.blames: list[Blame] = []

    def head(self) -> int | None:
        self.newest = self.sub.head()
        return self.newest

    def join(self, version: int | None = None) -> SyncResult:
        r = self.sub.sync(None, version=version)
        self.bytes_read += r.bytes_read
        return r

    def bring_stages(self, version: int) -> None:
        """Connect the missing stages and bring all to ``version``, checked against its manifest."""
        if self.ring.connect() and self.live is not None:
            self.live.reset()
        m = self.sub.manifest(version)
        assert m.shares is not None  # the share subscriber refuses manifests without them
        self.stage_rss = self.ring.sync(version, dict(m.shares.hashes))

    def catch_up(self, version: int | None = None) -> SyncResult:
        """Stage 0 to ``version`` (None: the head), then every remote stage to the same version."""
        assert self.live is not None
        r = self.live.stages[0].sync(self.sub, version)
        self.bytes_read += r.bytes_read
        for p in r.problems:
            log.warning("stage 0 sync: %s", p)
        self.bring_stages(r.version)
        self.live.version = r.version
        self.damaged = False
        return r

    def follow(self, lag: int = 0) -> int | None:
        head = self.head()
        v = self.live.version if self.live is not None else None
        if head is not None and v is not None and (head - lag != v or self.damaged or not self.ring.ready()):
            self.catch_up(head - lag if lag else None)
        return head

    def verified(self, repair: bool = True) -> bool:
        """Whether the cohort just made may be uploaded. Every share (local and remote) was checked
        before it began; here the spot check recomputes the stages it picks from the cohort's
        signed transcript (:class:`~stoa.fleet.stages.spotcheck.SpotCheck`). A stage whose outputs
        differ is blamed: named in the log, dropped and refused from now on; the cohort is then
        not uploaded (False), and its number's work is made again with another stage."""
        t = self.ring.transcript
        if self.check is None or t is None or not t.steps:
            return True
        found = self.check.check(t)
        if found is None:
            return True
        self.blames.append(found)
        why = f"step {found.step} of cohort {found.cohort}: {found.why}"
        log.error("stage %d (key %s) computed outputs its layers do not make from its signed inputs (%s): the "
                  "cohort is not uploaded, and the stage is dropped and not used again", found.stage, found.key_id,
                  shown(why, 300))
        self.ring.blame(found.stage, why)
        self.damaged = True
        return False

    def blame_kept(self) -> Blame | None:
        """After the trainer rejected one of this driver's batches: recompute every stage of every
        transcript still kept (``keep`` cohorts) and blame the first stage that differs (dropped
        and refused, as after a spot check). None when every kept cohort replays clean."""
        if self.check is None:
            return None
        for t in list(self.ring.kept):
            if not t.frames or not t.steps:
                continue
            found = self.check.check(t, sorted(t.steps))
            if found is not None:
                self.blames.append(found)
                log.error("after a rejection: stage %d (key %s) computed outputs its layers do not make from its "
                          "signed inputs (step %d of cohort %s: %s): dropped and not used again", found.stage,
                          found.key_id, found.step, found.cohort, shown(found.why, 200))
                self.ring.blame(found.stage, f"step {found.step} of cohort {found.cohort}: {found.why}")
                self.damaged = True
                return found
        return None

    def keep(self) -> str:
        return ""


class PipelineRig:
    """The :class:`~stoa.fleet.worker.rig.Rig` of a pipeline's driver: it holds stage 0 of
    ``stages`` and plays each cohort through pipeline ``pipeline``'s other stages.

    Args:
        pipeline: the pipeline's id (its stages announce under it).
        stages: how many stages (>= 2): this process and ``stages - 1`` stage processes.
        max_memory_mb: refuse to start when stage 0's need (share + float weights + a full KV
            cache of ``rollout.max_batch`` rows of ``rollout.max_episode_tokens``) is over this.
        stage_keys: key ids of the stages this driver accepts, besides the keys enrolled in the
            run's roster (a stage with another key is refused before anything is sent to it).
        spot_check: the chance per cohort that one remote stage (besides those on probation) is
            recomputed before the upload (:class:`~stoa.fleet.stages.spotcheck.SpotCheck`).
        probation: cohorts of a newly seen stage key recomputed, every one, before it is only sampled.
        keep: transcripts of the last cohorts kept with their frames (to blame a stage after the
            trainer's report counts a rejection: :meth:`StageWeights.blame_kept`).
    """

    def __init__(self, pipeline: str, stages: int, max_memory_mb: float | None = None, stage_keys: Collection[str] = (),
                 spot_check: float = 0.125, probation: int = 2, keep: int = 1):
        if stages < 2:
            raise ValueError("a pipeline has at least 2 stages")
        self.pipeline, self.stages, self.max_memory_mb = discovery.check_pipeline_id(pipeline), stages, max_memory_mb
        self.stage_keys = frozenset(stage_keys)
        self.spot_check, self.probation, self.keep = spot_check, probation, keep
        self.need_mb = 0.0
        self.dropped_cohorts = 0
        self.cap: RunningCap | None = None
        self._stage_waits = 0
        self._rejected: int | None = None  # our rejected batches in the trainer's last report
        self._report_read = 0.0

    def weights(self, worker: Worker, cfg: Any, model_dir: Path) -> Any:
        layers, tied, hidden, vocab = model_shape(model_dir)
        parts = stage_backend().split_layers(layers, self.stages)
        rc = cfg.rollout
        max_payload = rc.max_batch * (2 * rc.max_episode_tokens + 64) * max(hidden, vocab) * 4 + (1 << 16)
        frames = self.spot_check > 0 or self.probation > 0 or self.keep > 1
        ring = StageRing(worker.store, worker.run_name, self.pipeline, parts, layers, tied, hidden, vocab, max_payload,
                         worker.private_key, worker.public_key, self.stage_keys, self.keep, frames)
        w = StageWeights(worker.store, worker.run_name, worker.public_key, parts[0], layers, tied, ring)
        if frames:
            w.check = SpotCheck(worker.store, worker.run_name, worker.public_key, model_dir, parts, layers, tied,
                                rc.engine_mode, rc.max_batch, 2 * rc.max_episode_tokens + 64, self.spot_check,
                                self.probation)
        return w

    def engine(self, worker: Worker, cfg: Any, model_dir: Path, first: SyncResult) -> Any:
        sb = stage_backend()
        w = worker.weights
        assert isinstance(w, StageWeights)
        rc = cfg.rollout
        stage = sb.Stage(model_dir, w.sub.part, first.state, rc.engine_mode)
        stage.version = first.version
        self.need_mb = stage.memory().total(rc.max_batch, rc.max_episode_tokens) / 2**20
        if self.max_memory_mb is not None and self.need_mb > self.max_memory_mb:
            raise WorkerExit(EXIT_CONFIG, f"stage 0 of {self.stages} needs {self.need_mb:.1f} MiB (weights + KV for "
                                          f"{rc.max_batch} rows of {rc.max_episode_tokens} positions), over "
                                          f"--max-memory-mb {self.max_memory_mb:.1f}: use more stages")
        while not worker.stopped:
            try:
                w.bring_stages(first.version)
                break
            except (OSError, FrameError) as e:
                if worker.finished():  # its stages stop with the run: nothing to wait for
                    raise WorkerExit(0, "the run finished while waiting for the pipeline's stages") from None
                worker.backoff(f"waiting for the stages of pipeline {self.pipeline}", e)
        else:
            raise WorkerExit(0, "stopped while waiting for the pipeline's stages")
        engine = sb.RemotePipeline(model_dir, stage, w.ring.remote, first.version,
                                   rc.engine_config(cfg.model.prompt_format), worker.worker_id, stage.mode)
        engine.micro = w.ring.micro()
        engine.begin = lambda: w.ring.begin(engine.version)  # each cohort's signed transcript
        mem = stage.memory()
        self.cap = RunningCap(self.max_memory_mb, mem.state + mem.weights, mem.kv_per_token)
        self.cap.ready()
        refused = join_check(engine, model_dir)  # the same check as a whole-model worker's
        if refused:
            raise WorkerExit(EXIT_CONFIG, refused)
        log.info("worker %s (key %s) drives pipeline %s: stage 0 of %d (layers %s, needs %.1f MiB) at version %d; "
                 "%d micro-batch(es) a decode step", worker.worker_id, worker.key_id, self.pipeline, self.stages,
                 stage.part, self.need_mb, first.version, engine.micro)
        return engine

    def ready(self, worker: Worker) -> bool:
        """Whether every stage is connected (a missing one is waited for, backing off up to 10 s,
        until the run finishes; a reconnected one is brought to the version before the next
        cohort)."""
        w = worker.weights
        assert isinstance(w, StageWeights)
        over = self.cap.over() if self.cap is not None else None
        if over:  # between cohorts: the last batch is uploaded, nothing in hand is lost
            raise WorkerExit(EXIT_CONFIG, f"driver of pipeline {self.pipeline}: {over}")
        self._heed_rejections(worker, w)
        if w.ring.ready():
            return True
        if worker.finished():  # the stages stop when the run finishes: do not wait for them
            worker.stop_for("the run finished")
            return False
        try:
            if w.ring.connect():
                w.live.reset()
                w.live.micro = w.ring.micro()
                w.damaged = True  # the next cohort's catch-up brings the new stage to its version
            self._stage_waits = 0
            return True
        except StageRefused as e:
            self._stage_waits += 1
            delay = min(10.0, 0.5 * 2 ** min(self._stage_waits - 1, 5))
            if self._stage_waits in (1, 5) or self._stage_waits % 20 == 0:
                log.warning("waiting for the stages of pipeline %s (%s); retrying in %.1fs", self.pipeline, e, delay)
            worker.beat("waiting")
            worker.sleep(delay)
            return False

    def _heed_rejections(self, worker: Worker, w: StageWeights) -> None:
        """Every 30 s, the trainer's signed trust report: when it counts more rejected batches of
        this driver's key than before, the kept transcripts are recomputed to blame a stage."""
        if w.check is None or time.time() - self._report_read < 30.0:
            return
        self._report_read = time.time()
        from stoa.fleet.trust.records import read_trust_report

        try:
            report = read_trust_report(worker.store, worker.run_name, worker.public_key)
        except (SignatureError, StoreError) as e:
            log.warning("the trainer's trust report does not read (%s)", shown(e, 200))
            return
        rec = report.workers.get(worker.key_id) if report is not None else None
        rejected = rec.rejected_batches if rec is not None else 0
        if self._rejected is not None and rejected > self._rejected:
            log.warning("the trainer rejected %d more of this driver's batches (last: %s): recomputing the kept "
                        "cohorts' stages", rejected - self._rejected, shown(rec.last_reason if rec else "", 160))
            if w.blame_kept() is None:
                log.warning("every kept cohort's stages recompute as signed: the rejection is not a stage's")
        self._rejected = rejected

    def failed(self, worker: Worker, seq: int, error: OSError) -> bool:
        """A lost stage, a broken frame, a timeout: the cohort is void. A stage that left because
        the run finished (its marker appeared mid-cohort) is no failure: the driver stops too."""
        assert isinstance(worker.weights, StageWeights)
        if isinstance(error, TranscriptError) and error.stage >= 0:  # a stage that signs what it did not do
            log.error("stage %d signed a step that does not verify (%s): dropped and not used again", error.stage,
                      shown(error, 300))
            worker.weights.ring.blame(error.stage, f"a bad signed step: {error}")
        worker.weights.ring.drop()
        worker.weights.damaged = True
        try:
            finished = worker.finished()
        except StoreError:
            finished = False
        if finished:
            log.info("the run finished during the cohort of number %d (its stages stop with it): nothing of it "
                     "is uploaded", seq)
            worker.stop_for("the run finished")
            return True
        self.dropped_cohorts += 1
        log.warning("a stage failed during the cohort of number %d (%s: %s): nothing of it is uploaded; it is "
                    "made again once every stage is back", seq, type(error).__name__, str(error)[:300])
        worker.sleep(1.0)
        return True

    def leave(self, worker: Worker) -> None:
        rss = worker.weights.stage_rss if isinstance(worker.weights, StageWeights) else {}
        log.info("driver: peak RSS %.1f MiB (stage 0's weights and KV need %.1f MiB); stages' peak RSS at their last "
                 "sync: %s MiB; %d cohorts dropped for a failed stage", peak_rss_mb(), self.need_mb,
                 ", ".join(f"{i}: {v:.1f}" for i, v in sorted(rss.items())) or "-", self.dropped_cohorts)
        if isinstance(worker.weights, StageWeights):
            worker.weights.ring.drop()


def PipelineWorker(*args: Any, pipeline: str, stages: int, max_memory_mb: float | None = None,  # noqa: N802
                   stage_keys: Collection[str] = (), **kwargs: Any) -> Worker:
    """A :class:`Worker` (same arguments) that drives pipeline ``pipeline`` of ``stages`` stages
    through its :class:`PipelineRig`; it keeps no weights between sessions unless asked."""
    kwargs.setdefault("keep_weights", False)
    check = {k: kwargs.pop(k) for k in ("spot_check", "probation", "keep") if k in kwargs}
    return Worker(*args, rig=PipelineRig(pipeline, stages, max_memory_mb, stage_keys, **check), **kwargs)
