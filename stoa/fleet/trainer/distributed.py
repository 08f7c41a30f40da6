"""Several trainer ranks under ``torchrun``: rank 0 runs the loop, every rank runs the learner.

``torchrun --nproc-per-node N -m stoa trainer CONFIG ...`` starts N processes. Rank 0 alone is
the :class:`~stoa.fleet.trainer.Trainer`: it talks to the store (polls, admission checks,
quarantine, staleness and reuse gates, advantages), publishes, evaluates and keeps the ledger.
The other ranks hold their share of the Megatron model and do only what rank 0 tells them, over
a gloo control group (:class:`Ranks`), in the order it tells them:

* rank 0's learner is a :class:`LeaderLearner`: every learner call that the other ranks must
  join (``train_step``, ``sft_step``, ``logprobs``, ``export_weights`` and ``iter_weights``, checkpoints,
  ``reset_optimizer``) is first broadcast (its episodes as the episode codec's bytes, its
  advantages as raw float bytes, the rest as JSON), then run on rank 0 too;
* every other rank runs :func:`follow`: receive, run the same call, repeat until ``stop``.

So the warm start's demonstrations, too, are made on rank 0 and broadcast, not recomputed per
rank: one source of truth, and the other ranks never build the task's environment. While rank 0
waits for rollouts it sends an ``idle`` heartbeat every few seconds, so no rank waits longer than
the collective timeout (``[learner.megatron] timeout_s``) unless rank 0 spends longer than that
in one phase of its own (publishing, evaluating). When rank 0 fails it broadcasts the error and
every rank exits with it; a rank that dies takes the job down (``torchrun``'s semantics), and
``--resume`` continues from the newest checkpoint like a single-rank trainer. Paths travel as
rank 0's absolute paths: the model folder and ``--run-dir`` must be at the same place on every
node (one shared filesystem for checkpoints).

Nothing here is unpickled: messages are JSON plus the episode codec's validated bytes. With
``WORLD_SIZE`` unset or 1 this module is never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoa.backends.learner import LearnerConfig
from stoa.errors import ExpectedFailure
from stoa.fleet.config import RunConfig
from stoa.types import Limits, decode_episodes, encode_episodes

if TYPE_CHECKING:
    from stoa.types import Episode

__all__ = ["LeaderLearner", "Message", "RankFailed", "Ranks", "broadcast_object_bytes", "follow", "local_rank", "rank",
           "run_ranks", "world_size"]

log = logging.getLogger("stoa.distributed")

IDLE_EVERY_S = 5.0
"""Most seconds rank 0 lets pass without a message while it waits for rollouts."""


def world_size() -> int:
    """Processes in the job (``WORLD_SIZE`` as torchrun sets it; 1 when unset)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's global rank (``RANK``; 0 when unset)."""
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``; 0 when unset): its GPU index."""
    return int(os.environ.get("LOCAL_RANK", "0"))


class RankFailed(ExpectedFailure, RuntimeError):
    """Another rank (rank 0) failed and said why; this rank stops too."""


def broadcast_object_bytes(data: bytes | None, group: Any, src: int = 0) -> bytes:
    """``data`` from rank ``src`` to every rank of the (gloo) ``group``; pass None elsewhere.

    Two collectives: the length, then the bytes (none when empty)."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    size = torch.tensor([len(data) if me == src else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if n == 0:
        return b""
    if me == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return data if me == src else buf.numpy().tobytes()


@dataclass(frozen=True)
class Message:
    """One instruction from rank 0: an operation, its JSON fields and an optional binary payload."""

    op: str
    fields: dict[str, Any]
    payload: bytes = b""

    def encode(self) -> bytes:
        # allow_nan: an objective's config may hold inf (e.g. an uncapped ratio); Python's json reads it back.
        head = json.dumps({"op": self.op, "fields": self.fields}, allow_nan=True).encode()
        return len(head).to_bytes(8, "little") + head + self.payload

    @classmethod
    def decode(cls, blob: bytes) -> Message:
        n = int.from_bytes(blob[:8], "little")
        head = json.loads(blob[8 : 8 + n])
        if not (isinstance(head, dict) and isinstance(head.get("op"), str) and isinstance(head.get("fields"), dict)):
            raise ValueError("malformed control message")
        return cls(head["op"], head["fields"], blob[8 + n :])


