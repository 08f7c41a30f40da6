"""One pipeline stage as a process: ``stoa stage --stage i/N``.

:meth:`StageServer.run`::

    fetch and verify the run (signed config + model files), as a worker does
    hold layers split_layers(L, N)[i]: join the chain for that share only (ShareSubscriber: range
        reads of the anchor, deltas, every byte checked against the signed per-share hashes)
    build the stage; refuse to start (exit 2) when its need (share + float weights + a full KV
        cache of rollout.max_batch rows of rollout.max_episode_tokens positions) is over --max-memory-mb
    listen on a TCP port; announce host:port, signed with the stage's key, under
        <run>/stages/<pipeline>/<i>.json every 5 s
    serve one driver at a time until the run finishes or a signal, over mutual TLS pinned to the
        driver's announced key (stage 0), which must be --driver-key or enrolled in the run:
        hello          -> the layers held, the stage's key id, its version
        sync v         -> the share brought to version v, verified; answers its share hashes
        cohort id      -> a new cohort: the KV cache starts afresh, and every answer from now on
                          carries a step signed with the stage's key (stoa.fleet.stages.transcript)
        forward, cache -> StageService (stoa.backends.torch.remote), the KV cache held under the
                          memory cap (stoa.fleet.stages.memory)
    while serving, a resident set over the running limit refuses further work: the frame in hand
        is answered with an error, the stage stops announcing and exits 2

A frame that breaks the format or the stage's bounds closes the driver's connection; the stage
goes back to listening. So does a connection from a driver whose key is not accepted, or that
fails the TLS handshake (:mod:`stoa.fleet.stages.tls`). Nothing read from the socket is unpickled
or trusted for a size.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from stoa.backends.engine import stage_backend
from stoa.fleet.metrics import peak_rss_mib
from stoa.fleet.run import fetch_run
from stoa.fleet.stages import discovery, tls
from stoa.fleet.stages.memory import RunningCap
from stoa.fleet.stages.transcript import ANSWERED, StepSigner
from stoa.transport.frames import Frame, FrameError, meta_int, read_frame, write_frame
from stoa.transport import pulse, shares
from stoa.transport.chain import SYNC_ERRORS
from stoa.transport.exchange import is_finished
from stoa.transport.identity import load_or_create_worker_key, read_roster
from stoa.transport.signing import SignatureError, key_id, load_public_key
from stoa.transport.store import KeyNotFound, ObjectStore, StoreError

__all__ = ["EXIT_CONFIG", "EXIT_OK", "StageServer", "model_shape", "peak_rss_mb"]

log = logging.getLogger("stoa.stage")

EXIT_OK, EXIT_CONFIG = 0, 2
_IDLE_POLL_S = 0.5
_FRAME_TIMEOUT_S = 60.0
_HANDSHAKE_TIMEOUT_S = 10.0


def peak_rss_mb() -> float:
    """This process's own peak resident memory so far, in MiB (:func:`stoa.fleet.metrics.peak_rss_mib`)."""
    return peak_rss_mib()


