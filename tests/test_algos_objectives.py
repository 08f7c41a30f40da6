"""PPO, TIS, IcePop and REINFORCE: golden numbers worked out by hand, with gradients."""

import math

import pytest
import torch

from stoa.algos import ObjectiveInputs, icepop, ppo, reinforce, tis


def three_tokens():
    """t0: mu .5 pi .8 A +1 (r 1.6); t1: mu .01 pi .15 A +1 (r 15); t2: mu .5 pi .2 A -1 (r .4)."""
    lp = torch.tensor([[0.8, 0.15, 0.2]]).log().requires_grad_()
    blp = torch.tensor([[0.5, 0.01, 0.5]]).log()
    return lp, ObjectiveInputs(lp, blp, torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3))


def test_golden_tis():
    lp, inputs = three_tokens()
    loss, m = tis.loss(inputs, tis.Config())
    # -A * min(r, 2) * ln pi:  t0 -1.6 * ln .8 = .3570297;  t1 -2 * ln .15 = 3.7942400 (capped);
    #                          t2 +.4 * ln .2 = -.6437752;  mean over 3 = 1.1691648
    assert loss.item() == pytest.approx((0.3570297 + 3.79424 - 0.6437752) / 3, abs=1e-6)
    assert m["ratio/capped_frac"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.6 / 3, -2.0 / 3, 0.4 / 3]]))


def test_golden_icepop():
    lp, inputs = three_tokens()
    loss, m = icepop.loss(inputs, icepop.Config())
    # band [.5, 5]: t1 (r 15) masked high, t2 (r .4) masked low even though it is corrective;
    # t0: -1 * 1.6 * ln .8 = .3570297, over 3 counted tokens = .1190099
    assert loss.item() == pytest.approx(0.3570297 / 3, abs=1e-6)
    assert m["gate/masked_frac"] == pytest.approx(2 / 3)
    assert m["gate/masked_high_frac"] == pytest.approx(1 / 3) and m["gate/masked_low_frac"] == pytest.approx(1 / 3)
    # k3 kept: 1.6 - 1 - ln 1.6 = .1299964; masked: (15 - 1 - ln 15 + .4 - 1 - ln .4) / 2 = 5.8041203
    assert m["mismatch/kl_kept"] == pytest.approx(0.1299964, rel=1e-5)
    assert m["mismatch/kl_masked"] == pytest.approx((11.2919498 + 0.3162907) / 2, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.6 / 3, 0.0, 0.0]]))


def test_golden_reinforce():
    lp, inputs = three_tokens()
    loss, m = reinforce.loss(inputs, reinforce.Config())
    # -A * ln pi: -ln .8 - ln .15 + ln .2 = .2231436 + 1.8971200 - 1.6094379 = .5108257; / 3
    assert loss.item() == pytest.approx(0.5108257 / 3, abs=1e-6)  # 0.1702752
    assert m["ratio/max"] == pytest.approx(15.0) and m["loss/tokens"] == 3.0
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, -1 / 3, 1 / 3]]))


def ppo_tokens():
    """t0 r 1.6 A +1; t1 r 1.1 A +1; t2 r .4 A -1; t3 r 4 A -1."""
    lp = torch.tensor([[0.8, 0.55, 0.2, 0.8]]).log().requires_grad_()
    blp = torch.tensor([[0.5, 0.5, 0.5, 0.2]]).log()
    return lp, ObjectiveInputs(lp, blp, torch.tensor([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4))


def test_golden_ppo_with_and_without_dual_clip():
    #   t0: min(1.6 * 1, 1.2 * 1) = 1.2                 -> loss -1.2, clipped high, grad 0
    #   t1: min(1.1, 1.1) = 1.1                         -> loss -1.1, grad -A r = -1.1
    #   t2: min(-.4, .8 * -1) = -.8                     -> loss  .8, clipped low, grad 0
    #   t3: min(-4, 1.2 * -1) = -4                      -> loss  4, grad -A r = +4
    #       with dual clip c = 3: max(-4, 3 * -1) = -3  -> loss  3, grad 0
    lp, inputs = ppo_tokens()
    loss, m = ppo.loss(inputs, ppo.Config())
    assert loss.item() == pytest.approx((-1.2 - 1.1 + 0.8 + 4) / 4, abs=1e-6)  # .625
    assert (m["clip/high_frac"], m["clip/low_frac"], m["clip/dual_frac"]) == (0.25, 0.25, 0.0)
    assert m["clip/frac"] == 0.5
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([[0.0, -1.1 / 4, 0.0, 4 / 4]]))

    loss, m = ppo.loss(inputs, ppo.Config(dual_clip_c=3.0))
    assert loss.item() == pytest.approx((-1.2 - 1.1 + 0.8 + 3) / 4, abs=1e-6)  # .375
    assert m["clip/dual_frac"] == 0.25 and m["clip/frac"] == 0.75
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([[0.0, -1.1 / 4, 0.0, 0.0]]))


def test_ppo_clip_higher():
    # DAPO's clip-higher (clip_high .28) moves t0's bound from 1.2 to 1.28: loss t0 = -1.28.
    _, inputs = ppo_tokens()
    loss, _ = ppo.loss(inputs, ppo.Config(clip_high=0.28))
    assert loss.item() == pytest.approx((-1.28 - 1.1 + 0.8 + 4) / 4, abs=1e-6)


@pytest.mark.parametrize("module,bad", [
    (ppo, dict(clip_low=-0.1)), (ppo, dict(clip_high=math.nan)), (ppo, dict(dual_clip_c=0.5)),
    (tis, dict(cap=0.9)), (tis, dict(cap=None)), (icepop, dict(ratio_low=0.0)),
    (icepop, dict(ratio_low=1.5)), (icepop, dict(ratio_high=0.9)), (reinforce, dict(aggregation="sum")),
    (reinforce, dict(max_tokens_norm=-1.0)),
])
def test_config_bounds(module, bad):
    with pytest.raises(ValueError):
        module.Config(**bad)