class Ranks:
    """The job's process groups and rank 0's control channel to the others.

    Initializes ``torch.distributed`` (NCCL on CUDA, else gloo; both with ``timeout_s``) unless
    it already is, plus a gloo group for control messages (they are host bytes, whatever the
    learner's backend). Rank 0 calls :meth:`send`; every other rank :meth:`recv`.
    """

    def __init__(self, timeout_s: float, cuda: bool, digest: str | None = None) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.owns = not dist.is_initialized()
        if self.owns:
            if cuda:
                torch.cuda.set_device(local_rank())
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.digest = digest
        self._last_send = time.monotonic()
        self.idle_every_s = min(IDLE_EVERY_S, timeout_s / 4)

    def send(self, op: str, payload: bytes = b"", **fields: Any) -> None:
        """Rank 0: broadcast one message to every other rank."""
        assert self.rank == 0, "only rank 0 sends"
        broadcast_object_bytes(Message(op, fields, payload).encode(), self.group)
        self._last_send = time.monotonic()

    def recv(self) -> Message:
        """Any other rank: the next message from rank 0 (waits at most the collective timeout)."""
        return Message.decode(broadcast_object_bytes(None, self.group))

    def idle(self) -> None:
        """Rank 0, while it waits for rollouts: a heartbeat if nothing was sent for a while."""
        if time.monotonic() - self._last_send >= self.idle_every_s:
            self.send("idle")

    def make_learner(self, kind: str, hf_dir: Path, config: LearnerConfig, **options: Any) -> LeaderLearner:
        """Rank 0: have every rank build the learner (a collective), and return rank 0's, mirrored."""
        from stoa.backends.learner import make_learner

        if kind != "megatron":
            raise ValueError(f"a trainer of {self.world} ranks needs learner.kind = \"megatron\", not {kind!r}")
        self.send("build", kind=kind, hf_dir=os.path.abspath(hf_dir), config=_plain(config), options=options,
                  digest=self.digest)
        return LeaderLearner(self, make_learner(kind, hf_dir, config, **options))

    def close(self) -> None:
        """Tear down the process groups this object created."""
        import torch.distributed as dist

        if self.owns and dist.is_initialized():
            dist.destroy_process_group()
            self.owns = False


def _plain(config: LearnerConfig) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(config)))


def _learner_config(fields: dict[str, Any]) -> LearnerConfig:
    return LearnerConfig(**{**fields, "betas": tuple(fields["betas"])})


def _episode_payload(episodes: Sequence[Episode], extra: bytes = b"") -> tuple[bytes, dict[str, int]]:
    blob = encode_episodes(list(episodes), compress=False)
    return blob + extra, {"episode_bytes": len(blob)}


def _episodes(msg: Message) -> list[Episode]:
    n = msg.fields["episode_bytes"]
    # Rank 0 made these bytes from episodes it had validated; the bounds follow the message's own size.
    limits = Limits(max_bytes=max(n, 1), max_decompressed_bytes=max(n, 1), max_batch_segments=1 << 30)
    return decode_episodes(msg.payload[:n], limits=limits)


