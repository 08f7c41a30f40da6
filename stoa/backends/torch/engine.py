"""The torch rollout engine (``make_engine(..., backend="torch")``): CPUs and CUDA GPUs.

Conventions (cohorts, episode layout, log-probs, determinism) are those of
:mod:`stoa.backends.engine`; the batching loop is :mod:`stoa.backends.torch.rollout`, the model
:mod:`stoa.backends.torch.decoder`, the sampler :mod:`stoa.backends.torch.sample`.

The int8 weight state (uint8 codes, scales, biases, unquantized tensors; numpy, owned by the
engine) is the state of record. The model computes with its weights of record, ``code * scale +
bias`` evaluated in float32 (:func:`stoa.backends.torch.int8.dequantize_torch`, what the trainer's
re-score uses), in one of these modes:

* ``int24`` (x86 CPUs with AVX-512 VNNI or AVX2; ``auto``'s choice with VNNI): the int8 kernel's
  integer path (:mod:`stoa.backends.torch.qlinear`; the same results bit for bit on both). No float32
  weights are held; each matmul's input is rounded per group of 64 to 24-bit integers (an error of
  at most 6e-8 of the group's largest entry: float32's class) and multiplied with the codes by
  exact integer dot products.
* ``quantized`` (``auto``'s choice on other CPUs where the kernel builds, AVX2-only ones included):
  the same kernel's float32 path: the weights of record are dequantized in cache and multiplied in
  float32, a float32 matmul's results up to the order of the sums.
* ``int16`` (x86 CPUs with AVX-512 VNNI or AVX2; never ``auto``'s choice): the integer path on 16-bit
  inputs: faster still at batch 16-64, and its log-probs drift from a float32 re-score by up to
  ~7e-3 (docs/rollout.md, docs/trust.md): measure it on your model before a run admits it.
* ``dequantized`` (``auto``'s choice on GPUs): float32 weights and float32 activations. On
  CUDA, TF32 matmuls are turned off for the engine's calls, so a GPU computes what a CPU does up to
  summation order.
* ``bfloat16`` (for GPUs; a CPU without bfloat16 units runs it ~25x slower): the same weights rounded to bfloat16, bfloat16 activations (norms and the
  softmaxes in float32), float32 logits. Faster, and further from the trainer's float32 re-score:
  measure its drift before a run admits it (``benchmarks/gpu_engine.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stoa.backends.engine import EngineConfig, EngineError, RolloutRequest, SamplingConfig
from stoa.backends.engine_base import SingleEngineBase
from stoa.backends.sampling import Draws, HostSampler
from stoa.backends.text import TokenizerText, config_eos_ids
from stoa.backends.torch import csample as C
from stoa.backends.torch import decoder as D
from stoa.backends.torch import sample as S
from stoa.backends.torch import scoring
from stoa.backends.torch.int8 import dequantize_torch, to_torch
from stoa.backends.torch.rollout import Cohort
from stoa.models.hfconfig import ModelSpec
from stoa.types import Episode

__all__ = ["ENGINE_DTYPES", "KERNEL_MODES", "MODES", "TorchEngine", "built_fields", "check_state", "draw",
           "exact_matmuls", "make", "pretrained_state", "rebuild", "state_layout"]

MODES = ("auto", "int24", "int16", "quantized", "dequantized", "bfloat16")
ENGINE_DTYPES = {"int24": torch.float32, "int16": torch.float32, "quantized": torch.float32,
                 "dequantized": torch.float32, "bfloat16": torch.bfloat16}
KERNEL_MODES = ("int24", "int16", "quantized")
"""The modes that compute on the int8 kernel (CPUs; no float32 weights held)."""
DIGITS = {"int24": 3, "int16": 2}
"""The integer modes' input bytes (the kernel's integer path)."""


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError(f"device={setting!r} but torch sees no CUDA device")
    return torch.device(setting)


def resolve_mode(mode: str, device: torch.device) -> str:
    """``auto``: on a CPU ``int24`` where the kernel's integer path beats its float32 path (AVX-512
    VNNI), else ``quantized`` where the int8 kernel builds, else ``dequantized``; on a GPU ``dequantized``.
    ``int16`` is never ``auto``'s choice: it trades ~100x float32's drift for speed (docs/rollout.md)."""
    from stoa.backends.torch import qlinear

    if mode not in MODES:
        raise EngineError(f"mode={mode!r} must be one of {MODES}")
    if mode in KERNEL_MODES:
        if device.type != "cpu":
            raise EngineError(f"mode={mode!r} runs on CPUs (on a GPU use 'dequantized' or 'bfloat16')")
        ok, why = (qlinear.integer_available if mode in DIGITS else qlinear.available)()
        if not ok:
            raise EngineError(f"mode={mode!r} needs the int8 kernel{' integer path' if mode in DIGITS else ''}: {why}")
    if mode == "auto":
        if device.type != "cpu":
            return "dequantized"
        if qlinear.integer_faster():
            return "int24"
        return "quantized" if qlinear.available()[0] else "dequantized"
    return mode


@contextlib.contextmanager
def exact_matmuls(device: torch.device) -> Iterator[None]:
    """No TF32 in the engine's CUDA matmuls (float32 means float32)."""
    if device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def state_layout(decoder: D.Decoder) -> dict[str, tuple[tuple[int, ...], bool]]:
    """State name -> (shape, is uint8 codes) that the decoder's parameters need."""
    from stoa.transport.quant import is_quantized

    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, t in decoder.views.items():
        shape = tuple(t.shape)
        if is_quantized(name, shape):
            stem = name[: -len(".weight")]
            groups = (*shape[:-1], shape[-1] // 64)
            out[name] = (shape, True)
            out[stem + ".scales"] = (groups, False)
            out[stem + ".biases"] = (groups, False)
        else:
            out[name] = (shape, False)
    return out


def check_state(state: Any, layout: dict[str, tuple[tuple[int, ...], bool]],
                 dtypes: dict[str, np.dtype] | None) -> None:
    """:class:`EngineError` unless ``state`` has the layout's names and shapes, uint8 codes, float
    tensors elsewhere (and, given ``dtypes``, exactly those dtypes)."""
    if not isinstance(state, dict):
        raise EngineError(f"a weight state is a dict of numpy arrays, got {type(state).__name__}")
    missing, extra = sorted(set(layout) - set(state)), sorted(set(state) - set(layout))
    if missing or extra:
        raise EngineError(f"weight state does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (shape, codes) in layout.items():
        a = state[name]
        if not isinstance(a, np.ndarray):
            raise EngineError(f"{name}: expected a numpy array, got {type(a).__name__}")
        if tuple(a.shape) != shape:
            raise EngineError(f"{name}: shape {tuple(a.shape)}, the model needs {shape}")
        ok = a.dtype == np.uint8 if codes else a.dtype.kind == "f" or a.dtype.name == "bfloat16"
        if not ok or (dtypes is not None and a.dtype != dtypes[name]):
            raise EngineError(f"{name}: dtype {a.dtype}, the model needs "
                              f"{'uint8' if codes else dtypes[name] if dtypes else 'a float dtype'}")


@torch.no_grad()
def rebuild(decoder: D.Decoder, layout: dict[str, tuple[tuple[int, ...], bool]], state: dict[str, np.ndarray],
            names: Sequence[str]) -> None:
    """Recompute ``decoder``'s tensors that depend on state entries ``names`` (or parameter names):
    the weights of record, ``code * scale + bias`` in float32, cast to the decoder's dtype. A
    quantized decoder computes on the state's codes themselves: its int8 matrices are re-bound."""
    if decoder.quantized:
        decoder.bind(state, None if len(names) >= len(layout) else set(names))
    targets = set()
    for n in names:
        stem, _, leaf = n.rpartition(".")
        targets.add(stem + ".weight" if leaf in ("scales", "biases") and stem + ".weight" in layout else n)
    dev = decoder.device
    for t in sorted(targets):
        if decoder.views[t].is_meta:  # an int8 matrix of a quantized decoder (bound above)
            continue
        a = state[t]
        if layout[t][1]:
            stem = t[: -len(".weight")]
            w = dequantize_torch(to_torch(a, dev), to_torch(state[stem + ".scales"], dev),
                                 to_torch(state[stem + ".biases"], dev))
        else:
            w = to_torch(a, dev)
        decoder.write(t, w)


def draw(logits: torch.Tensor, seeds: np.ndarray, s: SamplingConfig, where: str,
         host: HostSampler) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and behaviour log-probs of ``logits [B, V]`` by the sampling rule, on the host
    (``where`` ``host``, or ``auto`` on a CPU) or on the logits' device. On the host, float32 CPU
    logits without top-k / top-p go to the C sampler (:mod:`stoa.backends.torch.csample`, on torch's
    thread count) where the kernel library is built; the rest, and a batch it declines (a row with a
    NaN or no finite logit), to ``host``, the numpy :class:`HostSampler`. Both draw the same tokens (barring two noised
    scores within float32 rounding of each other)."""
    if where == "host" or (where == "auto" and logits.device.type == "cpu"):
        threads = torch.get_num_threads()
        if (C.supports(s.top_k, s.top_p) and logits.device.type == "cpu" and logits.dtype == torch.float32
                and C.built()):
            got = C.sample(logits, seeds, s.temperature, threads=threads)
            if got is not None:
                return got
        host.threads = threads  # rows drawn in as many blocks as torch has threads
        return host(logits.float().cpu().numpy(), seeds, s.temperature, s.top_k, s.top_p)
    return S.sample(logits, seeds, s.temperature, s.top_k, s.top_p)


def built_fields(spec: ModelSpec, cfg: Any) -> dict[str, Any]:
    """What the decoder of ``spec`` builds (``built_config``), in :class:`ModelSpec`'s terms; the
    RoPE base is the full-attention layers' of the transformers config ``cfg``."""
    rope = cfg.rope_parameters or {}
    return {**{k: v for k, v in spec.to_dict().items() if k not in ("rope_theta", "max_position_embeddings",
                                                                   "hidden_act")},
            "rope_theta": float(rope.get("full_attention", rope).get("rope_theta", spec.rope_theta))}


class TorchEngine(SingleEngineBase):
    """A :class:`stoa.backends.engine.RolloutEngine` on torch. Build with :func:`make`;
    attributes and methods are documented on the protocol, and those of every engine on
    :class:`~stoa.backends.engine_base.EngineBase`. Also: ``device``, ``decoder`` (the model),
    ``state_layout``."""

    def __init__(self, hf_dir: Path, state: dict[str, np.ndarray], version: int, mode: str = "auto",
                 config: EngineConfig = EngineConfig(), worker_id: str = "", device: str = "auto") -> None:
        from transformers import AutoConfig, AutoTokenizer

        from stoa.backends.torch import families

        path = Path(hf_dir)
        self.device = resolve_device(device)
        mode = resolve_mode(mode, self.device)
        spec = families.read_spec(path, "torch", EngineError)
        cfg = AutoConfig.from_pretrained(path)
        self.decoder = D.Decoder(spec, cfg, self.device, ENGINE_DTYPES[mode],
                                 attention_bias=bool(getattr(cfg, "attention_bias", False)),
                                 mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
                                 quantized=mode in KERNEL_MODES, digits=DIGITS.get(mode, 0))
        self.state_layout = state_layout(self.decoder)
        check_state(state, self.state_layout, None)
        self._state = {k: np.array(v, copy=True, order="C") for k, v in state.items()}
        self._rebuild(list(self.decoder.views))
        tok = AutoTokenizer.from_pretrained(path)
        text = TokenizerText(tok, config_eos_ids(path), spec.vocab_size, str(path), config.prompt_format)
        super().__init__(path, config, version, worker_id, mode=mode, vocab_size=spec.vocab_size, tokenizer=tok,
                         codec=text.codec, built=built_fields(spec, cfg))
        self._cache: D.KVCache | None = None
        self._host_sampler = HostSampler()

    def kv_cache(self, slots: int) -> D.KVCache:
        """The engine's KV cache with ``slots`` rows (kept across cohorts while the batch size holds)."""
        c = self._cache
        if c is None or c.shape[0] != slots:
            s = self.decoder.spec
            c = self._cache = D.KVCache(s.num_hidden_layers, slots, s.num_key_value_heads, s.head_dim,
                                        self.decoder.dtype, self.device)
        return c

    # -- weights --------------------------------------------------------------------------------
    def _check_state(self, state: dict[str, np.ndarray]) -> None:
        check_state(state, self.state_layout, {k: v.dtype for k, v in self._state.items()})

    def _rebuild(self, names: Sequence[str]) -> None:
        rebuild(self.decoder, self.state_layout, self._state, names)

    @contextlib.contextmanager
    def _computing(self) -> Iterator[None]:
        with exact_matmuls(self.device), torch.no_grad():
            yield

    # -- generation -----------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, seeds: np.ndarray, s: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and behaviour log-probs for logits ``[B, V]`` and uint64 row seeds ``[B]``: on the
        host (``config.sampler`` ``host``, or ``auto`` on a CPU: the C sampler of
        :mod:`stoa.backends.torch.csample` without top-k / top-p, numpy's :class:`HostSampler`
        otherwise or without the kernel library; both far faster there than torch's int64 hash) or on
        the engine's device (``device``, ``auto`` on a GPU). See :func:`draw`."""
        return draw(logits, seeds, s, self.config.sampler, self._host_sampler)

    def feed(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: D.KVCache, rows: torch.Tensor) -> None:
        """:class:`stoa.backends.torch.rollout.CohortHost`'s prefill step."""
        self.decoder.forward(ids, start, longest, cache, rows)

    def next_tokens(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: D.KVCache, seeds: np.ndarray,
                    s: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
        """:class:`stoa.backends.torch.rollout.CohortHost`'s decode step."""
        hidden = self.decoder.forward(ids, start, longest, cache)
        return self.sample(self.decoder.logits(hidden[:, 0]), seeds, s)

    def _cohort(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest], sampling: SamplingConfig,
                envs: list[Any]) -> Cohort:
        return Cohort(self, make_env, requests, sampling, envs)

    # -- scoring --------------------------------------------------------------------------------
    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states of right-padded rows ``x [n, W]`` (a scratch cache, chunked prefill)."""
        n, width = x.shape
        s = self.decoder.spec
        cache = D.KVCache(s.num_hidden_layers, n, s.num_key_value_heads, s.head_dim, self.decoder.dtype, self.device,
                          capacity=width)
        step = self.config.prefill_chunk
        out = []
        for a in range(0, width, step):
            b = min(width, a + step)
            out.append(self.decoder.forward(x[:, a:b], torch.full((n,), a, device=self.device), b, cache))
        return torch.cat(out, dim=1) if len(out) > 1 else out[0]

    def _score_batch(self, eps: Sequence[Episode], temperature: float | None) -> list[np.ndarray]:
        return scoring.score_batch(eps, temperature, self._vocab, self.device, self._hidden, self.decoder.logits,
                                   EngineError)

    def _draws_batch(self, eps: Sequence[Episode], seeds: Sequence[int], top_k: int, drift: float) -> list[Draws]:
        return scoring.draws_batch(eps, seeds, top_k, drift, self._vocab, self.device, self._hidden,
                                   self.decoder.logits, EngineError)


def pretrained_state(hf_dir: Path) -> dict[str, np.ndarray]:
    """The int8 state of a folder's float weights (``quantize_state``: what ``mlx_lm`` would hold),
    read tensor by tensor from the memory-mapped files."""
    import mmap

    from stoa.transport import tensorfile
    from stoa.transport.quant import quantize_state

    files = sorted(hf_dir.glob("model*.safetensors"))
    if not files:
        raise EngineError(f"{hf_dir} holds no model*.safetensors weights")

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for f in files:
            with open(f, "rb") as fh:
                buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                yield from tensorfile.read(buf).tensors.items()
            except tensorfile.TensorFileError as e:
                raise EngineError(f"{f}: {e}") from None

    return quantize_state(tensors())


def mode(mode: str = "auto", device: str = "auto") -> str:
    """The backend entry of :func:`stoa.backends.engine.engine_mode`: what ``mode`` resolves to on ``device``."""
    return resolve_mode(mode, resolve_device(device))


def make(hf_dir: str | Path, *, state: dict[str, np.ndarray] | None = None, version: int = 0, mode: str = "auto",
         config: EngineConfig = EngineConfig(), worker_id: str = "", device: str = "auto") -> TorchEngine:
    """The backend entry of :func:`stoa.backends.engine.make_engine`: from ``state`` when given,
    else from the folder's float weights quantized to int8. ``device``: ``auto`` (CUDA if torch
    sees one), ``cpu``, ``cuda``, ``cuda:N``."""
    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise EngineError(f"{path} is not a Hugging Face model folder (no config.json)")
    if state is None:
        state = pretrained_state(path)
    return TorchEngine(path, state, version, mode=mode, config=config, worker_id=worker_id, device=device)
