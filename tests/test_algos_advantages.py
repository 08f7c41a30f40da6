"""Group-relative advantages (numpy in, numpy out): golden numbers, zero-variance groups, and
brute-force properties."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoa.algos.advantages import group_advantages

# Group "a": rewards 1, 0, 1, 1 (interleaved with the others); "b": 2, 2; "c": 5 alone.
REWARDS = [1.0, 2.0, 0.0, 5.0, 1.0, 2.0, 1.0]
IDS = ["a", "b", "a", "c", "a", "b", "a"]
# a: mean .75, deviations +.25 -.75 +.25 +.25, sample var (3 * .0625 + .5625) / 3 = .25, std .5
GOLDEN = {
    "grpo": [0.5, 0.0, -1.5, 0.0, 0.5, 0.0, 0.5],  # deviation / .5
    "drgrpo": [0.25, 0.0, -0.75, 0.0, 0.25, 0.0, 0.25],  # deviation
    # leave-one-out: 1 - mean(0, 1, 1) = 1/3; 0 - mean(1, 1, 1) = -1 (= 4/3 * deviation)
    "rloo": [1 / 3, 0.0, -1.0, 0.0, 1 / 3, 0.0, 1 / 3],
}


@pytest.mark.parametrize("kind", list(GOLDEN))
def test_golden(kind):
    adv, stats = group_advantages(REWARDS, IDS, kind=kind, eps=0.0)
    assert isinstance(adv, np.ndarray) and adv.dtype == np.float32 and adv.shape == (7,)
    np.testing.assert_allclose(adv, np.array(GOLDEN[kind], np.float32), rtol=1e-6)
    assert stats["num_groups"] == 3
    assert stats["num_zero_variance_groups"] == 2  # "b" (all equal) and "c" (alone)
    assert stats["frac_zero_variance_groups"] == pytest.approx(2 / 3)
    mask = stats["zero_variance_mask"]
    assert isinstance(mask, np.ndarray) and mask.tolist() == [False, True, False, True, False, True, False]
    assert stats["reward_mean"] == pytest.approx(12 / 7)
    assert stats["reward_std"] == pytest.approx(float(np.std(REWARDS)))
    assert (stats["group_size_min"], stats["group_size_max"]) == (1, 4)


def test_grpo_eps_and_exact_zero_for_equal_rewards():
    adv, _ = group_advantages(REWARDS, IDS)  # eps 1e-6: .25 / (.5 + 1e-6)
    assert adv[0].item() == pytest.approx(0.25 / 0.500001, rel=1e-6)
    # 0.1 * 3 / 3 != 0.1 in floating point; equal rewards must still give exactly 0.
    adv, stats = group_advantages([0.1, 0.1, 0.1], ["q"] * 3, kind="grpo", eps=0.0)
    assert np.all(adv == 0) and stats["num_zero_variance_groups"] == 1


def test_input_forms():
    expected, _ = group_advantages(REWARDS, IDS, kind="rloo")
    ids_int = [ord(i) for i in IDS]
    for rewards, ids in [(np.array(REWARDS), np.array(IDS)), (np.array(REWARDS, np.float32), np.array(ids_int)),
                         (tuple(REWARDS), ids_int)]:
        adv, _ = group_advantages(rewards, ids, kind="rloo")
        np.testing.assert_array_equal(adv, expected)
    adv, stats = group_advantages(np.array([]), [])
    assert adv.shape == (0,) and adv.dtype == np.float32 and stats["num_groups"] == 0
    assert stats["zero_variance_mask"].dtype == bool


@pytest.mark.parametrize("args,match", [
    (([1.0, 2.0], ["a"]), "2 rewards but 1 group ids"),
    (([1.0, math.nan], ["a", "a"]), "finite"),
    (([[1.0, 2.0]], ["a", "a"]), "1-D"),
    (([1.0], ["a"], "ppo"), "kind"),
    (([1.0], ["a"], "grpo", -1.0), "eps"),
])
def test_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(*args)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 3.25]), min_size=1, max_size=6), min_size=1, max_size=5
    ),
    seed=st.integers(0, 1000),
)
def test_properties_against_brute_force(groups, seed):
    rewards = [r for g in groups for r in g]
    ids = [f"q{i}" for i, g in enumerate(groups) for _ in g]
    perm = np.random.default_rng(seed).permutation(len(rewards))  # groups need not be contiguous
    rewards, ids = [rewards[i] for i in perm], [ids[i] for i in perm]
    out = {k: group_advantages(rewards, ids, kind=k, eps=0.0)[0].astype(np.float64) for k in ("grpo", "drgrpo", "rloo")}
    _, stats = group_advantages(rewards, ids)
    for gid in set(ids):
        idx = [i for i, g in enumerate(ids) if g == gid]
        r = np.array([rewards[i] for i in idx])
        zero = bool(np.all(r == r[0]))
        assert all(stats["zero_variance_mask"][i] == zero for i in idx)
        if zero:
            assert all(out[k][i].item() == 0.0 for k in out for i in idx)
            continue
        for j, i in enumerate(idx):
            loo = np.delete(r, j).mean()
            assert out["rloo"][i].item() == pytest.approx(r[j] - loo, abs=1e-6)
            assert out["drgrpo"][i].item() == pytest.approx(r[j] - r.mean(), abs=1e-6)
        g = out["grpo"][idx]
        assert g.mean().item() == pytest.approx(0.0, abs=1e-6)
        assert g.std(ddof=1).item() == pytest.approx(1.0, abs=1e-5)  # the sample std, as grpo divides by
    distinct = {g: {r for r, x in zip(rewards, ids) if x == g} for g in set(ids)}
    assert stats["num_zero_variance_groups"] == sum(len(v) == 1 for v in distinct.values())
    assert stats["num_groups"] == len(groups)