class LeaderLearner:
    """Rank 0's learner: each call the other ranks must join is broadcast to them, then run here.

    Has the :class:`~stoa.backends.learner.Learner` methods the trainer uses; reading
    ``vocab_size``, ``step``, ``version`` and ``config`` needs no other rank. Anything else is
    an ``AttributeError`` (calling it on rank 0 alone would leave the others out of a collective).
    """

    _LOCAL = frozenset({"vocab_size", "step", "version", "config"})

    def __init__(self, ranks: Ranks, learner: Any) -> None:
        self.ranks, self.learner = ranks, learner

    def __getattr__(self, name: str) -> Any:
        if name in LeaderLearner._LOCAL:
            return getattr(self.learner, name)
        raise AttributeError(f"{name!r} is not mirrored to the other ranks; add it to stoa.fleet.trainer.distributed")

    def logprobs(self, episodes: Sequence[Episode], temperature: float | None = 1.0, *,
                 model_only: bool = False) -> list[np.ndarray]:
        payload, fields = _episode_payload(episodes)
        self.ranks.send("logprobs", payload, temperature=temperature, model_only=bool(model_only), **fields)
        return self.learner.logprobs(episodes, temperature, model_only=model_only)

    def train_step(self, episodes: Sequence[Episode], advantages: np.ndarray, objective: Any = None) -> dict[str, float]:
        from stoa.algos import Objective

        adv = np.ascontiguousarray(advantages)
        if not (objective is None or isinstance(objective, Objective)) or adv.dtype.kind not in "iuf":
            return self.learner.train_step(episodes, advantages, objective)  # refused before any collective
        payload, fields = _episode_payload(episodes, adv.tobytes())
        self.ranks.send("train_step", payload, advantages_dtype=adv.dtype.str, advantages_shape=list(adv.shape),
                        objective=None if objective is None else objective.to_dict(), **fields)
        return self.learner.train_step(episodes, advantages, objective)

    def sft_step(self, episodes: Sequence[Episode]) -> dict[str, float]:
        payload, fields = _episode_payload(episodes)
        self.ranks.send("sft_step", payload, **fields)
        return self.learner.sft_step(episodes)

    def export_weights(self, dtype: str = "float32") -> dict[str, np.ndarray]:
        self.ranks.send("export_weights", dtype=dtype)
        return self.learner.export_weights(dtype)

    def iter_weights(self, dtype: str = "float32") -> Iterator[tuple[str, np.ndarray]]:
        self.ranks.send("export_weights", dtype=dtype)  # the other ranks join the same gather, then drop it
        return self.learner.iter_weights(dtype)

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        self.ranks.send("save_checkpoint", path=os.path.abspath(path))  # rank 0 alone writes ``extra`` (meta.json)
        self.learner.save_checkpoint(path, extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        self.ranks.send("load_checkpoint", path=os.path.abspath(path))
        return self.learner.load_checkpoint(path)

    def reset_optimizer(self, config: LearnerConfig | None = None, keep_state: bool = False) -> None:
        self.ranks.send("reset_optimizer", config=None if config is None else _plain(config), keep_state=keep_state)
        self.learner.reset_optimizer(config, keep_state)

    def close(self) -> None:
        """Every rank closes its learner (megatron's parallel state); a new one may be built after."""
        self.ranks.send("close")
        self.learner.close()


def _apply(learner: Any, msg: Message, objectives: dict[str, Any]) -> None:
    """Run on this rank the learner call rank 0 announced (results stay on rank 0)."""
    f = msg.fields
    if msg.op == "logprobs":
        learner.logprobs(_episodes(msg), f["temperature"], model_only=bool(f.get("model_only", False)))
    elif msg.op == "train_step":
        adv = np.frombuffer(msg.payload[f["episode_bytes"]:], dtype=np.dtype(f["advantages_dtype"]))
        objective = None
        if f["objective"] is not None:
            key = json.dumps(f["objective"], sort_keys=True)
            if key not in objectives:
                from stoa.algos import Objective

                objectives[key] = Objective.from_dict(f["objective"])
            objective = objectives[key]
        learner.train_step(_episodes(msg), adv.reshape(f["advantages_shape"]), objective)
    elif msg.op == "sft_step":
        learner.sft_step(_episodes(msg))
    elif msg.op == "export_weights":
        learner.export_weights(f["dtype"])
    elif msg.op == "save_checkpoint":
        learner.save_checkpoint(Path(f["path"]), None)
    elif msg.op == "load_checkpoint":
        learner.load_checkpoint(Path(f["path"]))
    elif msg.op == "reset_optimizer":
        learner.reset_optimizer(None if f["config"] is None else _learner_config(f["config"]), bool(f.get("keep_state")))
    elif msg.op == "close":
        learner.close()
    else:
        raise RankFailed(f"rank 0 sent an unknown operation {msg.op!r} (are all ranks running the same stoa?)")


def config_digest(cfg: RunConfig) -> str:
    """Names a resolved run config, so every rank can check it runs rank 0's."""
    return hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16]


