"""Score episodes under an int8 weight state with torch, on the trainer's own device.

The trainer re-scores sampled episodes under the exact weights that produced them (spot-checks,
audits) and evaluates the int8 policy. The MLX engine does that on Apple silicon; on a Linux
trainer it would run MLX's CPU build with float32 weights (an 8B model: 32 GB of host RAM and
minutes per check). :class:`TorchInt8Scorer` instead dequantizes the state into a transformers
model on the learner's device and scores with the MLX engine's alignment:

    scores[i][0] = 0,   scores[i][t] = log softmax(logits[t-1] / T)[tokens[t]]

Dequantization is the weights of record bit for bit (``stoa.transport.quant.dequantize``:
``code * scale + bias`` in float32), as in the MLX engine's both modes; what remains is the two
frameworks' float arithmetic, measured in docs/scale.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from stoa.backends.packing import by_length
from stoa.backends.sampling import Draws
from stoa.backends.torch import families, scoring
from stoa.types import Episode

__all__ = ["Int8ScorerError", "TorchInt8Scorer", "make_scorer", "resolve_device"]

GROUP_SIZE = 64
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Int8ScorerError(ValueError):
    """The state does not fit the model, or an episode cannot be scored."""


def to_torch(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A device tensor of ``a`` (bfloat16 through its bits; read-only/mapped input is fine)."""
    a = np.ascontiguousarray(a)
    bf16 = a.dtype.name == "bfloat16"
    if bf16:
        a = a.view(np.int16)
    with warnings.catch_warnings():  # a read-only (memory-mapped) array is only read here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    t = t.to(device)
    return t.view(torch.bfloat16) if bf16 else t


def dequantize_torch(codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                     group_size: int = GROUP_SIZE) -> torch.Tensor:
    """``codes * scales + biases`` per group in float32 (float32 result), bit for bit the weights
    of record (``stoa.transport.quant.dequantize``)."""
    w = codes.reshape(-1, group_size).to(torch.float32)
    w.mul_(scales.reshape(-1, 1).to(torch.float32))
    w.add_(biases.reshape(-1, 1).to(torch.float32))
    return w.reshape(codes.shape)


def resolve_device(setting: str, error: type[Exception] = Int8ScorerError) -> str:
    """The device a learner's ``device`` setting names (``"auto"``: ``"cuda"`` if torch sees a
    CUDA device, else ``"cpu"``); the torch learner resolves its own setting here too. Raises
    ``error`` for a CUDA device torch cannot see."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise error(f"device={setting!r} but torch sees no CUDA device")
    return setting


def make_scorer(hf_dir: str | Path, device: str = "auto", dtype: str = "float32") -> TorchInt8Scorer:
    """A :class:`TorchInt8Scorer` on the device a learner's ``device`` setting names."""
    return TorchInt8Scorer(hf_dir, resolve_device(device), dtype)


