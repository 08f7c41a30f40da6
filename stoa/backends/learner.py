"""The learner contract: what a trainer backend does, and how the trainer calls it.

A learner owns the policy's float32 master weights and its optimizer. The trainer loop gives it
validated :class:`~stoa.types.Episode` batches; the learner scores them, takes optimizer steps
with a :mod:`stoa.algos` objective, exports its weights by Hugging Face names for PULSE, and
checkpoints itself. Two backends implement it:

* ``"torch"`` (:mod:`stoa.backends.torch`): ``transformers`` model classes, one process, CPU or
  one GPU. The default.
* ``"megatron"`` (:mod:`stoa.backends.megatron`): megatron-core ``GPTModel``, tensor / pipeline
  / data parallel under ``torchrun``.

Pick one with :func:`make_learner`. This module imports neither torch nor megatron, so
``import stoa.backends.learner`` is as light as ``import stoa``. Both backends share the
packing planner (:mod:`stoa.backends.packing`, numpy only) and the objective plumbing
(:mod:`stoa.backends.torch.objective`: padded masks, per-token advantages, the full-batch
normalizer and metrics).

Token alignment
---------------
Everything is aligned with ``episode.tokens()`` (``T`` tokens, prompt first). Entry ``t`` of a
per-token array is about token ``t`` given the tokens before it::

    logprobs[t] = log p_theta(tokens[t] | tokens[:t]) / at temperature tau   (t >= 1)
    logprobs[0] = 0.0                                                       (no context)

which is the same convention as ``episode.behavior_logprobs()`` and ``episode.loss_mask()``.
Entry 0 is always a prompt token, never trained on.

Temperature
-----------
Log-probs "at temperature tau" are ``log_softmax(logits / tau)``: the distribution a worker
sampled from (``top_p`` is not applied; see the rollout engine for how it records log-probs when
nucleus sampling is on). :meth:`Learner.train_step` scores each episode at its own
``episode.temperature``, so the objective compares trainer and behaviour probabilities of the
same distribution.

Batches, packing and micro-batches
----------------------------------
One call to :meth:`Learner.train_step` or :meth:`Learner.sft_step` is exactly one optimizer
step over the whole batch, whatever its size. The learner packs the episodes into rows of at most
``LearnerConfig.micro_batch_tokens`` tokens (several whole episodes per row, attention never
crosses an episode boundary, positions restart at 0 for each episode), runs forward/backward one
row (micro-batch) at a time, and accumulates gradients. An episode longer than
``micro_batch_tokens`` gets a row of its own. Losses are normalized by the *full batch* (the
objective's ``normalizer``), so the accumulated gradient equals the gradient of the full-batch
loss, independent of how the batch was split.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from stoa.errors import ExpectedFailure

if TYPE_CHECKING:
    from stoa.algos import Objective
    from stoa.types import Episode

__all__ = ["BACKENDS", "Counters", "Learner", "LearnerConfig", "LearnerError", "check_episodes", "checkpoint_extra",
           "durable_rename", "fsync_file", "lr_at", "make_learner", "read_checkpoint_meta"]

BACKENDS: dict[str, str] = {
    "torch": "stoa.backends.torch",
    "megatron": "stoa.backends.megatron",
}
"""Backend name -> module. The module exports ``make(hf_dir, config, **options) -> Learner``."""


class LearnerError(ExpectedFailure, ValueError):
    """A learner was given something it cannot use (bad batch, bad checkpoint, bad model folder)."""


@dataclass(frozen=True)
class LearnerConfig:
    """Optimizer, schedule, batching and precision of a learner (shared by every backend)."""

    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW), applied to matrices only, not to norms or biases."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after warm-up: constant, or linear / cosine decay to ``min_lr_ratio * lr``."""
    warmup_steps: int = 0
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over this many steps."""
    total_steps: int = 0
    """Length of the decay (steps, warm-up included); required (> warmup_steps) for linear / cosine."""
    min_lr_ratio: float = 0.0
    """Final learning rate of a decaying schedule, as a fraction of ``lr``."""
    micro_batch_tokens: int = 2048
    """Token budget of one micro-batch (one packed row); bounds activation memory. On a CPU in
    float32 a micro-batch holds ~1.7 GB of activations per 1,000 tokens for a 135M-parameter
    model (``benchmarks/learner_memory.py``), so the bound is what keeps a trainer whose episodes
    grow long (a policy that learned to search) inside its machine's memory."""
    packing: bool = True
    """Pack several episodes per row; False pads each micro-batch to its longest episode (a baseline)."""
    logits_chunk_elements: int = 1 << 25
    """Most logits (tokens x vocab) materialized at once when computing log-probs (memory bound)."""
    seed: int = 0
    """Seed of the learner's torch RNG."""
    device: str = "auto"
    """``"auto"`` (first CUDA device if any, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype (weights stay float32): auto = bfloat16 on CUDA, float32 on CPU (bf16 is slow there)."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in backward (less memory, ~30% more compute)."""
    threads: int = 0
    """CPU threads for torch (0 = leave torch's default)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr} must be finite and > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas} must be two numbers in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps} must be > 0")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")
        if self.schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"schedule={self.schedule!r} must be constant, linear or cosine")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError("warmup_steps and total_steps must be >= 0")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"schedule={self.schedule!r} needs total_steps > warmup_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        if self.micro_batch_tokens < 1 or self.logits_chunk_elements < 1:
            raise ValueError("micro_batch_tokens and logits_chunk_elements must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be auto, float32 or bfloat16")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device={self.device!r} must be auto, cpu, cuda or cuda:N")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")


def check_episodes(episodes: Sequence[Episode], vocab_size: int, *, train: bool) -> list[np.ndarray]:
    """Every backend's input check; returns each episode's tokens (int64).

    Raises:
        LearnerError: an empty batch, an episode without tokens, a token id outside
            ``[0, vocab_size)``, no model tokens when training, a temperature that is not finite and > 0.
    """
    if len(episodes) == 0:
        raise LearnerError("empty batch")
    tokens = []
    for i, ep in enumerate(episodes):
        t = ep.tokens()
        if t.size == 0:
            raise LearnerError(f"episode {i} has no tokens")
        if int(t.min()) < 0 or int(t.max()) >= vocab_size:
            raise LearnerError(f"episode {i}: token id outside [0, {vocab_size})")
        if train and ep.num_model_tokens == 0:
            raise LearnerError(f"episode {i} has no model tokens to train on")
        if not (math.isfinite(ep.temperature) and ep.temperature > 0):
            raise LearnerError(f"episode {i}: temperature {ep.temperature!r} must be finite and > 0")
        tokens.append(t.astype(np.int64))
    return tokens


def read_checkpoint_meta(path: Path, fmt: str) -> dict[str, Any]:
    """``path/meta.json`` of a checkpoint, checked to be a JSON object of format ``fmt``.

    Raises:
        LearnerError: not JSON, not an object, or another format.
    """
    import json

    try:
        meta = json.loads((path / "meta.json").read_text())
    except ValueError as e:
        raise LearnerError(f"{path}/meta.json is not JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise LearnerError(f"{path} is not a {fmt} checkpoint")
    return meta


def checkpoint_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """The caller's ``extra`` as plain JSON data (what ``meta.json`` stores), or a LearnerError."""
    import json

    try:
        return json.loads(json.dumps(extra or {}, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise LearnerError(f"extra is not JSON-serializable: {e}") from None


def fsync_file(path: Path) -> None:
    """Flush one written file to stable storage."""
    import os

    with open(path, "rb") as f:
        os.fsync(f.fileno())


def durable_rename(tmp: Path, path: Path) -> None:
    """Rename a complete (fsynced) checkpoint folder into place and make the rename durable where
    the OS allows it (fsync of the parent folder)."""
    import contextlib
    import os

    os.rename(tmp, path)
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Counters:
    """The counters every learner keeps (a base class of the backends' learners)."""

    _step: int = 0
    _version: int = 0

    @property
    def step(self) -> int:
        """Optimizer steps taken (``train_step`` and ``sft_step``), restored by ``load_checkpoint``."""
        return self._step

    @property
    def version(self) -> int:
        """Weight updates applied, the number the trainer publishes weights under."""
        return self._version


def lr_at(config: LearnerConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based: the first step taken is step 0).

    Warm-up is linear: step ``s < warmup_steps`` uses ``lr * (s + 1) / warmup_steps``. After it,
    ``constant`` keeps ``lr``; ``linear`` and ``cosine`` decay to ``min_lr_ratio * lr`` at
    ``total_steps`` and stay there. Every backend uses this function so schedules agree.
    """
    c = config
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    if c.schedule == "constant":
        return c.lr
    frac = min(1.0, (step - c.warmup_steps) / max(1, c.total_steps - c.warmup_steps))
    shape = 1.0 - frac if c.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
    return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * shape)


@runtime_checkable
class Learner(Protocol):
    """A trainable causal LM behind the trainer loop. See the module docstring for conventions.

    Attributes:
        config: the :class:`LearnerConfig` in force (see :meth:`reset_optimizer`).
        vocab_size: rows of the embedding matrix; every token id fed in must be below it.
        step: optimizer steps taken since the optimizer was created (or last reset); drives the
            learning-rate schedule (:func:`lr_at`). Restored by :meth:`load_checkpoint`.
        version: weight updates applied since the model folder was loaded (every ``train_step``
            and ``sft_step`` adds one; never reset). Restored by :meth:`load_checkpoint`. The
            trainer may number its published policy versions differently.
    """

    config: LearnerConfig

    @property
    def vocab_size(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def version(self) -> int: ...

    def logprobs(self, episodes: Sequence[Episode], temperature: float | None = 1.0, *,
                 model_only: bool = False) -> list[np.ndarray]:
        """Per-token log-probabilities of the episodes' own tokens under the current weights.

        No gradient, no state change. Memory-light: the log-softmax runs over chunks of at most
        ``config.logits_chunk_elements`` logits, never a full float32 ``[tokens, vocab]``.

        Args:
            episodes: the episodes to score (any lengths; packed like a training batch).
            temperature: ``tau > 0`` to score every episode at; ``None`` scores each episode at
                its own ``episode.temperature`` (what :meth:`train_step` does).
            model_only: score the model's tokens only (``episode.loss_mask()``); every other
                entry is ``0.0``. A backend that computes the head over selected positions
                (torch) skips the rest; the trainer's log-prob audit asks for this.

        Returns:
            One float32 array ``[len(episode)]`` per episode, in order, aligned with
            ``episode.tokens()``: entry ``t`` is ``log p(tokens[t] | tokens[:t])`` at the
            temperature; entry 0 is ``0.0``. Values are finite and ``<= 0``.

        Raises:
            LearnerError: empty batch, a token id outside ``[0, vocab_size)``, bad temperature.
        """
        ...

    def train_step(
        self,
        episodes: Sequence[Episode],
        advantages: np.ndarray,
        objective: Objective | None = None,
    ) -> dict[str, float]:
        """One optimizer step of a policy-gradient objective over the whole batch.

        Per episode, the objective gets (``[batch, time]`` after packing, see
        ``stoa.algos.ObjectiveInputs``): ``logprobs`` from the current weights at
        ``episode.temperature`` (with gradient), ``behavior_logprobs`` from
        ``episode.behavior_logprobs()``, the episode's advantage broadcast over its tokens, and
        ``mask`` from ``episode.loss_mask()`` (environment and prompt tokens get exactly zero
        gradient). Gradients are accumulated over micro-batches with the full-batch normalizer,
        clipped to ``config.grad_clip``, and AdamW steps at ``lr_at(config, step)``; then
        ``step`` and ``version`` each grow by one.

        Args:
            episodes: the batch (validated episodes; whole groups, as the trainer builds them).
            advantages: numpy ``[len(episodes)]``, one finite advantage per episode (the output
                of ``stoa.algos.group_advantages``); converted to the learner's tensors once.
            objective: the resolved :class:`stoa.algos.Objective` (its config and loss function
                together, e.g. ``resolve_objective("ppo", {"clip_high": 0.28})``); ``None``
                is DPPO with its defaults. A bare name or a bare ``Config`` is an error.

        Returns:
            Flat float metrics: ``loss`` (full-batch objective value), the objective's own
            metrics aggregated over micro-batches (token-weighted means under the objective's
            names, e.g. the gate's masked fractions), ``grad_norm`` (before clipping), ``lr``,
            ``tokens`` (all tokens processed), ``loss_tokens`` (model tokens trained on),
            ``micro_batches``, ``pad_fraction`` (padded slots over all slots), ``seconds`` and
            ``tokens_per_s``.

        Raises:
            LearnerError: empty batch, advantages of the wrong shape or not finite, an episode
                without model tokens, a token id outside the vocabulary, an ``objective`` that
                is not an :class:`~stoa.algos.Objective`.
        """
        ...

    def sft_step(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """One supervised optimizer step (warm start): cross-entropy on model tokens only.

        The loss is the mean over all model tokens of the batch of ``-log p(token | prefix)`` at
        temperature 1; prompt and environment tokens are context only. Same packing, gradient
        accumulation, clipping and schedule as :meth:`train_step`; ``step`` and ``version``
        each grow by one.

        Returns:
            ``loss``, ``grad_norm``, ``lr``, ``tokens``, ``loss_tokens``, ``micro_batches``,
            ``pad_fraction``, ``seconds``, ``tokens_per_s``.
        """
        ...

    def export_weights(self, dtype: Literal["float32", "bfloat16"] = "float32") -> dict[str, np.ndarray]:
        """The current weights as ``{hf_name: array}``, exactly the tensors of the model folder.

        Names and shapes match the Hugging Face ``model.safetensors`` the learner was loaded
        from (a tied ``lm_head.weight`` is omitted, as the folder omits it). Arrays are host
        copies the caller owns: float32, or bfloat16 as ``ml_dtypes.bfloat16`` (round to nearest
        even). This is the input of ``stoa.transport.quant.quantize_state``.
        """
        ...

    def iter_weights(self, dtype: Literal["float32", "bfloat16"] = "float32") -> Iterator[tuple[str, np.ndarray]]:
        """:meth:`export_weights` one tensor at a time: ``(hf_name, array)`` in the same order and
        bit for bit the same arrays, so the host holds one float tensor at a time (the input of
        ``stoa.transport.quant.quantize_state`` when publishing). Consume it before the next
        weight update; collective work (a multi-rank gather) is done when it is called."""
        ...

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Write a full training checkpoint to the directory ``path``, atomically.

        Contents: float32 weights and optimizer state in safetensors, RNG states, ``step``,
        ``version``, the :class:`LearnerConfig`, and the caller's ``extra`` (JSON-serializable:
        e.g. consumed-rollout bookkeeping), in ``meta.json``. Nothing is pickled. The directory
        is written under a temporary name beside ``path`` and renamed into place, so a crash
        leaves either no ``path`` or a complete one. ``path`` must not exist yet.

        Raises:
            LearnerError: ``path`` exists, or ``extra`` is not JSON-serializable.
        """
        ...

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save_checkpoint` of the same backend and model.

        Afterwards the learner continues bit-exactly (same device, dtype and thread count):
        the next ``train_step`` on the same batch gives the same weights and metrics as it would
        have without the save/restore. The optimizer fields of the saved config (``lr``,
        ``betas``, ``eps``, ``weight_decay``, ``grad_clip``, ``schedule``, ``warmup_steps``,
        ``total_steps``, ``min_lr_ratio``) replace this learner's; its placement and batching
        fields (device, dtype, threads, micro-batching) are kept.

        Returns:
            The ``extra`` dict given to :meth:`save_checkpoint`.

        Raises:
            LearnerError: missing or incomplete checkpoint, another model shape, other backend.
        """
        ...

    def reset_optimizer(self, config: LearnerConfig | None = None, keep_state: bool = False) -> None:
        """Start a fresh optimizer (zero moments, ``step = 0``), optionally with a new config.

        For switching phases, e.g. from the supervised warm start to RL with its own learning
        rate and schedule. ``keep_state``: keep the moments and ``step``, so only the new
        config's learning rate and schedule apply from the next step (a fresh Adam's first step
        moves every weight by the full rate). Weights and ``version`` are unchanged. ``device``, ``dtype``,
        ``packing`` and ``gradient_checkpointing`` cannot change here (:class:`LearnerError`);
        build a new learner for that.
        """
        ...


def make_learner(
    kind: Literal["torch", "megatron"],
    hf_dir: str | Path,
    config: LearnerConfig | None = None,
    **options: Any,
) -> Learner:
    """Build a learner of backend ``kind`` from a Hugging Face model folder.

    Args:
        kind: ``"torch"`` or ``"megatron"`` (see :data:`BACKENDS`).
        hf_dir: a local folder with ``config.json`` and ``*.safetensors`` (Qwen2 / Qwen2.5,
            Qwen3 or Llama family).
        config: optimizer / batching / precision settings; defaults to ``LearnerConfig()``.
        **options: backend-specific settings (e.g. Megatron's parallel sizes), passed to the
            backend module's ``make``.

    The backend module is imported only here, so torch / megatron load on first use.
    """
    if kind not in BACKENDS:
        raise LearnerError(f"unknown learner kind {kind!r}; choose one of {sorted(BACKENDS)}")
    module = importlib.import_module(BACKENDS[kind])
    return module.make(Path(hf_dir), config or LearnerConfig(), **options)
