"""The outer loop's config section: ``[outer]``, several trainers of one run (``docs/outer.md``).

A leaf: a frozen dataclass that checks its own bounds and imports nothing that runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from stoa.fleet.sections import check

__all__ = ["OuterConfig"]


@dataclass(frozen=True)
class OuterConfig:
    """Several trainers, one run: H inner steps each, then one merged outer step (``[outer]``).

    With the defaults (one trainer, one inner step) the trainer runs as it always has: one
    optimizer step, one published version. Otherwise each published version is one *outer step*:
    every trainer of the round takes ``inner_steps`` optimizer steps from the last merged weights
    with its own optimizer, sends the difference, and the coordinator (rank 0, the run's key)
    merges them with a Nesterov outer optimizer (DiLoCo, arXiv 2311.08105) and publishes.
    ``trainer.steps`` counts published versions (outer steps); ``trainer.groups_per_step`` is
    the groups of one inner step of one trainer.
    """

    trainers: int = 1
    """Trainer processes of the run: rank 0 (``stoa trainer --key``) coordinates, ranks
    1..trainers-1 are ``stoa trainer --outer-rank i`` (``stoa train`` starts them all)."""
    inner_steps: int = 1
    """H: optimizer steps each trainer takes between two merges (one published version)."""
    lr: float = 0.7
    """Outer learning rate (DiLoCo's 0.7)."""
    momentum: float = 0.9
    """Outer momentum (DiLoCo's 0.9); 0 with ``lr = 1`` is plain averaging of the trainers' weights."""
    nesterov: bool = True
    """Nesterov momentum (DiLoCo) rather than heavy-ball."""
    compress: Literal["int8", "topk", "none"] = "int8"
    """How an outer update travels, always with an error-feedback residual kept by the sender:
    ``int8`` codes with one float32 scale per ``block`` values of a row (3.8x less than float32);
    ``topk``: only the ``topk`` largest values of each block, as positions and int8 codes with one
    scale (8 bytes per 64 values at the defaults, 32x less); ``none``: float32."""
    block: int = 64
    """Values of a row that share one scale, and among which ``topk`` keeps its largest (a row's
    length when it does not divide it)."""
    topk: int = 2
    """With ``compress = "topk"``: values kept of each block of ``block`` (density ``topk / block``)."""
    deadline_s: float = 60.0
    """Once the coordinator has dealt every share and trained its own, how long it waits for the
    other trainers' updates; a trainer later than this is dropped from the outer step."""
    silent_s: float = 20.0
    """A trainer whose heartbeat is older than this is dropped at once (not waited for)."""
    join_s: float = 180.0
    """The first outer step waits up to this long for every trainer to be ready."""
    base_every: int = 10
    """The coordinator writes the float weights every this many outer steps (what a trainer
    joins or rejoins from; the merged steps since are kept beside it)."""
    norm_ratio: float = 10.0
    """An update whose L2 norm exceeds this many times the coordinator's own (when that is not 0)
    is refused (0: no norm check)."""

    def __post_init__(self) -> None:
        check(self.trainers >= 1 and self.inner_steps >= 1, "outer.trainers >= 1 and outer.inner_steps >= 1")
        check(math.isfinite(self.lr) and self.lr > 0, "outer.lr must be > 0")
        check(0 <= self.momentum < 1, "outer.momentum must be in [0, 1)")
        check(self.compress in ("int8", "topk", "none"), "outer.compress must be 'int8', 'topk' or 'none'")
        check(self.block >= 1 and self.base_every >= 1, "outer.block >= 1 and outer.base_every >= 1")
        check(1 <= self.topk <= self.block, "outer.topk must be in [1, outer.block]")
        check(all(math.isfinite(x) and x > 0 for x in (self.deadline_s, self.silent_s, self.join_s)),
              "outer.deadline_s, silent_s and join_s must be > 0")
        check(math.isfinite(self.norm_ratio) and self.norm_ratio >= 0, "outer.norm_ratio must be >= 0")

    @property
    def active(self) -> bool:
        """Whether the run uses outer steps at all (else the trainer is today's, step for step)."""
        return self.trainers > 1 or self.inner_steps > 1