class TorchInt8Scorer:
    """Teacher-forced log-probs of episodes under an int8 weight state, on ``device``.

    ``hf_dir``: the run's Hugging Face folder (config; its weights are replaced by every
    :meth:`load_state`). ``dtype``: compute dtype of the dequantized model (float32 reproduces the
    MLX CPU engine; bfloat16 halves GPU memory at some agreement cost). ``version`` is the
    version of the last state loaded (-1 before any).
    """

    def __init__(self, hf_dir: str | Path, device: str = "cpu", dtype: str = "float32") -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if dtype not in _DTYPES:
            raise Int8ScorerError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.hf_dir, self.device, self.dtype = Path(hf_dir), torch.device(device), _DTYPES[dtype]
        spec = families.read_spec(self.hf_dir, "torch", Int8ScorerError)
        attn = families.attn_implementation(spec, packed=False)
        cfg = AutoConfig.from_pretrained(self.hf_dir)
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            if any(self.hf_dir.glob("model*.safetensors")):
                model = AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=self.dtype, attn_implementation=attn)
            else:
                model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype, attn_implementation=attn)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        self.model = model.to(self.device).eval()
        self.model.config.use_cache = False
        wrong = families.prepare(self.model, spec)
        if wrong:
            raise Int8ScorerError(f"{self.hf_dir}: transformers built the model differently from its config "
                                  f"({'; '.join(wrong)})")
        self._body, self._head = self.model.get_decoder(), families.head(self.model, spec)
        self._params = dict(self.model.named_parameters(remove_duplicate=True))
        self.vocab_size = int(cfg.vocab_size)
        self.version = -1

    @torch.no_grad()
    def load_state(self, version: int, state: Mapping[str, np.ndarray]) -> None:
        """Dequantize ``state`` (``stoa.transport.quant.quantize_state`` layout) into the model,
        one tensor at a time (peak extra memory: one float tensor). Names must match the model's
        parameters exactly (a tied head has none of its own)."""
        names: dict[str, str] = {}
        for k in state:
            stem, _, leaf = k.rpartition(".")
            if leaf in ("scales", "biases"):
                if f"{stem}.weight" not in state:
                    raise Int8ScorerError(f"{k} has no {stem}.weight codes")
                continue
            names[k] = stem
        missing, extra = sorted(set(self._params) - set(names)), sorted(set(names) - set(self._params))
        if missing or extra:
            raise Int8ScorerError(f"state does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, stem in names.items():
            p, a = self._params[name], np.asarray(state[name])
            if tuple(a.shape) != tuple(p.shape):
                raise Int8ScorerError(f"{name}: shape {tuple(a.shape)}, the model needs {tuple(p.shape)}")
            if a.dtype == np.uint8:
                s, b = state.get(stem + ".scales"), state.get(stem + ".biases")
                if s is None or b is None:
                    raise Int8ScorerError(f"{name}: uint8 codes without {stem}.scales/.biases")
                w = dequantize_torch(to_torch(a, self.device), to_torch(np.asarray(s), self.device),
                                     to_torch(np.asarray(b), self.device))
            else:
                w = to_torch(a, self.device)
            p.copy_(w)
            del w
        self.version = int(version)

    @torch.no_grad()
    def score(self, episodes: Sequence[Episode], temperature: float | None = None,
              max_tokens: int = 8192) -> list[np.ndarray]:
        """One float32 array ``[len(episode)]`` per episode, aligned with ``Episode.tokens()``
        exactly as the MLX engine's ``score`` (entry 0 is 0.0; ``temperature`` None: each
        episode's own). ``max_tokens`` bounds the tokens of one batched forward pass."""
        if temperature is not None and not temperature > 0:
            raise Int8ScorerError(f"temperature={temperature} must be > 0")
        if self.version < 0:
            raise Int8ScorerError("no state loaded: call load_state first")
        return by_length([len(e) for e in episodes], max_tokens,
                         lambda b: self._score_batch([episodes[i] for i in b], temperature))

    def sampling_margins(self, episodes: Sequence[Episode], seeds: Sequence[int], top_k: int = 0,
                         drift: float = 0.0, max_tokens: int = 8192) -> list[np.ndarray]:
        """One float64 array per episode, one entry per sampled token, exactly as the MLX engine's
        ``sampling_margins`` (``RolloutEngine.sampling_margins``): by how much, in raw logits, the
        token beats every other under the sampling rule's re-derived noise; positive: drawn."""
        return [d.margins for d in self.check_draws(episodes, seeds, top_k, drift, max_tokens)]

    @torch.no_grad()
    def check_draws(self, episodes: Sequence[Episode], seeds: Sequence[int], top_k: int = 0,
                    drift: float = 0.0, max_tokens: int = 8192) -> list[Draws]:
        """``RolloutEngine.check_draws``: each episode's margins and re-scored log-probs from one
        forward pass."""
        if len(seeds) != len(episodes):
            raise Int8ScorerError("one seed per episode")
        if self.version < 0:
            raise Int8ScorerError("no state loaded: call load_state first")
        return by_length([len(e) for e in episodes], max_tokens, lambda b: self._draws_batch(
            [episodes[i] for i in b], [int(seeds[i]) for i in b], top_k, drift))

    def _draws_batch(self, eps: Sequence[Episode], seeds: Sequence[int], top_k: int, drift: float) -> list[Draws]:
        return scoring.draws_batch(eps, seeds, top_k, drift, self.vocab_size, self.device, self._hidden, self._head,
                                   Int8ScorerError)

    def _score_batch(self, eps: Sequence[Episode], temperature: float | None) -> list[np.ndarray]:
        return scoring.score_batch(eps, temperature, self.vocab_size, self.device, self._hidden, self._head,
                                   Int8ScorerError)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self._body(input_ids=x).last_hidden_state
