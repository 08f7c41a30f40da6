"""Helpers shared by the trust tests (test_identity, test_trust_*): small sealed and unsealed
batches, a list ledger, forged log-probs and stand-in scorers."""

from __future__ import annotations

import copy

import numpy as np

from stoa.transport.exchange import Batch
from stoa.transport.identity import open_sealed, public_hex, seal_batch
from stoa.transport.signing import key_id
from stoa.types import Episode, Segment


RUN = "runs/t"


def episodes(worker: str, version: int = 0, group: str = "g", n: int = 2, seed: int = 0) -> list[Episode]:
    rng = np.random.default_rng(seed)
    return [Episode(rng.integers(0, 50, 5), [Segment("model", rng.integers(0, 50, 4), -rng.random(4))],
                    reward=float(i), policy_version=version, worker_id=worker, group_id=group, sample_index=i)
            for i in range(n)]


def seal_of(key, worker: str):
    return open_sealed(seal_batch(b"x", run=RUN, worker_id=worker, seq=0, version=0, private_key=key))[0]


def sealed_batch(key, worker: str, eps: list[Episode], seq: int = 0) -> Batch:
    pub = public_hex(key.public_key())
    return Batch(f"{RUN}/rollouts/{worker}/s{seq:012d}-v000000000000.episodes", worker, 0, eps, seq,
                 key_id(key.public_key()), "", pub)


def batch_of(kid: str, worker: str, eps: list[Episode], seq: int = 0) -> Batch:
    return Batch(f"{RUN}/rollouts/{worker}/s{seq:012d}-v000000000000.episodes", worker, 0, eps, seq, kid)


class ListLedger:
    def __init__(self, entries: list[dict]):
        self.entries = entries

    def write(self, **entry):
        self.entries.append(entry)


def forge_logprobs(eps: list[Episode], how: str) -> list[Episode]:
    out = copy.deepcopy(eps)
    rng = np.random.default_rng(0)
    for e in out:
        for s in e.segments:
            if s.kind == "model":
                s.logprobs = np.zeros_like(s.logprobs) if how == "zero" else rng.permutation(s.logprobs)
    return out


class Echo:
    """A float policy that agrees with every claim (so only the spot-check decides)."""

    def logprobs(self, eps, temperature=1.0, model_only=False):
        out = []
        for e in eps:
            lp = np.zeros(len(e.tokens()), np.float32)
            lp[e.loss_mask()] = e.behavior_logprobs()[e.loss_mask()]
            out.append(lp)
        return out


class AtVersion:
    """The int8 policy of one version (what these episodes claim)."""

    def __init__(self, engine, version=0):
        self.engine, self.version = engine, version

    def score(self, version, eps):
        return self.engine.score(eps) if version == self.version else None

    def sampling_margins(self, version, eps, seeds, drift=0.0):
        return self.engine.sampling_margins(eps, seeds, drift=drift) if version == self.version else None

    def check_draws(self, version, eps, seeds, drift=0.0):
        return self.engine.check_draws(eps, seeds, drift=drift) if version == self.version else None


def assigned(seed):
    """The work a batch of these tests owes (handed to ``TrustGate.review``): no items, sampling seed ``seed``."""
    from stoa.fleet.trust.assign import Assignment

    return Assignment((), (), seed)
