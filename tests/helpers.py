"""Helpers shared by test modules (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import numpy as np

from stoa.types import Episode, Segment


def random_episodes(n: int, vocab: int, seed: int = 0, temperature: float | None = None) -> list[Episode]:
    """Multi-turn episodes: prompt, then model turns with env (tool) output between them.

    Groups of 4 share a group id; each episode's temperature is drawn from {0.7, 1.0, 1.3}
    unless ``temperature`` is given.
    """
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        segs = []
        for turn in range(int(rng.integers(1, 4))):
            k = int(rng.integers(1, 12))
            segs.append(Segment("model", rng.integers(0, vocab, k), -rng.uniform(0.1, 6, k).astype(np.float32)))
            if turn < 2 and rng.random() < 0.7:
                segs.append(Segment("env", rng.integers(0, vocab, int(rng.integers(1, 20)))))
        t = float(rng.choice([0.7, 1.0, 1.3])) if temperature is None else temperature
        out.append(Episode(rng.integers(0, vocab, int(rng.integers(2, 16))), segs, reward=float(rng.random()),
                           group_id=str(i // 4), sample_index=i % 4, temperature=t))
    return out
