"""Synthetic int8 weight states, training steps and episodes for transport tests and benchmarks."""

from __future__ import annotations

import numpy as np

from stoa.transport.quant import quantize_state
from stoa.types import Episode, Segment

__all__ = ["perturb_codes", "synthetic_episodes", "synthetic_state"]


def synthetic_state(n_params: int, seed: int = 0, width: int = 256) -> dict[str, np.ndarray]:
    """An int8 state (the layout ``stoa.transport.pulse`` documents) of about ``n_params`` weights:
    ``width``-wide square matrices plus one norm vector, quantized from N(0, 0.02)."""
    rng = np.random.default_rng(seed)
    n = max(1, round(n_params / (width * width)))
    floats = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((width, width), dtype=np.float32) * 0.02
              for i in range(n)}
    floats["model.norm.weight"] = np.ones(width, np.float32)
    return quantize_state(floats)


def perturb_codes(state: dict[str, np.ndarray], rate: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A new state in which ``rate`` of the int8 codes moved by +-1 (scales and biases kept): the
    shape of one optimizer step after re-quantization with the keep policy."""
    out = {}
    for name, a in state.items():
        if a.dtype == np.uint8 and name.endswith(".weight"):
            b = a.copy().reshape(-1)
            idx = rng.choice(b.size, max(1, int(b.size * rate)), replace=False)
            step = np.where(b[idx] == 255, -1, np.where(b[idx] == 0, 1, rng.choice([-1, 1], idx.size)))
            b[idx] = (b[idx].astype(np.int16) + step).astype(np.uint8)
            out[name] = b.reshape(a.shape)
        else:
            out[name] = a
    return out


def synthetic_episodes(n: int, tokens: int, vocab: int, seed: int = 0, group: int = 8, policy_version: int = 0,
                       worker_id: str = "") -> list[Episode]:
    """``n`` single-turn episodes of ``tokens`` model tokens each (with behaviour log-probs), in
    groups of ``group``: what one rollout batch of that size weighs on the wire."""
    rng = np.random.default_rng(seed)
    return [Episode(rng.integers(0, vocab, 32),
                    [Segment("model", rng.integers(0, vocab, tokens), -rng.uniform(0.01, 5, tokens).astype(np.float32))],
                    reward=float(rng.random()), group_id=f"g{seed}-{i // group}", sample_index=i % group,
                    policy_version=policy_version, worker_id=worker_id)
            for i in range(n)]
