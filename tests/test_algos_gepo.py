"""GEPO: golden numbers worked out by hand, the group statistic across micro-batches, the learners'
plumbing of group ids, and the shared mismatch metrics every objective reports."""

import math

import numpy as np
import pytest
import torch

from stoa.algos import ObjectiveInputs, gepo, resolve_objective
from stoa.algos.base import GroupContext, mismatch_metrics
from stoa.types import Episode, Segment


def golden_batch(groups=True):
    """Three rows, 5 counted tokens (sequence probabilities are geometric means over tokens).

    row 0, group 0: mu .5 .5   -> q .5;  pi .8 .2 -> p .4;         A +1
    row 1, group 0: mu .25     -> q .25; pi .3    -> p .3;         A -1  (then one padding slot)
    row 2, group 1: mu .1 .4   -> q .2;  pi .2 .5 -> p sqrt(.1);   A +1
    E_0 = (.5^2 + .25^2) / (.5 + .25) = .3125 / .75 = 5/12;   E_1 = q_2 = .2
    w_0 = .4 / (5/12) = .96 (no clip);  w_1 = .3 / (5/12) = .72 (A < 0, below .8: clipped low);
    w_2 = .3162278 / .2 = 1.5811388 (A > 0, above 1.2: clipped high)
    """
    lp = torch.tensor([[0.8, 0.2], [0.3, 1.0], [0.2, 0.5]]).log()
    lp[1, 1] = -math.inf
    lp.requires_grad_()
    inputs = ObjectiveInputs(
        logprobs=lp,
        behavior_logprobs=torch.tensor([[0.5, 0.5], [0.25, 1.0], [0.1, 0.4]]).log(),
        advantages=torch.tensor([[1.0, 1.0], [-1.0, 7.0], [1.0, 1.0]]),
        mask=torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]),
        group_index=torch.tensor([0, 0, 1]) if groups else None,
    )
    return lp, inputs


# Row losses l_i = -min(w A, clip(w) A): l_0 = -.96, l_1 = -min(-.72, -.8) = .8, l_2 = -min(1.58, 1.2) = -1.2
GOLDEN = {
    # sum_i n_i l_i / N_tok = (2 * -.96 + .8 + 2 * -1.2) / 5
    "token_mean": (-3.52 / 5, -0.96 / 5),
    # the paper's reduction: mean over rows (-.96 + .8 - 1.2) / 3; row 0 token gradient -w_0 / (2 * 3)
    "seq_mean_token_mean": (-1.36 / 3, -0.96 / 6),
    # sum_i n_i l_i / (max_tokens_norm 4 * 3 rows)
    "seq_mean_token_sum_norm": (-3.52 / 12, -0.96 / 12),
}


@pytest.mark.parametrize("aggregation", list(GOLDEN))
def test_golden_loss_and_gradient(aggregation):
    lp, inputs = golden_batch()
    loss, _ = gepo.loss(inputs, gepo.Config(aggregation=aggregation, max_tokens_norm=4))
    want_loss, want_grad = GOLDEN[aggregation]
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    (g,) = torch.autograd.grad(loss, lp)
    # Only row 0 is unclipped; its loss -A w_0 spreads as -A w_0 / n_0 over its two tokens.
    torch.testing.assert_close(g, torch.tensor([[want_grad, want_grad], [0.0, 0.0], [0.0, 0.0]]))


def test_golden_metrics():
    _, inputs = golden_batch()
    _, m = gepo.loss(inputs, gepo.Config())
    w = [0.96, 0.72, math.sqrt(0.1) / 0.2]
    assert m["gepo/weight_mean"] == pytest.approx(sum(w) / 3, rel=1e-5)
    assert (m["gepo/weight_min"], m["gepo/weight_max"]) == (pytest.approx(0.72, rel=1e-5), pytest.approx(w[2], rel=1e-5))
    # GSPO's own-row ratios p_i / q_i: .8, 1.2, 1.5811388
    assert m["gepo/seq_ratio_mean"] == pytest.approx((0.8 + 1.2 + w[2]) / 3, rel=1e-5)
    # row 1 (1 token) clipped low, row 2 (2 tokens) clipped high, of 5 counted tokens
    assert (m["clip/frac"], m["clip/high_frac"], m["clip/low_frac"]) == pytest.approx((0.6, 0.4, 0.2))
    assert m["loss/tokens"] == 5.0 and m["loss/sequences"] == 3.0


