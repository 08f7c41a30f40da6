"""The MLX rollout engine: an int8 policy, live PULSE deltas, batched multi-turn episodes.

Conventions (cohorts, episode layout, log-probs, determinism) are those of
:mod:`stoa.backends.engine`; the batching loop is :mod:`stoa.backends.mlx.rollout`; the two
compute modes and the weight state are :mod:`stoa.backends.mlx.weights`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from stoa.backends.engine import EngineConfig, EngineError, RolloutRequest, SamplingConfig
from stoa.backends.engine_base import SingleEngineBase
from stoa.backends.mlx import fast
from stoa.backends.mlx import weights as W
from stoa.backends.mlx.rollout import Cohort
from stoa.backends.mlx.sampling import HostSampler, device_sample
from stoa.backends.packing import padded_tokens
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


class MLXEngine(SingleEngineBase):
    """A :class:`stoa.backends.engine.RolloutEngine` on MLX. Build with :meth:`from_pretrained`
    or :meth:`from_state`; attributes and methods are documented on the protocol, and those of
    every engine on :class:`~stoa.backends.engine_base.EngineBase`. Also: ``fast_ops`` (whether
    :mod:`stoa.backends.mlx.fast` runs)."""

    def __init__(self, hf_dir: Path, model: Any, model_config: dict[str, Any], mode: str, version: int,
                 config: EngineConfig, fast_ops: bool | None = None, worker_id: str = "") -> None:
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
        from mlx_lm.utils import load_tokenizer

        # Every layer gets a full batched cache; a sliding one masks it (stoa.backends.mlx.attention).
        if any(type(c) not in (KVCache, RotatingKVCache) for c in make_prompt_cache(model)):
            raise EngineError(f"{hf_dir}: the model needs recurrent or other non-attention caches, which the "
                              "engine's batched attention cache does not implement")
        self._model = model
        built = W.built_fields(model)
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
        tok = load_tokenizer(hf_dir, eos_token_ids=model_config.get("eos_token_id"))
        vocab = int(model_config["vocab_size"])
        text = TokenizerText(getattr(tok, "_tokenizer", tok), tok.eos_token_ids, vocab, str(hf_dir),
                             config.prompt_format)
        super().__init__(hf_dir, config, version, worker_id, mode=mode, vocab_size=vocab, tokenizer=tok,
                         codec=text.codec, built=built)
        self._host_sampler = HostSampler()

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
    def mlx_model(self) -> Any:
        """The ``mlx_lm`` model the engine runs (its int8 layers, with the engine's fast ops installed)."""
        return self._model

    @property
    def body(self) -> Any:
        """The model up to its output head (the whole model when the head is not split off): what
        a prefill runs without computing logits."""
        return self._body

    # -- weights --------------------------------------------------------------------------------
    def _check_state(self, state: dict[str, np.ndarray]) -> None:
        W.check_state(state, W.layout(self._state), exact_dtypes=True)

    def _drain(self) -> None:
        mx.synchronize()

    def _rebuild(self, names: Sequence[str]) -> None:
        if self._mode == "dequantized":
            W.rebuild_float(self._model, self._state, self._stems, list(names))
        else:
            W.refresh_float32(self._model, self._state, self._f32_twins.intersection(names))

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

    def _cohort(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest], sampling: SamplingConfig,
                envs: list[Any]) -> Cohort:
        return Cohort(self, make_env, requests, sampling, envs)

    # -- scoring --------------------------------------------------------------------------------
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
