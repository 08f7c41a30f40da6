"""Stages of a :class:`~stoa.backends.torch.pipeline.Pipeline` in other processes.

Two sides of one channel, each speaking :class:`stoa.transport.frames.Frame` (numpy arrays under
a JSON header; this module converts to and from torch and never sees a socket):

* :class:`StageService`: what a stage process does with each frame it receives (its KV cache's
  ``slots`` / ``ensure`` / ``copy_rows`` / ``move``, and ``forward``: hidden states in, hidden
  states out; on the last stage, ``want="draw"``: the next token of each row drawn there by the
  engine's own seeded rule, :func:`~stoa.backends.torch.engine.draw`, from the row seeds the
  driver sends, and only the token ids and behaviour log-probs sent back, 12 bytes a row where
  the logits were ``4 x vocab``). Every field of every frame is checked against the stage's
  bounds (rows, positions, hidden size, sampling settings) before it touches a tensor.
* :class:`RemoteStage`: the driver's stand-in for such a stage inside a :class:`RemotePipeline`,
  forwarding through a *channel* (``request(frame) -> frame`` and ``send(frame)``, e.g.
  :class:`stoa.fleet.stages.driver.StageLink`).

:class:`RemotePipeline` is a :class:`Pipeline` whose first stage is local and the others remote:
the same cohort loop, so its episodes are token for token the in-process pipeline's (and the
single engine's). A channel that fails raises ``OSError`` out of :meth:`RemotePipeline.rollout`;
the cohort is then void and its caller drops it.

This module is the torch entry of :data:`stoa.backends.engine.STAGE_BACKENDS`: the fleet's stage
processes and drivers reach it (and ``Stage``, ``split_layers``) by that name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from stoa.backends.engine import EngineConfig, EngineError, SamplingConfig
from stoa.backends.sampling import HostSampler
from stoa.backends.torch.decoder import kv_capacity
from stoa.backends.torch.engine import draw, exact_matmuls
from stoa.backends.torch.pipeline import Pipeline, Stage, split_layers
from stoa.transport.frames import Frame, FrameError, check_array, meta_int, meta_ints

__all__ = ["Channel", "RemotePipeline", "RemoteStage", "Stage", "StageService", "micro_batches", "split_layers"]

WANTS = ("hidden", "logits", "draw", "none")
SAMPLERS = ("auto", "host", "device")


MICRO_RTT_S = 0.002
"""Round trips at or under this need no micro-batches: a link this quick is not worth splitting a step for."""


def micro_batches(stages: int, rtt_s: float) -> int:
    """How many micro-batches a decode step's rows go round a pipeline in: one when every link's
    round trip ``rtt_s`` is under :data:`MICRO_RTT_S` (splitting only adds per-call overhead, as
    ``benchmarks/pipeline.py`` measured), else one per stage, so that each stage has a micro-batch
    to compute while another crosses a link."""
    return 1 if rtt_s <= MICRO_RTT_S else stages


class Channel(Protocol):
    """An ordered, reliable frame stream to one stage process."""

    def request(self, frame: Frame) -> Frame:
        """Send ``frame`` and return the stage's answer (raises ``OSError`` when the stage is gone)."""

    def send(self, frame: Frame) -> None:
        """Send ``frame``; the stage answers nothing (a failure shows at the next request)."""

    def receive(self) -> Frame:
        """The stage's next answer, to a frame sent earlier (answers come in the order sent)."""