def test_without_groups_every_row_is_its_own_group():
    """No group_index: E_g = q_i, so w_i is GSPO's p_i / q_i: .8, 1.2 and 1.58."""
    lp, inputs = golden_batch(groups=False)
    loss, m = gepo.loss(inputs, gepo.Config())
    # l_0 = -.8; l_1 = -min(-1.2, -1.2) = 1.2 (no clip active); l_2 = -1.2 (clipped high)
    assert loss.item() == pytest.approx((2 * -0.8 + 1.2 + 2 * -1.2) / 5, abs=1e-6)
    assert m["gepo/weight_mean"] == pytest.approx(m["gepo/seq_ratio_mean"], rel=1e-6)
    (g,) = torch.autograd.grad(loss, lp)
    # row 0: -A w / n_0 * (n_0 / N) = -.8 / 5; row 1: +1.2 / 5 (unclipped, A < 0)
    torch.testing.assert_close(g, torch.tensor([[-0.16, -0.16], [0.24, 0.0], [0.0, 0.0]]))


def test_group_context_makes_micro_batches_sum_to_the_full_batch():
    """Group 0 split across two micro-batches: with the context each still sees E_0 = 5/12."""
    lp, inputs = golden_batch()
    full, _ = gepo.loss(inputs, gepo.Config())
    ctx = GroupContext(inputs.behavior_logprobs, inputs.mask, inputs.group_index)
    total = 0.0
    for rows in ([0], [1, 2]):
        part = ObjectiveInputs(lp[rows], inputs.behavior_logprobs[rows], inputs.advantages[rows], inputs.mask[rows],
                               normalizer=5.0, group_index=inputs.group_index[rows], group_context=ctx)
        total += gepo.loss(part, gepo.Config())[0].item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    # Without the context, row 0 alone is its group's only member: w_0 = .4 / .5 = .8, not .96.
    alone = ObjectiveInputs(lp[[0]], inputs.behavior_logprobs[[0]], inputs.advantages[[0]], inputs.mask[[0]],
                            group_index=torch.tensor([0]))
    assert gepo.loss(alone, gepo.Config())[1]["gepo/weight_mean"] == pytest.approx(0.8, rel=1e-6)


