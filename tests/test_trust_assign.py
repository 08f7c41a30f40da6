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


def test_salted_work_is_not_the_probation_work_and_needs_the_runs_key():
    """A key's real work depends on its salt (a keyed hash under the run's private key); without
    it a worker can compute only its probation work, whose group ids say so."""
    from stoa.fleet.trust.assign import assignment, is_probation
    from stoa.transport.identity import assignment_salt
    from stoa.transport.signing import generate_private_key

    run_key, other = generate_private_key(), generate_private_key()
    kid = "0123456789abcdef"
    salt = assignment_salt(run_key, "runs/t", kid)
    assert salt == assignment_salt(run_key, "runs/t", kid) != assignment_salt(other, "runs/t", kid)
    assert salt != assignment_salt(run_key, "runs/other", kid)
    real, probation = assignment(7, kid, 3, 100, 2, salt), assignment(7, kid, 3, 100, 2)
    assert real.group_ids == (f"{kid}-s3-g0", f"{kid}-s3-g1") and not real.probation
    assert probation.group_ids == (f"{kid}-p3-g0", f"{kid}-p3-g1") and probation.probation
    assert real.seed != probation.seed and real != assignment(7, kid, 3, 100, 2, assignment_salt(other, "runs/t", kid))
    eps = [Episode(np.arange(5), [Segment("model", np.arange(3), -np.ones(3))], 0.0, group_id=g, sample_index=0)
           for g in probation.group_ids]
    assert is_probation(eps, kid, 3) and not is_probation(eps, kid, 4) and not is_probation([], kid, 3)
