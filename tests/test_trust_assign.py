"""Assigned work (stoa.fleet.trust.assign): public, deterministic, and a batch is its key's own."""

from __future__ import annotations

import copy

import numpy as np

from stoa.types import Episode, Segment


def test_a_batch_is_its_keys_assignment_and_nobody_elses():
    """Framing and copies: a victim's batch re-signed under another key is not that key's work,
    whatever its contents, so the copier is refused and the victim is never compared with it."""
    from stoa.fleet.trust.assign import assignment, assignment_problem

    a = assignment(7, "aaaa", 3, n_items=100, groups=2)
    assert a == assignment(7, "aaaa", 3, n_items=100, groups=2)  # public and deterministic
    assert a != assignment(7, "bbbb", 3, n_items=100, groups=2) and a != assignment(7, "aaaa", 4, 100, 2)
    eps = [Episode(np.arange(5), [Segment("model", np.arange(3), -np.ones(3))], 0.0, group_id=g, sample_index=s,
                   item_index=i) for g, i in zip(a.group_ids, a.items) for s in range(4)]
    assert assignment_problem(eps, a, 4) is None
    assert "not one this batch was assigned" in assignment_problem(eps, assignment(7, "bbbb", 3, 100, 2), 4)
    easy = copy.deepcopy(eps)
    easy[0].item_index = (easy[0].item_index + 1) % 100  # a prompt of its own choosing
    assert "assigned item" in assignment_problem(easy, a, 4)
    assert "of its 4 samples" in assignment_problem(eps[1:], a, 4)  # a group cut short
    twice = copy.deepcopy(eps)
    twice[1].sample_index = 0
    assert "appears twice" in assignment_problem(twice, a, 4)
