"""The rollout-engine contract: how a worker turns weights and an environment into episodes.

A rollout engine holds one version of the int8 policy (the *weight state* of
``docs/architecture.md``), applies PULSE deltas to it between cohorts, and plays many multi-turn
episodes at once against a text environment (:mod:`stoa.envs.base`), returning
:class:`~stoa.types.Episode` objects that the trainer learns from without re-tokenizing anything.
Two backends implement it: ``"mlx"`` (:class:`stoa.backends.mlx.MLXEngine`; Metal on Apple
silicon, CPU elsewhere) and ``"torch"`` (:class:`stoa.backends.torch.engine.TorchEngine`; CPUs and
CUDA GPUs); ``"auto"`` picks per machine (:func:`resolve_backend`). Pick one with
:func:`make_engine`. This module imports no framework; what the built-in engines hold alike is
in :mod:`stoa.backends.engine_base` (``EngineBase``, ``SingleEngineBase``), so a backend writes only
its model, its forward passes and its sampler.

Cohorts and versions
--------------------
One call to :meth:`RolloutEngine.rollout` is one *cohort*: every episode it returns was sampled
with the same weights, and carries ``policy_version == engine.version`` as it was when the call
began. Weights change only between calls: :meth:`~RolloutEngine.apply_delta` and
:meth:`~RolloutEngine.load_state` raise :class:`EngineBusyError` while a rollout runs (from
another thread, or from inside an environment callback), so no group ever mixes versions.

Episode layout
--------------
For each request ``RolloutRequest(index, group_id, num_samples)`` the engine plays
``num_samples`` episodes (``sample_index`` 0..n-1), each against its own environment instance
reset with ``options={"index": index}`` and a seed derived from the sampling seed. Each episode is

* ``prompt_tokens``: the prompt text in the engine's prompt format
  (:attr:`EngineConfig.prompt_format`, built by :func:`stoa.backends.prompting.prompt_tokens`):
  ``"chat"``, the chat template applied to ``[{"role": "user", "content": prompt}]`` with the
  generation prompt (the assistant header) appended; ``"plain"``, the text itself, continued by
  the model (base models);
* then alternating segments: a ``"model"`` segment per turn (the sampled tokens exactly as
  sampled, with behaviour log-probs; a turn's last token is the one that completed a stop
  string, or EOS, or the one that hit a cap) and, when the environment appends text, an ``"env"``
  segment holding ``tokenizer.encode(observation, add_special_tokens=False,
  split_special_tokens=True)`` (so text can never smuggle in a control token such as
  ``<|im_end|>``). Model tokens are never decoded-and-re-encoded; only observations are
  tokenized, each on its own.

``reward`` is the sum of the step rewards. ``metrics`` is the environment's last
``info["metrics"]`` plus three keys the engine adds (they win over the environment's own):
``turns`` (model turns played), ``truncated`` (bool: every finish but ``"terminated"``) and
``finish_reason``, one of

* ``"terminated"`` / ``"truncated"``: the environment ended the episode;
* ``"eos"``: the model sampled an end-of-sequence token (the turn was still passed to ``step``;
  its observation, if any, is discarded);
* ``"max_episode_tokens"``: the episode reached :attr:`SamplingConfig.max_episode_tokens`
  (mid-turn, or because the next observation would not fit with room for one more token).

A turn ends at the first of: a stop string appearing in the turn's decoded text (the token
that completes it ends the turn, so a turn's text may run a few characters past the stop string
when a token straddles it), an EOS token, :attr:`SamplingConfig.max_turn_tokens` tokens. Every
ended turn's text (EOS excluded) is passed to ``env.step``. A turn cut by the per-turn cap is
an ordinary (possibly malformed) turn: the environment decides what follows.

Behaviour log-probabilities
---------------------------
``logprobs[i] = log mu(tokens[i] | context)`` where ``mu`` is the distribution the token was
actually drawn from: ``softmax(logits / temperature)``, computed in float32 from the logits the
engine's own weights produce. With ``top_k > 0`` and/or ``top_p < 1`` (off by default, and best
left off for training), ``mu`` is the *truncated, renormalized* distribution: first the ``top_k``
most likely tokens are kept, then the smallest set of the most likely remaining tokens whose
probability mass (renormalized over the kept tokens) reaches ``top_p``; tokens tied with the last
kept probability are kept too. The recorded log-prob is then ``log`` of the token's
renormalized probability, which is larger than its full-softmax log-prob that a trainer
computes, so the trainer's importance ratio is biased low by the kept mass.

Determinism
-----------
Sampling is seeded Gumbel-max (:mod:`stoa.backends.sampling`): each token is the argmax of the
scaled, truncated logits plus noise that is a hash of (``seed``, ``group_id``, ``index``,
``sample_index``, token position, token id); no global random state is touched.
The same weights, requests, :class:`SamplingConfig` (with a fixed ``seed``) and engine
configuration replay the same episodes bit for bit, in this process or a restarted one, on the
same hardware with the same number of BLAS threads (on a CPU, ``OPENBLAS_NUM_THREADS``: another
count changes float summation order, ~2e-6 in log-probs, and so, rarely, a token whose perturbed
score ties another's that closely). With ``seed=None`` each call draws a fresh seed.

KV cache and batching
---------------------
Up to :attr:`EngineConfig.max_batch` episodes are in flight; finished ones leave and queued ones
join (continuous batching). With ``kv_reuse=True`` an episode's key/value cache survives its
turns: after an observation only the new tokens are prefilled. Samples of one prompt that start
together share one prefill of the prompt. Counters of all of this are in
:meth:`RolloutEngine.last_stats`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np


if TYPE_CHECKING:
    from stoa.backends.sampling import Draws
    from stoa.types import Episode

__all__ = [
    "BACKENDS",
    "engine_mode",
    "EngineBusyError",
    "EngineConfig",
    "EngineError",
    "EngineWrapper",
    "FINISH_REASONS",
    "RolloutEngine",
    "RolloutRequest",
    "RolloutStats",
    "SamplingConfig",
    "STAGE_BACKENDS",
    "TextCodec",
    "TurnRule",
    "make_engine",
    "resolve_backend",
    "stage_backend",
]

BACKENDS: dict[str, str] = {"mlx": "stoa.backends.mlx", "torch": "stoa.backends.torch.engine"}
"""Backend name -> module. The module exports ``make(hf_dir, *, state, version, mode, config,
worker_id, **options) -> RolloutEngine`` (the arguments of :func:`make_engine`) and
``mode(mode, **options) -> str`` (what ``mode`` resolves to here, :func:`engine_mode`). A second backend
registers here (or its module is added at run time) and the fleet uses it with no change."""

STAGE_BACKENDS: dict[str, str] = {"torch": "stoa.backends.torch.remote"}
"""Backend name -> module that runs a model's layers as pipeline stages in several processes
(``stoa stage``, ``stoa worker --stages N``). The module exports ``split_layers``, ``Stage``
(a layer range and its KV cache), ``StageService`` (a stage process's side of the channel),
``RemoteStage`` and ``RemotePipeline`` (the driver's side). Only torch has them."""


def stage_backend(name: str = "torch") -> Any:
    """The module :data:`STAGE_BACKENDS` names for ``name`` (imported on first use)."""
    if name not in STAGE_BACKENDS:
        raise EngineError(f"no pipeline stages for engine backend {name!r}; known: {sorted(STAGE_BACKENDS)}")
    return importlib.import_module(STAGE_BACKENDS[name])



def resolve_backend(name: str) -> str:
    """``name``, or for ``"auto"`` the fastest backend of this machine: MLX on Apple silicon (Metal),
    torch wherever torch and transformers are installed (CPUs: measured faster than MLX's CPU build,
    docs/rollout.md; CUDA GPUs), else MLX (a ``stoa[worker]`` install has no torch)."""
    if name != "auto":
        return name
    import importlib.util
    import platform

    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "mlx"
    have = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    return "torch" if have else "mlx"


FINISH_REASONS = ("terminated", "truncated", "eos", "max_episode_tokens")
"""Values of ``Episode.metrics["finish_reason"]`` (see the module docstring)."""


class EngineError(ValueError):
    """The engine was given something it cannot use (bad state, bad request, bad model folder)."""


class EngineBusyError(RuntimeError):
    """Weights were to change while a rollout was running (one weight version per cohort)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How one cohort samples. See the module docstring for the exact log-prob definition."""

    temperature: float = 1.0
    """Softmax temperature (> 0); behaviour log-probs are under it."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables it (the default, and what training should use)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables it."""
    max_turn_tokens: int = 256
    """Most tokens in one model turn."""
    max_episode_tokens: int = 4096
    """Most tokens in one episode (prompt, every turn and observation); bounds the KV cache."""
    stop_strings: tuple[str, ...] | None = None
    """Strings that end a turn; None uses the environment's ``env.unwrapped.stop_strings``."""
    seed: int | None = None
    """Seed of the per-token sampling hash; None draws a fresh one per call."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature} must be finite and > 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if self.max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens={self.max_turn_tokens} must be >= 1")
        if self.max_episode_tokens < 2:
            raise ValueError(f"max_episode_tokens={self.max_episode_tokens} must be >= 2")
        if self.stop_strings is not None:
            if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
                raise ValueError("stop_strings must be a tuple of non-empty strings (or None)")
            object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed={self.seed!r} must be None or an int in [0, 2**63)")


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt of a cohort: dataset item ``index``, played ``num_samples`` times (a group)."""

    index: int
    """Dataset item, passed to ``env.reset(options={"index": index})``."""
    group_id: str
    """Id shared by the group's episodes (``Episode.group_id``); also keys their sampling hash."""
    num_samples: int = 1
    """Episodes to play for this prompt (G); ``sample_index`` runs over ``0..num_samples-1``."""

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, (int, np.integer)) or self.index < 0:
            raise ValueError(f"index={self.index!r} must be a non-negative int")
        if not isinstance(self.group_id, str):
            raise ValueError(f"group_id must be a str, got {type(self.group_id).__name__}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples={self.num_samples} must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    """Batching, cache and prompt policy of an engine (backend-independent knobs)."""

    max_batch: int = 64
    """Most episodes in flight at once (rows of the decode batch)."""
    kv_reuse: bool = True
    """Keep each episode's KV cache across turns; False re-prefills the whole history after every
    observation (a baseline for benchmarks)."""
    share_prompt_prefill: bool = True
    """Prefill a prompt once for the samples of it that start together, then copy the cache."""
    prefill_chunk: int = 512
    """Most tokens per row in one prefill forward pass (bounds activation memory)."""
    sampler: Literal["auto", "host", "device"] = "auto"
    """Where sampling math runs: ``host`` (numpy; fastest on CPU-only machines), ``device`` (the
    accelerator), or ``auto`` (device when there is a GPU, else host). Both implement one rule and
    draw the same tokens (barring a float-rounding tie at a CDF boundary)."""
    prompt_format: Literal["auto", "chat", "plain"] = "auto"
    """How prompts become tokens (:mod:`stoa.backends.prompting`): ``chat`` (the chat template),
    ``plain`` (the text continued, for base models), ``auto`` (chat when the tokenizer has a
    template). An engine resolves it once, when built, and refuses a format its tokenizer cannot use."""

    def __post_init__(self) -> None:
        from stoa.backends.prompting import FORMATS

        if self.prompt_format not in FORMATS:
            raise ValueError(f"prompt_format={self.prompt_format!r} must be one of {list(FORMATS)}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch} must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 1")
        if self.sampler not in ("auto", "host", "device"):
            raise ValueError(f"sampler={self.sampler!r} must be auto, host or device")


@dataclass(frozen=True)
class TurnRule:
    """Where a model turn ends (the module docstring's rule), as one function that the engine's
    rollout loop and the trainer's replay (``stoa.fleet.trust.replay``) both call."""

    eos_ids: frozenset[int]
    stops: tuple[str, ...]
    stop_ids: frozenset[int]
    """Tokens after which a stop string can complete (:meth:`TextCodec.stop_candidates`)."""
    decode: Callable[[Sequence[int]], str]
    max_turn_tokens: int
    max_episode_tokens: int

    def end(self, turn: Sequence[int], length: int) -> str | None:
        """Why the turn ends at its last token, or None. ``length``: the episode's tokens so far,
        that token included. First match wins: ``"eos"``, ``"max_episode_tokens"``, ``"stop"``,
        ``"max_turn_tokens"``."""
        tok = turn[-1]
        if tok in self.eos_ids:
            return "eos"
        if length >= self.max_episode_tokens:
            return "max_episode_tokens"
        if tok in self.stop_ids and any(s in self.decode(turn) for s in self.stops):
            return "stop"
        if len(turn) >= self.max_turn_tokens:
            return "max_turn_tokens"
        return None


@dataclass(frozen=True)
class TextCodec:
    """How an engine turns text into tokens and back (see "Episode layout"): everything a replay
    of its episodes must reproduce, so a second engine brings its own and replay follows it."""

    prompt_tokens: Callable[[str], list[int]]
    """An episode's first tokens for the environment's prompt text, in :attr:`prompt_format`
    (:func:`stoa.backends.prompting.prompt_tokens`)."""
    encode: Callable[[str], list[int]]
    """An observation's tokens (no special tokens added, none parsed from the text)."""
    decode: Callable[[Sequence[int]], str]
    """A turn's text (special tokens kept)."""
    eos_ids: frozenset[int]
    """Tokens that end an episode."""
    stop_candidates: Callable[[tuple[str, ...]], frozenset[int]]
    """Tokens whose text holds the last character of a stop string (a superset is correct, only slower)."""
    prompt_format: Literal["chat", "plain"] = "chat"
    """The resolved prompt format :attr:`prompt_tokens` builds (never ``"auto"``)."""

    def turn_rule(self, stops: tuple[str, ...], max_turn_tokens: int, max_episode_tokens: int) -> TurnRule:
        stops = tuple(stops)
        return TurnRule(self.eos_ids, stops, self.stop_candidates(stops) if stops else frozenset(), self.decode,
                        max_turn_tokens, max_episode_tokens)


@dataclass
class RolloutStats:
    """What the last :meth:`RolloutEngine.rollout` call did (for logs and benchmarks)."""

    episodes: int = 0
    model_tokens: int = 0
    """Tokens sampled (every model segment)."""
    env_tokens: int = 0
    """Observation tokens appended."""
    prefill_tokens: int = 0
    """Tokens run through prefill forward passes (prompts, observations, re-prefilled history)."""
    prefill_saved_kv: int = 0
    """History tokens not re-prefilled after observations thanks to KV reuse."""
    prefill_saved_shared: int = 0
    """Prompt tokens not prefilled thanks to prompt sharing within a group."""
    decode_steps: int = 0
    """Batched decode forward passes."""
    prefill_calls: int = 0
    """Prefill forward passes (each may hold many rows and chunks)."""
    turns: int = 0
    wall_s: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def prefill_saved_fraction(self) -> float:
        """Prefill tokens avoided by KV reuse, over what prefill would cost without it."""
        total = self.prefill_tokens + self.prefill_saved_kv
        return self.prefill_saved_kv / total if total else 0.0


@runtime_checkable
class RolloutEngine(Protocol):
    """An int8 policy that plays episodes. See the module docstring for every convention.

    Attributes:
        version: the policy version of the weights held (set by the constructor,
            :meth:`load_state` and :meth:`apply_delta`); stamped on every episode.
        mode: how the backend computes (for MLX: ``"quantized"`` int8 kernels or
            ``"dequantized"`` float32 weights rebuilt from the int8 codes).
        vocab_size: rows of the embedding matrix; every token id produced is below it.
        tokenizer: the model's tokenizer (Hugging Face API: ``encode``, ``decode``,
            ``apply_chat_template``).
        state: the live weight state, ``dict[str, numpy.ndarray]`` keyed by HF names (int8
            codes as uint8, scales, biases, unquantized tensors). Treat it as read-only; change
            weights through :meth:`load_state` / :meth:`apply_delta`.
        worker_id: stamped on every episode (``Episode.worker_id``); given at construction.
        codec: the engine's :class:`TextCodec` (prompt template, observation encoding, turn
            decoding, EOS and stop-token candidates); replay uses it to rebuild episodes.
        built_config: what the backend built, in :class:`stoa.models.hfconfig.ModelSpec`'s
            field names (RoPE base and scaling, norm eps, head size, tied head, ...); the
            start-up parity check (:mod:`stoa.fleet.parity`) compares it with the run's config.
    """

    version: int

    @property
    def codec(self) -> TextCodec: ...

    @property
    def built_config(self) -> dict[str, Any]: ...

    @property
    def worker_id(self) -> str: ...

    @property
    def mode(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def state(self) -> dict[str, np.ndarray]: ...

    def load_state(self, version: int, state: dict[str, np.ndarray]) -> None:
        """Replace every weight with ``state`` (same names, shapes and dtypes as :attr:`state`).

        Raises:
            EngineError: the state's layout differs from the engine's.
            EngineBusyError: a rollout is running.
        """

    def apply_delta(self, version: int, blob: bytes) -> list[str]:
        """Apply a PULSE delta (:mod:`stoa.transport.pulse`) to the live weights, in place.

        Afterwards :attr:`state` equals ``pulse.apply_delta(old_state, blob)`` exactly and
        :meth:`state_hash` equals the trainer's hash of that version. Only the tensors the delta
        touches are rebuilt. Returns the names that changed.

        Raises:
            stoa.transport.pulse.PulseError: the blob is malformed or made for another layout
                (the weights are then unchanged).
            EngineBusyError: a rollout is running.
        """

    def update_inplace(self, write: Callable[[dict[str, np.ndarray]], tuple[int, Sequence[str]]]) -> list[str]:
        """Change the live weights in place between cohorts (how a worker follows the chain).

        ``write(state) -> (version, changed_names)`` writes new values into the arrays of
        :attr:`state` (same shapes and dtypes; e.g. ``WeightSubscriber.sync(..., apply_inplace=True)``
        writing a verified delta); the engine then rebuilds whatever depends on the changed
        tensors, sets :attr:`version`, and returns the changed names. If ``write`` raises, the
        exception propagates and :attr:`version` is unchanged; ``write`` must leave the arrays
        intact in that case (verify before writing).

        Raises:
            EngineBusyError: a rollout is running.
        """

    def state_hash(self) -> str:
        """``stoa.transport.pulse.state_hash(self.state)``."""

    def rollout(
        self,
        make_env: Callable[[], Any],
        requests: Sequence[RolloutRequest],
        sampling: SamplingConfig = SamplingConfig(),
    ) -> list[Episode]:
        """Play every request's samples; return episodes in request order, then sample order.

        Args:
            make_env: zero-argument factory of a text environment (:class:`stoa.envs.TextEnv`,
                possibly wrapped by ``gymnasium.make``). The engine creates at most
                ``max_batch`` instances, resets one for each episode, and keeps them for the
                next call that passes the same factory object.
            requests: the prompts of this cohort.
            sampling: sampling settings, caps, stop strings and seed.

        Returns:
            ``sum(r.num_samples for r in requests)`` valid episodes
            (``Episode.validate(vocab_size)`` passes), each with ``policy_version``,
            ``worker_id``, ``env_id`` (the environment's registered id, or ``""``),
            ``group_id``, ``sample_index``, ``item_index`` (the request's ``index``), ``temperature``
            and ``top_p`` filled in.

        Raises:
            EngineError: bad requests, or a prompt longer than ``max_episode_tokens - 1``.
            Any exception of the environment propagates (the cohort is abandoned).
        """

    def score(self, episodes: Sequence[Episode], temperature: float | None = None) -> list[np.ndarray]:
        """Teacher-forced log-probs of the episodes' tokens under the current weights.

        Same alignment as :meth:`stoa.backends.learner.Learner.logprobs`: one float32 array
        ``[len(episode)]`` per episode, entry ``t`` is ``log p(tokens[t] | tokens[:t])`` at the
        temperature (``None``: each episode's own ``temperature``; no top-k/top-p), entry 0 is
        ``0.0``. At model tokens this recomputes the behaviour log-probs.
        """

    def sampling_margins(self, episodes: Sequence[Episode], seeds: Sequence[int], top_k: int = 0,
                         drift: float = 0.0) -> list[np.ndarray]:
        """Whether each sampled token is the one the sampling rule draws under the current weights.

        For each episode (sampled with cohort seed ``seeds[i]``) and each of its model tokens in
        order: re-derive the token's noise from the seed, the episode's ``group_id``,
        ``item_index``, ``sample_index`` and the token's position (see "Determinism"), and return
        its margin (:func:`stoa.backends.sampling.draw_margins`): by how many raw logits it beats
        every other token the episode's ``temperature`` / ``top_p`` (and ``top_k``) keep, under
        these weights' logits. Positive: the rule draws it. Logits that differ by at most ``d`` per
        entry move a margin by at most ``2 d``, so an honest token's margin is ``>= -2 d`` under
        another stack's drift ``d``; ``drift`` is that allowance for which tokens top-k / top-p keep
        (the set most favourable to the drawer is used; a token kept under no such drift: ``-inf``).
        float64, one array per episode.
        """

    def check_draws(self, episodes: Sequence[Episode], seeds: Sequence[int], top_k: int = 0,
                    drift: float = 0.0) -> list[Draws]:
        """:meth:`sampling_margins` and the sampled tokens' log-probs (full softmax at the
        episode's temperature, as :meth:`score` gives them), from one forward pass: one
        :class:`stoa.backends.sampling.Draws` per episode."""

    def last_stats(self) -> RolloutStats:
        """Counters of the last :meth:`rollout` call."""


def make_engine(
    hf_dir: str | Path,
    backend: str = "mlx",
    *,
    state: dict[str, np.ndarray] | None = None,
    version: int = 0,
    mode: str = "auto",
    config: EngineConfig = EngineConfig(),
    worker_id: str = "",
    **options: Any,
) -> RolloutEngine:
    """Build a rollout engine of ``backend``; the only way the runtime makes one.

    Args:
        hf_dir: a local Hugging Face folder: its config and tokenizer always; its float weights
            (quantized to int8 on load) only when ``state`` is None.
        backend: a key of :data:`BACKENDS`, or ``"auto"`` (:func:`resolve_backend`).
        state: an int8 weight state (``stoa.transport.quant.quantize_state`` layout, e.g. an anchor
            from the weight chain) to start from instead of the folder's weights; copied.
        version: the policy version of those weights.
        mode: the backend's compute mode (``"auto"`` picks the fastest exact one for the machine).
        config: batching and cache policy.
        worker_id: stamped on every episode.
        **options: backend-specific settings.

    Raises:
        EngineError: unknown backend, or a state / folder the backend cannot use.
    """
    backend = resolve_backend(backend)
    if backend not in BACKENDS:
        raise EngineError(f"unknown engine backend {backend!r}; known: {sorted(BACKENDS)}")
    module = importlib.import_module(BACKENDS[backend])
    return module.make(Path(hf_dir), state=state, version=version, mode=mode, config=config, worker_id=worker_id,
                       **options)


def engine_mode(backend: str, mode: str = "auto", **options: Any) -> str:
    """The compute mode an engine of ``backend`` built here with ``mode`` (and ``options``, e.g.
    ``device``) would run in, ``"auto"`` resolved, without building one (imports the backend).

    Raises:
        EngineError: unknown backend, or a mode the backend cannot run here.
    """
    backend = resolve_backend(backend)
    if backend not in BACKENDS:
        raise EngineError(f"unknown engine backend {backend!r}; known: {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[backend]).mode(mode, **options)


class EngineWrapper:
    """A rollout engine around another, as a Gymnasium wrapper is an env around an env.

    Every member of :class:`RolloutEngine` is the wrapped engine's (``self.engine``) unless a
    subclass overrides it, so a wrapper changes one behaviour and keeps the rest of the contract:
    :meth:`rollout` to change what a cohort is (how it samples, what it returns),
    :meth:`update_inplace` to change how weights arrive. :attr:`version` reads and writes the
    wrapped engine's. An override keeps the protocol's signature. A worker takes a wrapper through
    its ``wrap_engine`` argument (:class:`stoa.fleet.worker.Worker`); the test doubles of
    :mod:`stoa.testing.adversaries` are wrappers.
    """

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    @property
    def unwrapped(self) -> RolloutEngine:
        """The innermost engine."""
        inner = self.engine
        return inner.unwrapped if isinstance(inner, EngineWrapper) else inner

    @property
    def version(self) -> int:
        return self.engine.version

    @version.setter
    def version(self, value: int) -> None:
        self.engine.version = value

    def rollout(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                sampling: SamplingConfig = SamplingConfig()) -> list[Episode]:
        return self.engine.rollout(make_env, requests, sampling)

    def update_inplace(self, write: Callable[[dict[str, np.ndarray]], tuple[int, Sequence[str]]]) -> list[str]:
        return self.engine.update_inplace(write)

    def __getattr__(self, name: str) -> Any:  # every other member: the wrapped engine's
        if name == "engine":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)