class StageService:
    """Serves one :class:`Stage` to a driver, frame by frame.

    Args:
        stage: the stage (its weights kept current by its owner, between cohorts).
        max_slots: most rows of its KV cache a driver may ask for.
        max_positions: most positions a row may reach.
        kv_check: ``kv_check(slots, positions) -> reason or None``, asked before the KV cache is
            allocated or grown (``positions`` rounded up as allocated): a reason refuses the frame
            (a memory cap held while running).
    """

    def __init__(self, stage: Stage, max_slots: int, max_positions: int,
                 kv_check: Callable[[int, int], str | None] | None = None, kv_positions: int | None = None) -> None:
        self.stage, self.max_slots, self.max_positions = stage, int(max_slots), int(max_positions)
        self.kv_positions = min(int(kv_positions or max_positions), self.max_positions)
        """Positions a row is expected to reach (the run's ``max_episode_tokens``): the KV cache is
        grown in steps only up to this (then to exactly what a frame asks), so it holds what a
        memory cap counted for."""
        self.hidden = stage.decoder.spec.hidden_size
        self.vocab = stage.decoder.spec.vocab_size
        self.slots = 0
        self.kv_check = kv_check
        self._host_sampler = HostSampler()

    def reset(self) -> None:
        """Start the KV cache afresh (a new cohort: its outputs then depend on its frames alone)."""
        self.slots = 0
        self.stage.cache = None

    def _room(self, slots: int, length: int) -> None:
        if self.kv_check is None:
            return
        c = self.stage.cache
        have = c.capacity if c is not None and c.shape[0] == slots else 0
        why = self.kv_check(slots, max(have, kv_capacity(max(length, 1), self.kv_positions)))
        if why:
            raise FrameError(why)

    def handle(self, f: Frame) -> Frame | None:
        """The answer to ``f`` (None for the cache ops, which answer nothing).

        Raises:
            FrameError: a frame this stage refuses (the driver's connection is then closed).
        """
        with exact_matmuls(self.stage.device), torch.no_grad():
            if f.op == "slots":
                slots = meta_int(f.meta, "slots", 1, self.max_slots)
                self._room(slots, 1)
                self.slots = slots
                self.stage.kv(self.slots, limit=self.kv_positions)
                return None
            if not self.slots:
                raise FrameError(f"{f.op} before slots")
            c = self.stage.cache
            assert c is not None
            if f.op == "ensure":
                length = meta_int(f.meta, "length", 0, self.max_positions)
                self._room(self.slots, length)
                c.ensure(length)
                return None
            if f.op in ("copy_rows", "move"):
                src = meta_int(f.meta, "src", 0, self.slots - 1)
                length = meta_int(f.meta, "length", 0, c.capacity)
                if f.op == "move":
                    c.move(src, meta_int(f.meta, "dst", 0, self.slots - 1), length)
                else:
                    c.copy_rows(src, meta_ints(f.meta, "dst", 0, self.slots - 1, self.slots), length)
                return None
            if f.op == "forward":
                return self._forward(f)
        raise FrameError(f"unknown op {f.op!r}")

    def _forward(self, f: Frame) -> Frame:
        want = f.meta.get("want")
        if want not in WANTS or (want in ("logits", "draw") and not self.stage.last):
            raise FrameError(f"want must be one of {WANTS} (logits and draws on the last stage only), "
                             f"not {str(want)[:40]}")
        x = check_array(f.arrays, 0, "float32", (None, None, self.hidden))
        n, m = x.shape[0], x.shape[1]
        if not (1 <= n <= self.slots and 1 <= m <= self.max_positions):
            raise FrameError(f"a forward of {n} rows x {m} positions on a {self.slots}-row cache")
        start = check_array(f.arrays, 1, "int64", (n,))
        if start.min() < 0 or int(start.max()) + m > self.max_positions:
            raise FrameError("start positions out of range")
        longest = meta_int(f.meta, "longest", 1, self.max_positions)
        if longest != int(start.max()) + m:
            raise FrameError(f"longest {longest} is not max(start) + {m}")
        self._room(self.slots, longest)
        if want == "draw":
            return self._draw(f, x, start, longest)
        rows = None
        if len(f.arrays) > 2:
            r = check_array(f.arrays, 2, "int64", (n,))
            if r.min() < 0 or r.max() >= self.slots or len(np.unique(r)) != n:
                raise FrameError("rows out of range or repeated")
            rows = torch.from_numpy(r.copy()).to(self.stage.device)
        dev = self.stage.device
        y = self.stage.forward(torch.from_numpy(x.copy()).to(dev), torch.from_numpy(start.copy()).to(dev), longest, rows)
        if want == "none":
            return Frame("out")
        if want == "logits":
            y = self.stage.decoder.logits(y[:, 0])
        return Frame("out", {}, (y.float().cpu().numpy(),))

    def _draw(self, f: Frame, x: np.ndarray, start: np.ndarray, longest: int) -> Frame:
        """The next token of each row (one position each): the stage's logits drawn from with the
        row seeds (array 2, uint64 as int64) under the frame's sampling settings."""
        n = x.shape[0]
        if x.shape[1] != 1:
            raise FrameError(f"a draw takes one position a row, not {x.shape[1]}")
        seeds = check_array(f.arrays, 2, "int64", (n,)).copy().view(np.uint64)
        s, sampler = _sampling(f.meta, self.vocab)
        dev = self.stage.device
        rows = None
        if len(f.arrays) > 3:  # a micro-batch's rows of the cache
            r = check_array(f.arrays, 3, "int64", (n,))
            if r.min() < 0 or r.max() >= self.slots or len(np.unique(r)) != n:
                raise FrameError("rows out of range or repeated")
            rows = torch.from_numpy(r.copy()).to(dev)
        y = self.stage.forward(torch.from_numpy(x.copy()).to(dev), torch.from_numpy(start.copy()).to(dev), longest, rows)
        tokens, lps = draw(self.stage.decoder.logits(y[:, 0]), seeds, s, sampler, self._host_sampler)
        return Frame("out", {}, (np.asarray(tokens, np.int64), np.asarray(lps, np.float32)))