def model_shape(model_dir: Path) -> tuple[int, bool, int, int]:
    """``(layers, tied head, hidden size, vocab size)`` from a model folder's ``config.json``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return (int(cfg["num_hidden_layers"]), bool(cfg.get("tie_word_embeddings", False)), int(cfg["hidden_size"]),
            int(cfg["vocab_size"]))


class StageServer:
    """Stage ``index`` of a pipeline of ``stages`` (``1 <= index < stages``; stage 0 is the driver).

    Args:
        store, run, public_key: the run, as for a worker.
        pipeline: the pipeline's id (its stages and its driver name the same one).
        index, stages: which stage of how many.
        cache_dir: the run's model files and this stage's key (``stage.key``).
        host, port: where to listen (port 0: any free port).
        advertise: the address written in the announcement, ``HOST`` or ``HOST:PORT``
            (:func:`~stoa.fleet.stages.discovery.parse_advertise`; default: ``host`` and the port
            listened on); a port is for a driver that reaches the stage through a forwarded port
            or a proxy.
        max_memory_mb: refuse to start when the stage's measured need is over this (None: no cap).
        driver_keys: key ids of the drivers this stage serves, besides the keys enrolled in the
            run's roster.
        wrap_service: ``wrap_service(service) -> service``, the one seam for changing what the
            stage computes (as the worker's ``wrap_engine``): tests make a dishonest stage with it.
    """

    def __init__(self, store: ObjectStore, run: str, public_key: Any, pipeline: str, index: int, stages: int,
                 cache_dir: Path, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 max_memory_mb: float | None = None, wait_seconds: float = 600.0,
                 driver_keys: Collection[str] = (), wrap_service: Callable[[Any], Any] | None = None) -> None:
        if not 1 <= index < stages:
            raise ValueError(f"stage {index} of {stages}: a stage process serves 1 .. {stages - 1} (0 is the driver)")
        self.store, self.run_name, self.public_key = store, run, load_public_key(public_key)
        self.pipeline, self.index, self.stages = discovery.check_pipeline_id(pipeline), index, stages
        self.cache_dir, self.host, self.port = Path(cache_dir), host, port
        self.advertise, self.advertise_port = discovery.parse_advertise(advertise) if advertise else (host, None)
        self.max_memory_mb, self.wait_seconds = max_memory_mb, wait_seconds
        self.key = load_or_create_worker_key(self.cache_dir / "stage.key")
        self.key_id = key_id(self.key.public_key())
        self.driver_keys = frozenset(driver_keys)
        self.wrap_service = wrap_service
        self.stop = threading.Event()
        self.need_mb = 0.0
        self.stage: Any = None
        self.sub: Any = None
        self.frames = 0
        self.signer = StepSigner(self.key, run, self.pipeline, index)
        self.cap: RunningCap | None = None
        self.exit_code = EXIT_OK

    def run(self) -> int:
        """Join, then serve until the run finishes or :attr:`stop` is set; the exit status."""
        got = self._fetch_run()
        if got is None:
            return EXIT_OK
        cfg, model_dir = got
        try:
            return self._serve(cfg, model_dir)
        finally:
            log.info("stage %d/%d: peak RSS %.1f MiB (the stage's weights and KV need %.1f MiB)", self.index,
                     self.stages, peak_rss_mb(), self.need_mb)

    def _fetch_run(self) -> tuple[Any, Path] | None:
        t0 = time.time()
        while not self.stop.is_set():
            try:
                return fetch_run(self.store, self.run_name, self.public_key, self.cache_dir / "model")
            except (KeyNotFound, StoreError, OSError) as e:
                if time.time() - t0 > self.wait_seconds:
                    raise RuntimeError(f"run {self.run_name!r} did not appear: {e}") from None
                self.stop.wait(1.0)
        return None

    def _join(self, model_dir: Path, cfg: Any) -> None:
        """The share of the newest version, verified, and the stage built on it."""
        from stoa.transport.chain import ShareSubscriber

        sb = stage_backend()
        layers, tied, _, _ = model_shape(model_dir)
        part = sb.split_layers(layers, self.stages)[self.index]
        self.sub = ShareSubscriber(self.store, self.run_name, self.public_key, part, layers, tied)
        while not self.stop.is_set():
            try:
                if self.sub.head() is not None:
                    r = self.sub.sync(None)
                    break
            except SYNC_ERRORS as e:
                log.warning("joining the chain for layers %s: %s; retrying", part, e)
            self.stop.wait(1.0)
        else:
            return
        self.stage = sb.Stage(model_dir, part, r.state, cfg.rollout.engine_mode)
        self.stage.version = r.version
        rc = cfg.rollout
        self.need_mb = self.stage.memory().total(rc.max_batch, rc.max_episode_tokens) / 2**20
        log.info("stage %d/%d holds layers %s at version %d (%d bytes read); needs %.1f MiB", self.index, self.stages,
                 part, r.version, r.bytes_read, self.need_mb)

    def _serve(self, cfg: Any, model_dir: Path) -> int:
        self._join(model_dir, cfg)
        if self.stage is None:
            return EXIT_OK
        if self.max_memory_mb is not None and self.need_mb > self.max_memory_mb:
            log.error("stage %d/%d needs %.1f MiB (weights + KV for %d rows of %d positions), over --max-memory-mb "
                      "%.1f: not starting (use more stages)", self.index, self.stages, self.need_mb,
                      cfg.rollout.max_batch, cfg.rollout.max_episode_tokens, self.max_memory_mb)
            return EXIT_CONFIG
        rc = cfg.rollout
        positions = 2 * rc.max_episode_tokens + 64
        mem = self.stage.memory()
        self.cap = RunningCap(self.max_memory_mb, mem.state + mem.weights, mem.kv_per_token)
        service = stage_backend().StageService(self.stage, rc.max_batch, positions, self.cap.kv_refusal,
                                               kv_positions=rc.max_episode_tokens)
        if self.wrap_service is not None:
            service = self.wrap_service(service)
        self.cap.ready()
        hidden, vocab = model_shape(model_dir)[2:]
        self.max_payload = rc.max_batch * positions * max(hidden, 1) * 4 + rc.max_batch * 16 + (1 << 16)
        with socket.create_server((self.host, self.port)) as srv:
            self.port = srv.getsockname()[1]
            srv.settimeout(_IDLE_POLL_S)
            beat = threading.Thread(target=self._announce_loop, daemon=True)
            beat.start()
            log.info("stage %d/%d of pipeline %s (key %s: the driver's --stage-keys) listening on %s:%d, announced "
                     "as %s:%d", self.index, self.stages, self.pipeline, self.key_id, self.host, self.port,
                     self.advertise, self.announced_port)
            while not self.stop.is_set():
                try:
                    conn, peer = srv.accept()
                except TimeoutError:
                    continue
                with conn:
                    link = self._handshake(conn, peer)
                    if link is not None:
                        with link:
                            self._driver(link, peer, service)
        return self.exit_code

    def announcement(self) -> discovery.Announcement:
        """What this stage announces now: its layers, and ``advertise``'s host and port (the port
        listened on when ``advertise`` names none)."""
        return discovery.Announcement(self.index, self.stages, self.stage.part, self.advertise, self.announced_port,
                                      self.key_id, time.time())

    @property
    def announced_port(self) -> int:
        return self.advertise_port or self.port

    def _announce_loop(self) -> None:
        while not self.stop.is_set():
            try:
                if is_finished(self.store, self.run_name, self.public_key):
                    log.info("the run finished; stage %d/%d stopping", self.index, self.stages)
                    self.stop.set()
                    return
                discovery.announce(self.store, self.run_name, self.pipeline, self.announcement(), self.key)
            except (StoreError, SignatureError, OSError) as e:
                log.warning("announcing stage %d: %s", self.index, e)
            self.stop.wait(discovery.ANNOUNCE_EVERY_S)

    def _handshake(self, conn: socket.socket, peer: Any) -> ssl.SSLSocket | None:
        """The TLS link to the driver at ``peer``: its announcement (stage 0) read and its key
        accepted (``driver_keys`` or the run's roster), then mutual TLS pinned to that key. None
        (the connection is closed) when any of it fails."""
        try:
            a = discovery.read_announcement(self.store, self.run_name, self.pipeline, 0)
            if a is None:
                raise ValueError(f"pipeline {self.pipeline} has no driver announcement")
            enrolled = read_roster(self.store, self.run_name, self.public_key).enrolled
            why = discovery.Allowed(self.driver_keys, enrolled).refusal(a.key_id, "the driver")
            if why:
                raise ValueError(why)
            conn.settimeout(_HANDSHAKE_TIMEOUT_S)
            return tls.context("server", self.key, a.cert.encode("ascii")).wrap_socket(conn, server_side=True)
        except (ValueError, StoreError, SignatureError, OSError) as e:  # ssl.SSLError is an OSError
            log.warning("refused a connection from %s: %s", peer, str(e)[:500])
            return None

    def _driver(self, conn: socket.socket, peer: Any, service: Any) -> None:
        """Serve one driver's connection until it closes, breaks a rule, or the stage stops."""
        log.info("driver connected from %s (TLS, its key checked)", peer)
        conn.settimeout(_FRAME_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while not self.stop.is_set():
                pending = conn.pending() if isinstance(conn, ssl.SSLSocket) else 0  # decrypted, unread
                if not pending and not select.select([conn], [], [], _IDLE_POLL_S)[0]:
                    continue
                f = read_frame(conn, self.max_payload)
                self.frames += 1
                over = self.cap.over() if self.cap is not None else None
                if over:
                    self._refuse_work(conn, over)
                    return
                if f.op != "cohort":
                    self.signer.received(f)
                out = self._answer(f, service)
                if out is not None:
                    write_frame(conn, self.signer.sign(out) if f.op in ANSWERED and out.op == "out" else out)
        except FrameError as e:
            log.warning("closing the driver's connection: %s", e)
            try:
                write_frame(conn, Frame("error", {"message": str(e)[:500]}))
            except OSError:
                pass
        except OSError as e:
            log.warning("the driver's connection failed: %s", e)

    def _refuse_work(self, conn: socket.socket, why: str) -> None:
        """Over the running memory limit: answer the frame in hand with ``why``, stop announcing
        and stop serving (exit 2). The driver voids the cohort in hand; nothing it uploaded is lost."""
        log.error("stage %d/%d: %s", self.index, self.stages, why)
        self.exit_code = EXIT_CONFIG
        self.stop.set()
        try:
            write_frame(conn, Frame("error", {"message": f"stage {self.index}: {why}"[:500]}))
        except OSError:
            pass

    def _answer(self, f: Frame, service: Any) -> Frame | None:
        if f.op == "cohort":
            self.signer.begin(f.meta.get("id"))
            service.reset()
            return None
        if f.op == "hello":
            return Frame("hello", {"index": self.index, "stages": self.stages, "part": list(self.stage.part),
                                   "layers": self.sub.layers, "key_id": self.key_id, "version": self.stage.version})
        if f.op == "sync":
            v = meta_int(f.meta, "version", 0, 1 << 62)
            try:
                r = self.stage.sync(self.sub, v)
            except SYNC_ERRORS as e:
                log.warning("sync to version %d failed: %s", v, e)
                return Frame("error", {"message": f"sync to version {v}: {type(e).__name__}: {str(e)[:400]}"})
            _, hashes = pulse.state_hashes(self.stage.state, shares.share_of)
            return Frame("synced", {"version": r.version, "shares": hashes, "peak_rss_mb": round(peak_rss_mb(), 1),
                                    "need_mb": round(self.need_mb, 3)})
        return service.handle(f)
