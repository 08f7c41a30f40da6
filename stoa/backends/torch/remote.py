"""Stages of a :class:`~stoa.backends.torch.pipeline.Pipeline` in other processes.

Two sides of one channel, each speaking :class:`stoa.transport.frames.Frame` (numpy arrays under
a JSON header; this module converts to and from torch and never sees a socket):

* :class:`StageService`: what a stage process does with each frame it receives (its KV cache's
  ``slots`` / ``ensure`` / ``copy_rows`` / ``move``, and ``forward``: hidden states in, hidden
  states out, or on the last stage the logits the driver draws from). Every field of every frame
  is checked against the stage's bounds (rows, positions, hidden size) before it touches a tensor.
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
from stoa.backends.torch.engine import draw, exact_matmuls
from stoa.backends.torch.pipeline import Pipeline, Stage, split_layers
from stoa.transport.frames import Frame, FrameError, check_array, meta_int, meta_ints

__all__ = ["Channel", "RemotePipeline", "RemoteStage", "Stage", "StageService", "split_layers"]

WANTS = ("hidden", "logits", "none")


class Channel(Protocol):
    """An ordered, reliable frame stream to one stage process."""

    def request(self, frame: Frame) -> Frame:
        """Send ``frame`` and return the stage's answer (raises ``OSError`` when the stage is gone)."""

    def send(self, frame: Frame) -> None:
        """Send ``frame``; the stage answers nothing (a failure shows at the next request)."""


class StageService:
    """Serves one :class:`Stage` to a driver, frame by frame.

    Args:
        stage: the stage (its weights kept current by its owner, between cohorts).
        max_slots: most rows of its KV cache a driver may ask for.
        max_positions: most positions a row may reach.
    """

    def __init__(self, stage: Stage, max_slots: int, max_positions: int) -> None:
        self.stage, self.max_slots, self.max_positions = stage, int(max_slots), int(max_positions)
        self.hidden = stage.decoder.spec.hidden_size
        self.slots = 0

    def handle(self, f: Frame) -> Frame | None:
        """The answer to ``f`` (None for the cache ops, which answer nothing).

        Raises:
            FrameError: a frame this stage refuses (the driver's connection is then closed).
        """
        with exact_matmuls(self.stage.device), torch.no_grad():
            if f.op == "slots":
                self.slots = meta_int(f.meta, "slots", 1, self.max_slots)
                self.stage.kv(self.slots)
                return None
            if not self.slots:
                raise FrameError(f"{f.op} before slots")
            c = self.stage.cache
            assert c is not None
            if f.op == "ensure":
                c.ensure(meta_int(f.meta, "length", 0, self.max_positions))
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
        if want not in WANTS or (want == "logits" and not self.stage.last):
            raise FrameError(f"want must be one of {WANTS} (logits on the last stage only), not {str(want)[:40]}")
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

    def forward(self, x: torch.Tensor, start: torch.Tensor, longest: int, rows: torch.Tensor | None = None,
                want: str = "hidden") -> torch.Tensor | None:
        arrays = [x.float().cpu().numpy(), start.cpu().numpy().astype(np.int64)]
        if rows is not None:
            arrays.append(rows.cpu().numpy().astype(np.int64))
        out = self.channel.request(Frame("forward", {"longest": int(longest), "want": want}, tuple(arrays)))
        if out.op != "out":
            raise FrameError(f"the stage of layers {self.part} answered {out.op!r}: {str(out.meta)[:300]}")
        if want == "none":
            return None
        n = x.shape[0]
        y = check_array(out.arrays, 0, "float32", (n, self.vocab) if want == "logits" else (n, x.shape[1], self.hidden))
        return torch.from_numpy(y.copy())


class RemotePipeline(Pipeline):
    """A :class:`Pipeline` of one local first stage and :class:`RemoteStage` s after it: a rollout
    engine (``rollout``, ``version``, ``codec``...) for the fleet worker. ``state`` and
    ``state_hash`` cover the local stage's share only; the remote stages' shares are checked by
    their hashes (the driver's job, before each cohort)."""

    def __init__(self, hf_dir: Any, first: Stage, remote: Sequence[RemoteStage], version: int = 0,
                 config: EngineConfig = EngineConfig(), worker_id: str = "", mode: str = "dequantized") -> None:
        if not first.first or not remote:
            raise EngineError("a remote pipeline is a local first stage and one or more remote stages")
        super().__init__(hf_dir, [first, *remote], version, config, worker_id)  # type: ignore[list-item]
        self._mode = mode

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def state(self) -> dict[str, np.ndarray]:
        return dict(self.stages[0].state)

    def reset(self) -> None:
        """Forget the caches (after a stage was reconnected: its new process holds none)."""
        self._cache = None

    def _through(self, x: torch.Tensor, start: torch.Tensor, longest: int, rows: torch.Tensor | None,
                 last: str = "hidden") -> torch.Tensor | None:
        y: torch.Tensor | None = x
        for i, st in enumerate(self.stages):
            assert y is not None
            if isinstance(st, RemoteStage):
                y = st.forward(y, start, longest, rows, last if i == len(self.stages) - 1 else "hidden")
            else:
                y = st.forward(y, start, longest, rows)
        return y

    def feed(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: Any, rows: torch.Tensor) -> None:
        self._through(ids, start, longest, rows, "none")

    def next_tokens(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: Any, seeds: np.ndarray,
                    s: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
        logits = self._through(ids, start, longest, None, "logits")
        assert logits is not None
        return draw(logits, seeds, s, self.config.sampler, self._host_sampler)

    def rollout(self, make_env: Callable[[], Any], requests: Sequence[Any], sampling: SamplingConfig = SamplingConfig()
                ) -> list[Any]:
        try:
            return super().rollout(make_env, requests, sampling)
        except BaseException:
            self._cache = None  # the remote caches may have missed ops: set them up afresh
            raise