def _sampling(meta: dict[str, Any], vocab: int) -> tuple[SamplingConfig, str]:
    """The sampling settings of a draw frame, checked: temperature > 0 and finite, top_k in
    ``[0, vocab]``, top_p in ``(0, 1]``, a known sampler."""
    t, p, k, where = meta.get("temperature"), meta.get("top_p"), meta.get("top_k"), meta.get("sampler")
    if not (isinstance(t, float) and np.isfinite(t) and 0.0 < t < 1e6):
        raise FrameError(f"temperature must be a finite float > 0, not {str(t)[:40]}")
    if not (isinstance(p, float) and 0.0 < p <= 1.0):
        raise FrameError(f"top_p must be a float in (0, 1], not {str(p)[:40]}")
    if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= vocab):
        raise FrameError(f"top_k must be an integer in [0, {vocab}], not {str(k)[:40]}")
    if where not in SAMPLERS:
        raise FrameError(f"sampler must be one of {SAMPLERS}, not {str(where)[:40]}")
    return SamplingConfig(temperature=t, top_p=p, top_k=k), where


class _RemoteKV:
    """A remote stage's KV cache as the cohort loop moves rows in it (ops sent, nothing answered)."""

    def __init__(self, stage: RemoteStage, slots: int) -> None:
        self.stage, self.shape = stage, (slots,)
        stage.channel.send(Frame("slots", {"slots": slots}))

    def ensure(self, length: int) -> None:
        self.stage.channel.send(Frame("ensure", {"length": int(length)}))

    def copy_rows(self, src: int, dst: list[int], length: int) -> None:
        self.stage.channel.send(Frame("copy_rows", {"src": int(src), "dst": [int(d) for d in dst], "length": int(length)}))

    def move(self, src: int, dst: int, length: int) -> None:
        self.stage.channel.send(Frame("move", {"src": int(src), "dst": int(dst), "length": int(length)}))


