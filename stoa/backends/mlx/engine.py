"""The MLX rollout engine: an int8 policy, live PULSE deltas, batched multi-turn episodes.

Conventions (cohorts, episode layout, log-probs, determinism) are those of
:mod:`stoa.backends.engine`; the batching loop is :mod:`stoa.backends.mlx.rollout`; the two
compute modes and the weight state are :mod:`stoa.backends.mlx.weights`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from stoa.backends.engine import (
    EngineBusyError, EngineConfig, EngineError, RolloutRequest, RolloutStats, SamplingConfig, TextCodec,
)
from stoa.backends.mlx import fast
from stoa.backends.mlx import weights as W
from stoa.backends.mlx.rollout import Cohort
from stoa.backends.packing import by_length, padded_tokens
from stoa.backends.mlx.sampling import HostSampler, device_sample
from stoa.backends.sampling import Draws, margin_plan
from stoa.backends.text import TokenizerText
from stoa.types import Episode

MODES = ("auto", "quantized", "dequantized")


def resolve_mode(mode: str) -> str:
    """``auto``: MLX's int8 kernels on Metal; on CPUs, float32 compute (MLX's int8 matmul on x86
    is 3-26x slower than float32 with OpenBLAS, see docs/rollout.md)."""
    if mode not in MODES:
        raise EngineError(f"mode={mode!r} must be one of {MODES}")
    if mode == "auto":
        return "quantized" if mx.metal.is_available() else "dequantized"
    return mode


class MLXEngine:
    """A :class:`stoa.backends.engine.RolloutEngine` on MLX. Build with :meth:`from_pretrained`
    or :meth:`from_state`; attributes and methods are documented on the protocol. Also:
    ``config`` (an :class:`EngineConfig`, replaceable between cohorts; its ``prompt_format`` is
    resolved once, at construction), ``prompt_format`` (``"chat"`` or ``"plain"``), ``fast_ops``
    (whether :mod:`stoa.backends.mlx.fast` runs), ``eos_ids`` (token ids that end an episode)."""

    def __init__(self, hf_dir: Path, model: Any, model_config: dict[str, Any], mode: str, version: int,
                 config: EngineConfig, fast_ops: bool | None = None, worker_id: str = "") -> None:
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
        from mlx_lm.utils import load_tokenizer

        # Every layer gets a full batched cache; a sliding one masks it (stoa.backends.mlx.attention).
        if any(type(c) not in (KVCache, RotatingKVCache) for c in make_prompt_cache(model)):
            raise EngineError(f"{hf_dir}: the model needs recurrent or other non-attention caches, which the "
                              "engine's batched attention cache does not implement")
        self.hf_dir, self.config, self.version, self._worker_id = hf_dir, config, int(version), str(worker_id)
        self._model, self._mode = model, mode
        self._built = W.built_fields(model)
        self._stems = W.quantized_stems(model)
        self._state = W.state_views(model)
        self._f32_twins: set[str] = set()
        if mode == "dequantized":
            W.dequantize(model)
        else:
            self._f32_twins = W.float32_compute(model, self._state)
        on_gpu = mx.metal.is_available()
        self.fast_ops = fast.install(model) if (not on_gpu if fast_ops is None else fast_ops) else False
        split = W.split_head(model)
        self._body = split[0] if split else model
        self._head = split[1] if split else None
        self._tok = load_tokenizer(hf_dir, eos_token_ids=model_config.get("eos_token_id"))
        self._vocab = int(model_config["vocab_size"])
        self._text = TokenizerText(getattr(self._tok, "_tokenizer", self._tok), self._tok.eos_token_ids,
                                   self._vocab, str(hf_dir), config.prompt_format)
        self.prompt_format = self._text.prompt_format
        self.eos_ids = self._text.eos_ids
        self._host_sampler = HostSampler()
        self._lock = threading.Lock()
        self._stats = RolloutStats()
        self._envs: tuple[Any, list[Any]] = (None, [])  # (factory, idle instances) kept across cohorts

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, hf_dir: str | Path, mode: str = "auto", version: int = 0,
                        config: EngineConfig = EngineConfig(), fast_ops: bool | None = None,
                        worker_id: str = "") -> MLXEngine:
        """Load a float HF folder with ``mlx_lm`` (offline) and quantize it to int8 / group 64
        exactly as ``mlx_lm`` does. ``fast_ops``: use :mod:`stoa.backends.mlx.fast` for Qwen2
        models (None: on CPUs, where it is ~2x faster for small models)."""
        mode = resolve_mode(mode)
        model, cfg = W.load_model(hf_dir, with_weights=True)
        W.quantize(model, cfg)
        mx.eval(model.parameters())
        return cls(Path(hf_dir), model, cfg, mode, version, config, fast_ops, worker_id)

    @classmethod
    def from_state(cls, hf_dir: str | Path, state: dict[str, np.ndarray], version: int, mode: str = "auto",
                   config: EngineConfig = EngineConfig(), fast_ops: bool | None = None,
                   worker_id: str = "") -> MLXEngine:
        """Config and tokenizer from ``hf_dir`` (weights there, if any, are not read); weights from
        a weight state (e.g. an anchor from the weight channel). The state is copied."""
        mode = resolve_mode(mode)
        model, cfg = W.load_model(hf_dir, with_weights=False)
        W.quantize(model, cfg)
        W.check_state(state, W.skeleton_layout(model), exact_dtypes=False)
        W.load_state_into(model, state)
        return cls(Path(hf_dir), model, cfg, mode, version, config, fast_ops, worker_id)

    # -- attributes -----------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @property
    def mlx_model(self) -> Any:
        """The ``mlx_lm`` model the engine runs (its int8 layers, with the engine's fast ops installed)."""
        return self._model

    @property
    def built_config(self) -> dict[str, Any]:
        return dict(self._built)

    @property
    def body(self) -> Any:
        """The model up to its output head (the whole model when the head is not split off): what
        a prefill runs without computing logits."""
        return self._body

    @property
    def tokenizer(self) -> Any:
        return self._tok

    @property
    def state(self) -> dict[str, np.ndarray]:
        return self._state

    def last_stats(self) -> RolloutStats:
        return self._stats

    # -- weights --------------------------------------------------------------------------------
    def _exclusive(self, what: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError(f"{what} while a rollout is running: weights change only between cohorts")

    def load_state(self, version: int, state: dict[str, np.ndarray]) -> None:
        self._exclusive("load_state")
        try:
            W.check_state(state, W.layout(self._state), exact_dtypes=True)
            mx.synchronize()
            for k, v in state.items():
                np.copyto(self._state[k], v)
            if self._mode == "dequantized":
                W.rebuild_float(self._model, self._state, self._stems, list(self._state))
            else:
                W.refresh_float32(self._model, self._state, self._f32_twins)
            self.version = int(version)
        finally:
            self._lock.release()

    def apply_delta(self, version: int, blob: bytes) -> list[str]:
        from stoa.transport import pulse

        return self.update_inplace(lambda state: (version, pulse.apply_delta_inplace(state, blob)))

    def update_inplace(self, write: Callable[[dict[str, np.ndarray]], tuple[int, Sequence[str]]]) -> list[str]:
        """Change the live weights in place between cohorts: ``write(state) -> (version, changed names)``
        writes into the state's arrays (e.g. a ``WeightSubscriber.sync(..., apply_inplace=True)``);
        then whatever depends on the changed tensors is rebuilt. Returns the changed names."""
        self._exclusive("update_inplace")
        try:
            mx.synchronize()  # nothing may still be reading the buffers written below
            version, changed = write(self._state)
            changed = list(changed)
            if changed and self._mode == "dequantized":
                W.rebuild_float(self._model, self._state, self._stems, changed)
            elif changed:
                W.refresh_float32(self._model, self._state, self._f32_twins.intersection(changed))
            self.version = int(version)
            return changed
        finally:
            self._lock.release()

    def state_hash(self) -> str:
        from stoa.transport import pulse

        return pulse.state_hash(self._state)

    # -- text -----------------------------------------------------------------------------------
    @property
    def codec(self) -> TextCodec:
        return self._text.codec

    def encode(self, text: str) -> list[int]:
        """Observation tokens: no BOS/EOS added, special-token strings not parsed as control tokens."""
        return self._text.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self._text.decode(tokens)

    def prompt_tokens(self, prompt: str) -> list[int]:
        return self._text.prompt_tokens(prompt)

    def stop_candidates(self, stops: tuple[str, ...]) -> frozenset[int]:
        return self._text.stop_candidates(stops)

    # -- generation -----------------------------------------------------------------------------
    def sample_tokens(self, logits: mx.array, seeds: np.ndarray, s: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and behaviour log-probs for logits ``[B, V]`` and uint64 row seeds ``[B]`` (see
        :mod:`stoa.backends.mlx.sampling`)."""
        where = self.config.sampler
        if where == "device" or (where == "auto" and mx.metal.is_available()):
            return device_sample(logits, seeds, s.temperature, s.top_k, s.top_p)
        if logits.dtype != mx.float32:  # a bfloat16 model's logits have no numpy buffer format
            logits = logits.astype(mx.float32)
        mx.eval(logits)
        return self._host_sampler(np.array(logits, copy=False), seeds, s.temperature, s.top_k, s.top_p)

    def rollout(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                sampling: SamplingConfig = SamplingConfig()) -> list[Episode]:
        if not callable(make_env):
            raise EngineError("make_env must be a zero-argument callable returning an environment")
        for r in requests:
            if not isinstance(r, RolloutRequest):
                raise EngineError(f"requests must be RolloutRequest objects, got {type(r).__name__}")
        if not isinstance(sampling, SamplingConfig):
            raise EngineError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        self._exclusive("rollout")
        try:
            factory, idle = self._envs
            cohort = Cohort(self, make_env, requests, sampling, idle if factory is make_env else [])
            try:
                return cohort.run()
            finally:
                self._stats = cohort.stats
                self._envs = (make_env, cohort.free_envs)
        finally:
            self._lock.release()

    def score(self, episodes: Sequence[Episode], temperature: float | None = None,
              max_tokens: int = 8192) -> list[np.ndarray]:
        """See the protocol. ``max_tokens`` bounds the tokens of one batched forward pass."""
        if temperature is not None and not temperature > 0:
            raise EngineError(f"temperature={temperature} must be > 0")
        self._exclusive("score")
        try:
            return self._score(episodes, temperature, max_tokens)
        finally:
            self._lock.release()

    def sampling_margins(self, episodes: Sequence[Episode], seeds: Sequence[int], top_k: int = 0,
                         drift: float = 0.0, max_tokens: int = 8192) -> list[np.ndarray]:
        """See the protocol. ``max_tokens`` bounds the tokens of one batched forward pass."""
        return [d.margins for d in self.check_draws(episodes, seeds, top_k, drift, max_tokens)]

    def check_draws(self, episodes: Sequence[Episode], seeds: Sequence[int], top_k: int = 0,
                    drift: float = 0.0, max_tokens: int = 8192) -> list[Draws]:
        """See the protocol. ``max_tokens`` bounds the tokens of one batched forward pass."""
        if len(seeds) != len(episodes):
            raise EngineError("one seed per episode")
        self._exclusive("check_draws")
        try:
            return by_length([len(e) for e in episodes], max_tokens, lambda b: self._draws_batch(
                [episodes[i] for i in b], [int(seeds[i]) for i in b], top_k, drift))
        finally:
            self._lock.release()

    def _draws_batch(self, eps: Sequence[Episode], seeds: Sequence[int], top_k: int, drift: float) -> list[Draws]:
        _, x = padded_tokens(eps, self._vocab, np.int32, EngineError)
        plan = margin_plan(eps, seeds, x)
        margins, logprobs = np.empty(plan.at.size, np.float64), np.empty(plan.at.size, np.float64)
        if margins.size:
            xs = mx.array(plan.x)
            hidden = self._body(xs) if self._head is not None else None
            full = self._model(xs) if hidden is None else None
            step = max(1, (1 << 22) // self._vocab)  # bound the float logits held at once
            for a in range(0, margins.size, step):
                r = mx.array(plan.src[a:a + step].astype(np.int32))
                c = mx.array((plan.at[a:a + step] - 1).astype(np.int32))
                logits = self._head(hidden[r, c]) if hidden is not None else full[r, c]
                b = a + len(plan.src[a:a + step])
                margins[a:b], logprobs[a:b] = plan.margins(a, np.array(logits.astype(mx.float32), dtype=np.float32),
                                                           top_k, drift)
        return plan.draws(margins, logprobs)

    def _score(self, episodes: Sequence[Episode], temperature: float | None, max_tokens: int) -> list[np.ndarray]:
        return by_length([len(e) for e in episodes], max_tokens,
                         lambda b: self._score_batch([episodes[i] for i in b], temperature))

    def _score_batch(self, eps: Sequence[Episode], temperature: float | None) -> list[np.ndarray]:
        toks, x = padded_tokens(eps, self._vocab, np.int32, EngineError)
        width = x.shape[1]
        inv_t = mx.array([1.0 / (temperature or ep.temperature) for ep in eps], dtype=mx.float32)[:, None, None]
        xs = mx.array(x)
        hidden = self._body(xs) if self._head is not None else None
        full = self._model(xs) if hidden is None else None
        chunk = max(1, (1 << 22) // (len(eps) * self._vocab))  # bound the float32 logits held at once
        parts = []
        for a in range(0, width - 1, chunk):
            b = min(width - 1, a + chunk)
            logits = self._head(hidden[:, a:b]) if hidden is not None else full[:, a:b]
            z = logits.astype(mx.float32) * inv_t
            logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
            parts.append(mx.take_along_axis(logp, xs[:, a + 1:b + 1, None], axis=-1)[..., 0])
            mx.eval(parts[-1])
        lp = np.array(mx.concatenate(parts, axis=1)) if parts else np.zeros((len(eps), 0), np.float32)
        return [np.concatenate([[0.0], lp[r, :len(t) - 1]]).astype(np.float32) for r, t in enumerate(toks)]
