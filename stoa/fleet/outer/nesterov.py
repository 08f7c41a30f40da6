"""DiLoCo's outer optimizer: SGD with Nesterov momentum on the mean outer gradient. Pure numpy.

DiLoCo (Douillard et al., arXiv 2311.08105), Algorithm 1: each of k replicas starts from the
shared weights ``theta``, takes H inner AdamW steps to ``theta_i``; the outer gradient is
``g = mean_i (theta - theta_i)`` and the outer optimizer (Nesterov, lr 0.7, momentum 0.9) moves
``theta``. In PyTorch's form of Nesterov SGD (DiLoCo's implementation)::

    m     <- mu * m + g
    step  <- g + mu * m          (heavy-ball: step <- m)
    theta <- theta - lr * step

Deviation: the step is returned, not applied; the coordinator ships it compressed
(:mod:`stoa.fleet.outer.codec`) and every trainer, the coordinator included, applies the same
decoded step, so all hold the same weights bit for bit. With ``lr = 1, mu = 0`` the step is the
plain mean of the replicas' moves (model averaging).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["OuterOptimizer"]


class OuterOptimizer:
    """The outer momentum and its update rule; :meth:`state` / :meth:`restore` for checkpoints."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), bool(nesterov)
        self.m: dict[str, np.ndarray] = {}

    def step(self, updates: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The additive change to the weights, ``-lr * step``, from the replicas' outer gradients
        ``updates`` (each ``theta - theta_i``, float32, the same names). Updates the momentum."""
        if not updates:
            raise ValueError("an outer step needs at least one update")
        out = {}
        mu = np.float32(self.momentum)
        for name in updates[0]:
            g = np.mean(np.stack([np.asarray(u[name], np.float32) for u in updates]), axis=0, dtype=np.float32)
            m = self.m.get(name)
            m = g.copy() if m is None else mu * m + g
            self.m[name] = m.astype(np.float32)
            step = g + mu * m if self.nesterov else m
            out[name] = (-np.float32(self.lr) * step).astype(np.float32)
        return out

    def state(self) -> dict[str, np.ndarray]:
        return dict(self.m)

    def restore(self, m: Mapping[str, np.ndarray]) -> None:
        self.m = {k: np.array(v, np.float32) for k, v in m.items()}