class RemoteStage:
    """Layers ``part`` of a ``layers``-layer model, computed by another process through ``channel``
    (replaceable: a stage that left is reconnected by the driver between cohorts)."""

    device = torch.device("cpu")

    def __init__(self, part: tuple[int, int], layers: int, hidden: int, vocab: int, channel: Channel) -> None:
        self.part, self.layers, self.hidden, self.vocab, self.channel = part, layers, hidden, vocab, channel
        self.last = part[1] == layers

    def kv(self, slots: int) -> _RemoteKV:
        return _RemoteKV(self, slots)

    @staticmethod
    def _frame(x: torch.Tensor, start: torch.Tensor, longest: int, rows: torch.Tensor | None, want: str) -> Frame:
        arrays = [x.float().cpu().numpy(), start.cpu().numpy().astype(np.int64)]
        if rows is not None:
            arrays.append(rows.cpu().numpy().astype(np.int64))
        return Frame("forward", {"longest": int(longest), "want": want}, tuple(arrays))

    def _hidden(self, out: Frame, n: int, width: int, want: str) -> torch.Tensor | None:
        if out.op != "out":
            raise FrameError(f"the stage of layers {self.part} answered {out.op!r}: {str(out.meta)[:300]}")
        if want == "none":
            return None
        y = check_array(out.arrays, 0, "float32", (n, self.vocab) if want == "logits" else (n, width, self.hidden))
        return torch.from_numpy(y.copy())

    def forward(self, x: torch.Tensor, start: torch.Tensor, longest: int, rows: torch.Tensor | None = None,
                want: str = "hidden") -> torch.Tensor | None:
        out = self.channel.request(self._frame(x, start, longest, rows, want))
        return self._hidden(out, x.shape[0], x.shape[1], want)

    def submit(self, x: torch.Tensor, start: torch.Tensor, longest: int, rows: torch.Tensor | None = None) -> None:
        """:meth:`forward`'s frame sent without waiting; :meth:`collect` takes the answer."""
        self.channel.send(self._frame(x, start, longest, rows, "hidden"))

    def collect(self, n: int, width: int) -> torch.Tensor:
        y = self._hidden(self.channel.receive(), n, width, "hidden")
        assert y is not None
        return y

    def _draw_frame(self, x: torch.Tensor, start: torch.Tensor, longest: int, seeds: np.ndarray, s: SamplingConfig,
                    sampler: str, rows: torch.Tensor | None) -> Frame:
        arrays = [x.float().cpu().numpy(), start.cpu().numpy().astype(np.int64),
                  np.ascontiguousarray(seeds, np.uint64).view(np.int64)]
        if rows is not None:
            arrays.append(rows.cpu().numpy().astype(np.int64))
        meta = {"longest": int(longest), "want": "draw", "temperature": float(s.temperature),
                "top_p": float(s.top_p), "top_k": int(s.top_k), "sampler": sampler}
        return Frame("forward", meta, tuple(arrays))

    def draw(self, x: torch.Tensor, start: torch.Tensor, longest: int, seeds: np.ndarray, s: SamplingConfig,
             sampler: str, rows: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The last stage's draw of each row's next token (see :class:`StageService`): token ids
        (int64, each below the vocabulary size, checked) and behaviour log-probs (float32)."""
        return self._drawn(self.channel.request(self._draw_frame(x, start, longest, seeds, s, sampler, rows)),
                           x.shape[0])

    def submit_draw(self, x: torch.Tensor, start: torch.Tensor, longest: int, seeds: np.ndarray, s: SamplingConfig,
                    sampler: str, rows: torch.Tensor | None = None) -> None:
        """:meth:`draw`'s frame sent without waiting; :meth:`collect_draw` takes the answer."""
        self.channel.send(self._draw_frame(x, start, longest, seeds, s, sampler, rows))

    def collect_draw(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self._drawn(self.channel.receive(), n)

    def _drawn(self, out: Frame, n: int) -> tuple[np.ndarray, np.ndarray]:
        if out.op != "out":
            raise FrameError(f"the stage of layers {self.part} answered {out.op!r}: {str(out.meta)[:300]}")
        tokens = check_array(out.arrays, 0, "int64", (n,))
        lps = check_array(out.arrays, 1, "float32", (n,))
        if n and (tokens.min() < 0 or tokens.max() >= self.vocab):
            raise FrameError(f"the stage of layers {self.part} drew a token outside the vocabulary")
        return tokens.copy(), lps.copy()


class RemotePipeline(Pipeline):
    """A :class:`Pipeline` of one local first stage and :class:`RemoteStage` s after it: a rollout
    engine (``rollout``, ``version``, ``codec``...) for the fleet worker, whose ``mode`` is the one
    given. ``state`` and ``state_hash`` cover the local stage's share only; the remote stages'
    shares are checked by their hashes (the driver's job, before each cohort)."""

    def __init__(self, hf_dir: Any, first: Stage, remote: Sequence[RemoteStage], version: int = 0,
                 config: EngineConfig = EngineConfig(), worker_id: str = "", mode: str = "dequantized") -> None:
        if not first.first or not remote:
            raise EngineError("a remote pipeline is a local first stage and one or more remote stages")
        super().__init__(hf_dir, [first, *remote], version, config, worker_id)  # type: ignore[list-item]
        self._mode = mode
        self.micro = 1
        """Micro-batches a decode step's rows are split into (at most one a row): they go round
        the stages one behind the other, so while one waits on a link the others are computed
        (the driver sets it from its links' round trips, :func:`micro_batches`). The episodes are
        the same whatever it is: each row is computed alone of the others."""
        self.begin: Callable[[], None] | None = None
        """Called at the start of each cohort, before any frame of it (the driver's: it opens the
        cohort's transcript, :mod:`stoa.fleet.stages.transcript`); the remote caches are then set
        up afresh, so that a cohort's frames alone make its outputs."""

    @property
    def state(self) -> dict[str, np.ndarray]:
        return dict(self.stages[0].state)

    def reset(self) -> None:
        """Forget the caches (after a stage was reconnected: its new process holds none)."""
        self._cache = None

    def _through(self, x: torch.Tensor, start: torch.Tensor, longest: int, rows: torch.Tensor | None,
                 last: str = "hidden", stages: Sequence[Any] | None = None) -> torch.Tensor | None:
        """``x`` through ``stages`` (default: all), the last remote one answering ``last``."""
        stages = self.stages if stages is None else stages
        y: torch.Tensor | None = x
        for i, st in enumerate(stages):
            assert y is not None
            if isinstance(st, RemoteStage):
                y = st.forward(y, start, longest, rows, last if i == len(stages) - 1 else "hidden")
            else:
                y = st.forward(y, start, longest, rows)
        return y

    def feed(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: Any, rows: torch.Tensor) -> None:
        self._through(ids, start, longest, rows, "none")

    def next_tokens(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: Any, seeds: np.ndarray,
                    s: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
        """Each row's next token, drawn on the last stage (:meth:`RemoteStage.draw`): no logits
        cross a link. With :attr:`micro` > 1 the rows go round in micro-batches, a wavefront:
        at each tick every remote stage is sent its next micro-batch, then this process computes
        the first stage's, then it collects the remote stages' answers."""
        n = ids.shape[0]
        m = max(1, min(self.micro, n))
        if m == 1:
            y = self._through(ids, start, longest, None, stages=self.stages[:-1])
            last = self.stages[-1]
            assert y is not None and isinstance(last, RemoteStage)
            return last.draw(y, start, longest, seeds, s, self.config.sampler)
        groups = [torch.from_numpy(g) for g in np.array_split(np.arange(n, dtype=np.int64), m)]
        starts = [start[g] for g in groups]
        longs = [int(st.max()) + 1 for st in starts]
        k = len(self.stages)
        x: list[list[torch.Tensor | None]] = [[None] * m for _ in range(k)]  # x[j][g]: stage j's input for group g
        toks, lps = np.zeros(n, np.int64), np.zeros(n, np.float32)
        for t in range(m + k - 1):
            for j in range(1, k):  # send each remote stage its micro-batch of this tick
                g = t - j
                if 0 <= g < m:
                    st = self.stages[j]
                    assert isinstance(st, RemoteStage) and x[j][g] is not None
                    if j == k - 1:
                        st.submit_draw(x[j][g], starts[g], longs[g], seeds[groups[g].numpy()], s, self.config.sampler,
                                       groups[g])
                    else:
                        st.submit(x[j][g], starts[g], longs[g], groups[g])
                    x[j][g] = None
            if t < m:  # meanwhile, the first stage here
                x[1][t] = self.stages[0].forward(ids[groups[t]], starts[t], longs[t], groups[t])
            for j in range(1, k):
                g = t - j
                if 0 <= g < m:
                    st = self.stages[j]
                    assert isinstance(st, RemoteStage)
                    if j == k - 1:
                        toks[groups[g].numpy()], lps[groups[g].numpy()] = st.collect_draw(len(groups[g]))
                    else:
                        x[j + 1][g] = st.collect(len(groups[g]), 1)
        return toks, lps

    def rollout(self, make_env: Callable[[], Any], requests: Sequence[Any], sampling: SamplingConfig = SamplingConfig()
                ) -> list[Any]:
        try:
            if self.begin is not None:
                self._cache = None
                self.begin()
            return super().rollout(make_env, requests, sampling)
        except BaseException:
            self._cache = None  # the remote caches may have missed ops: set them up afresh
            raise
