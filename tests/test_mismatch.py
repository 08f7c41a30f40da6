"""The int8 / staleness split of the behaviour-trainer mismatch, on hand-made log-probs."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.fleet.trainer.mismatch import decompose
from stoa.types import Episode, Segment


def _episode(mu: list[float]) -> Episode:
    return Episode(np.array([1, 2]), [Segment("model", np.array([3, 4]), np.array(mu[:2])), Segment("env", np.array([5])),
                                      Segment("model", np.array([6]), np.array(mu[2:]))], 0.0)


def test_the_split_uses_only_model_tokens_and_matches_hand_numbers():
    ep = _episode([-1.0, -2.0, -0.5])
    # tokens: [1, 2 | 3, 4 | 5 | 6]: model positions 2, 3 and 5; the prompt and env slots must be ignored
    pi = np.array([0.0, 9.0, -1.5, -2.0, 9.0, -0.5])
    q = np.array([0.0, 9.0, -1.0, -2.5, 9.0, -0.5])
    m = decompose([ep], [pi], [q])
    k3 = lambda lr: float(np.mean(np.exp(lr) - 1 - lr))
    mu_, pi_, q_ = np.array([-1.0, -2.0, -0.5]), np.array([-1.5, -2.0, -0.5]), np.array([-1.0, -2.5, -0.5])
    assert m["mismatch/kl_total"] == pytest.approx(k3(pi_ - mu_))
    assert m["mismatch/kl_stale"] == pytest.approx(k3(q_ - mu_))
    assert m["mismatch/kl_int8"] == pytest.approx(k3(pi_ - q_))
    assert m["mismatch/abs_total"] == pytest.approx(0.5 / 3)
    assert m["mismatch/abs_stale"] == pytest.approx(0.5 / 3)
    assert m["mismatch/abs_int8"] == pytest.approx(1.0 / 3)
    assert m["mismatch/tokens"] == 3


def test_no_gap_reads_zero_and_no_model_token_reads_nothing():
    ep = _episode([-1.0, -2.0, -0.5])
    same = np.array([0.0, 0.0, -1.0, -2.0, 0.0, -0.5])
    m = decompose([ep], [same], [same])
    assert all(v == 0.0 for k, v in m.items() if k != "mismatch/tokens")
    assert decompose([Episode(np.array([1]), [Segment("env", np.array([2]))], 0.0)], [np.zeros(2)], [np.zeros(2)]) == {}