def test_float64_gradcheck_away_from_the_clip():
    g = torch.Generator().manual_seed(0)
    blp = -torch.rand(4, 3, generator=g, dtype=torch.float64) * 2 - 0.1
    lp = blp + 0.01 * torch.randn(4, 3, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)[:, None].expand(4, 3).contiguous()
    mask = torch.ones(4, 3, dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    x = lp.clone().requires_grad_()
    fn = lambda v: gepo.loss(ObjectiveInputs(v, blp, adv, mask, group_index=groups), gepo.Config(clip_low=1.0,
                                                                                               clip_high=math.inf))[0]
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("bad", [{"clip_low": 1.5}, {"clip_low": -0.1}, {"clip_high": -1.0}, {"aggregation": "sum"}])
def test_config_bounds(bad):
    with pytest.raises(ValueError):
        gepo.Config(**bad)


def test_group_index_is_checked():
    _, inputs = golden_batch()
    args = (inputs.logprobs, inputs.behavior_logprobs, inputs.advantages, inputs.mask)
    with pytest.raises(ValueError, match="group_index"):
        ObjectiveInputs(*args, group_index=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="group_index"):
        ObjectiveInputs(*args, group_index=torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="needs group_index"):
        ObjectiveInputs(*args, group_context=GroupContext(inputs.behavior_logprobs, inputs.mask, torch.tensor([0, 0, 1])))


def test_learner_plumbing_numbers_group_ids_and_splits_exactly():
    """ObjectiveBatch (both learners' shared plumbing) numbers Episode.group_id and passes the whole
    batch's context, so micro-batch losses that split a group sum to the full-batch loss."""
    from stoa.backends.torch.objective import ObjectiveBatch

    def ep(gid, lps):
        n = len(lps)
        return Episode(np.arange(3), [Segment("model", np.arange(n) + 5, np.log(np.array(lps, np.float32)))],
                       reward=0.0, group_id=gid)

    episodes = [ep("b", [0.5, 0.5]), ep("a", [0.25]), ep("b", [0.1, 0.4]), ep("a", [0.6, 0.7, 0.2])]
    adv = np.array([1.0, -1.0, 0.5, 2.0], np.float32)
    batch = ObjectiveBatch(episodes, adv, resolve_objective("gepo"))
    assert batch.group_index.tolist() == [0, 1, 0, 1]
    rng = np.random.default_rng(0)
    # Trainer log-probs of every token (prompt slots too; only counted ones matter).
    lps = [np.log(rng.uniform(0.1, 0.9, len(e.tokens()))).astype(np.float32) for e in episodes]
    total = 0.0
    for ids in ([0, 3], [1, 2]):  # each micro-batch holds half of each group
        flat = torch.from_numpy(np.concatenate([lps[i] for i in ids]))
        width = max(len(lps[i]) for i in ids)
        index = np.full((len(ids), width), len(flat), np.int64)
        off = 0
        for j, i in enumerate(ids):
            index[j, : len(lps[i])] = np.arange(off, off + len(lps[i]))
            off += len(lps[i])
        total += batch.loss(ids, flat, index).item()
    assert total == pytest.approx(batch.metrics(lps)["loss"], rel=1e-5, abs=1e-7)


# -- the shared mismatch metrics -------------------------------------------------------------------


def test_golden_mismatch_metrics():
    """t0 mu .5 pi .8 A +1 (r 1.6, pi-mu +.3: TV gate, A > 0); t1 mu .01 pi .15 A +1 (r 15, +.14);
    t2 mu .5 pi .2 A -1 (r .4, -.3: TV gate, A < 0); t3 mu .1 pi .25 A -1 (r 2.5, +.15); t4 masked."""
    pi = torch.tensor([[0.8, 0.15, 0.2, 0.25, 0.9]])
    mu = torch.tensor([[0.5, 0.01, 0.5, 0.1, 0.001]])
    inputs = ObjectiveInputs(pi.log(), mu.log(), torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]]),
                             torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]]))
    m = mismatch_metrics(inputs)
    r = [1.6, 15.0, 0.4, 2.5]
    assert m["mismatch/kl_all"].item() == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 4, rel=1e-5)
    assert m["mismatch/abs_log_ratio"].item() == pytest.approx(sum(abs(math.log(x)) for x in r) / 4, rel=1e-5)
    assert m["mismatch/ratio_gt2_frac"].item() == 0.5 and m["mismatch/ratio_gt10_frac"].item() == 0.25
    assert m["mismatch/tv_gate_frac"].item() == 0.5
    assert m["mismatch/tv_gate_pos_frac"].item() == 0.25 and m["mismatch/tv_gate_neg_frac"].item() == 0.25


def test_every_objective_reports_the_mismatch_metrics_the_same_way():
    """Same inputs, same mismatch numbers under every built-in; DPPO's default gate is the TV count."""
    from stoa.algos import OBJECTIVES

    _, inputs = golden_batch()
    ref = {k: v.item() for k, v in mismatch_metrics(inputs).items()}
    for name in OBJECTIVES:
        m = resolve_objective(name).loss(inputs)[1]
        assert {k: m[k] for k in ref} == pytest.approx(ref), name
    m = resolve_objective("dppo").loss(inputs)[1]
    assert m["gate/masked_frac"] == pytest.approx(ref["mismatch/tv_gate_frac"])
    assert m["gate/masked_high_frac"] == pytest.approx(ref["mismatch/tv_gate_pos_frac"])
