"""Where the gap between the behaviour policy and the trainer's policy comes from.

A worker samples from ``mu``: the int8 policy at version ``v - lag``. The trainer's objective
compares against ``pi``: the float policy at version ``v``. Scoring the same tokens with the int8
policy at the trainer's version ``v`` (``q``, prefill only) splits the gap in two:

* **staleness**: ``mu`` vs ``q``, same precision (int8), older version;
* **int8**: ``q`` vs ``pi``, same version, int8 vs float weights.

All three are measured on the sampled model tokens (which are draws from ``mu``). With
``r = p / mu`` on those tokens, ``E[r - 1 - log r]`` is the k3 estimate of ``KL(mu || p)``; the int8
part's ``k3(pi / q)`` is the same estimator weighted by ``mu``'s samples rather than ``q``'s (the
two policies differ by ~1e-2 nats per token, so the weighting changes it little).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stoa.types import Episode

__all__ = ["decompose"]

_CLAMP = 20.0


def _k3(log_ratio: np.ndarray) -> float:
    lr = np.clip(log_ratio, -_CLAMP, _CLAMP)
    return float(np.mean(np.exp(lr) - 1.0 - lr)) if len(lr) else 0.0


def decompose(episodes: Sequence[Episode], logp_pi: Sequence[np.ndarray], logp_q: Sequence[np.ndarray]) -> dict[str, float]:
    """Mismatch metrics over the model tokens of ``episodes``.

    Args:
        episodes: the step's episodes (their model segments carry ``log mu``).
        logp_pi: the trainer's float log-probs, aligned with ``episode.tokens()`` (entry 0 unused).
        logp_q: the int8 policy at the trainer's version, same alignment.

    Returns:
        ``mismatch/kl_total`` (KL(mu||pi)), ``mismatch/kl_stale`` (KL(mu||q)), ``mismatch/kl_int8``
        (q vs pi), ``mismatch/abs_total``, ``abs_stale``, ``abs_int8`` (mean absolute log-prob
        differences) and ``mismatch/tokens``; ``{}`` when there is no model token.
    """
    mu, pi, q = [], [], []
    for ep, lp, lq in zip(episodes, logp_pi, logp_q):
        pos = len(ep.prompt_tokens)
        for seg in ep.segments:
            n = len(seg.tokens)
            if seg.kind == "model":
                mu.append(np.asarray(seg.logprobs, np.float64))
                pi.append(np.asarray(lp[pos:pos + n], np.float64))
                q.append(np.asarray(lq[pos:pos + n], np.float64))
            pos += n
    if not mu:
        return {}
    mu_, pi_, q_ = np.concatenate(mu), np.concatenate(pi), np.concatenate(q)
    return {
        "mismatch/kl_total": _k3(pi_ - mu_),
        "mismatch/kl_stale": _k3(q_ - mu_),
        "mismatch/kl_int8": _k3(pi_ - q_),
        "mismatch/abs_total": float(np.mean(np.abs(pi_ - mu_))),
        "mismatch/abs_stale": float(np.mean(np.abs(q_ - mu_))),
        "mismatch/abs_int8": float(np.mean(np.abs(pi_ - q_))),
        "mismatch/tokens": float(len(mu_)),
    }