def follow(ranks: Ranks, cfg: RunConfig | None = None) -> None:
    """Every rank but 0: build the learner when told, then run each learner call rank 0 announces.

    Returns at ``stop``. Raises :class:`RankFailed` when rank 0 reports an error (with its
    message), and whatever a collective raises (a dead peer, the timeout). A ``LearnerError``
    of one call is rank 0's to handle (it sees the same one): this rank carries on. With ``cfg``,
    the run config rank 0 announces must be this one.
    """
    from stoa.backends.learner import LearnerError, make_learner

    learner = None
    objectives: dict[str, Any] = {}
    while True:
        msg = ranks.recv()
        if msg.op == "stop":
            log.info("rank %d: rank 0 finished", ranks.rank)
            return
        if msg.op == "error":
            raise RankFailed(f"rank {ranks.rank} stops: rank 0 failed: {msg.fields.get('message', '?')}")
        if msg.op == "idle":
            continue
        if msg.op == "build":
            if cfg is not None and msg.fields.get("digest") not in (None, config_digest(cfg)):
                raise RankFailed(f"rank {ranks.rank}'s run config differs from rank 0's: launch every rank with "
                                 "the same CONFIG file and --set overrides")
            f = msg.fields
            learner = make_learner(f["kind"], Path(f["hf_dir"]), _learner_config(f["config"]), **f["options"])
            continue
        if learner is None:
            raise RankFailed(f"rank 0 sent {msg.op!r} before building the learner")
        try:
            _apply(learner, msg, objectives)
        except LearnerError as e:
            log.debug("rank %d: %s failed like on rank 0: %s", ranks.rank, msg.op, e)
        if msg.op == "close":
            learner = None


def run_ranks(cfg: RunConfig, lead: Callable[[Ranks], Any]) -> Any:
    """Run one trainer job of several ranks (this process is one of them).

    Rank 0 calls ``lead(ranks)`` (builds and runs the :class:`~stoa.fleet.trainer.Trainer` with
    ``ranks``) and tells the others to stop when it returns, or broadcasts its error if it
    raises; every other rank :func:`follow` s. Returns what ``lead`` returned (None elsewhere).
    """
    dev = cfg.learner.config.device
    if cfg.learner.kind != "megatron":
        raise ValueError(f"a trainer of {world_size()} ranks needs learner.kind = \"megatron\" "
                         f"(the {cfg.learner.kind} learner runs in one process)")
    import torch

    cuda = dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())
    ranks = Ranks(cfg.learner.megatron.timeout_s, cuda, config_digest(cfg))
    log.info("rank %d of %d (%s)", ranks.rank, ranks.world, "nccl" if cuda else "gloo")
    if ranks.rank != 0:
        follow(ranks, cfg)
        ranks.close()
        return None
    try:
        out = lead(ranks)
    except BaseException as e:
        message = f"{type(e).__name__}: {e}"[:4000]
        try:  # the others wait in recv(): tell them, so they exit now with the reason
            ranks.send("error", message=message)
        except Exception:  # noqa: BLE001 - a dead peer: torchrun takes the job down anyway
            pass
        raise
    ranks.send("stop")
    ranks.close()
    return out

