"""DPPO: golden numbers worked out by hand, autograd checks, and the gate's direction rule."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stoa.algos import ObjectiveInputs, dppo
from stoa.algos.dppo import binary_kl

ln = math.log


def golden_batch():
    """Two rows, 6 counted tokens; probabilities chosen so every case of the rule appears.

    row 0 (4 counted)                         row 1 (2 counted, then 2 padding)
      t0 mu .5  pi .8  A +1  pi-mu=+.3  high    t0 mu .01 pi .15 A +1  pi-mu=+.14 kept, r=15 -> cap 10
      t1 mu .5  pi .6  A +1  pi-mu=+.1  kept    t1 mu .9  pi .8  A -2  pi-mu=-.1  kept, r=.8/.9
      t2 mu .5  pi .2  A -1  pi-mu=-.3  low     t2, t3: padding with log pi = -inf and a large A
      t3 mu .5  pi .2  A +1  corrective: kept
    """
    pi = [[0.8, 0.6, 0.2, 0.2], [0.15, 0.8, 1.0, 1.0]]
    mu = [[0.5, 0.5, 0.5, 0.5], [0.01, 0.9, 1.0, 1.0]]
    lp = torch.tensor(pi).log()
    lp[1, 2:] = -math.inf
    lp.requires_grad_()
    inputs = ObjectiveInputs(
        logprobs=lp,
        behavior_logprobs=torch.tensor(mu).log(),
        advantages=torch.tensor([[1.0, 1.0, -1.0, 1.0], [1.0, -2.0, 5.0, -5.0]]),
        mask=torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]),
    )
    return lp, inputs


# Per-token losses -A * min(pi/mu, 10) * ln pi of the four kept tokens:
#   r0t1: -1 * 1.2 * ln .6            =  0.6129907
#   r0t3: -1 * 0.4 * ln .2            =  0.6437752
#   r1t0: -1 * 10  * ln .15           = 18.9712000   (ratio 15 capped at 10)
#   r1t1: +2 * (.8/.9) * ln .8        = -0.3966996
#   sum                               = 19.8312662
GOLDEN_LOSS = {
    "token_mean": 19.8312662 / 6,  # 3.3052110
    # row 0: (0.6129907 + 0.6437752) / 4 = 0.3141915; row 1: (18.9712 - 0.3966996) / 2 = 9.2872502
    "seq_mean_token_mean": (0.3141915 + 9.2872502) / 2,  # 4.8007208
    # sum / (max_tokens_norm 8 * 2 sequences)
    "seq_mean_token_sum_norm": 19.8312662 / 16,  # 1.2394541
}


@pytest.mark.parametrize("aggregation", list(GOLDEN_LOSS))
def test_golden_loss_tv_gate(aggregation):
    _, inputs = golden_batch()
    loss, _ = dppo.loss(inputs, dppo.Config(aggregation=aggregation, max_tokens_norm=8))
    assert loss.item() == pytest.approx(GOLDEN_LOSS[aggregation], abs=2e-6)


def test_golden_metrics_tv_gate():
    _, inputs = golden_batch()
    _, m = dppo.loss(inputs, dppo.Config())
    # ratios over counted tokens: 1.6, 1.2, .4, .4, 15, .8889
    # k3 = r - 1 - ln r: .1299964, .0176784, .3162907, .3162907, 11.2919498, .0066719
    expected = {
        "loss/tokens": 6.0,
        "loss/sequences": 2.0,
        "gate/masked_frac": 2 / 6,
        "gate/masked_high_frac": 1 / 6,
        "gate/masked_low_frac": 1 / 6,
        "mismatch/kl_all": 12.0788779 / 6,  # 2.0131463
        "mismatch/kl_kept": (0.0176784 + 0.3162907 + 11.2919498 + 0.0066719) / 4,  # 2.9081477
        "mismatch/kl_masked": (0.1299964 + 0.3162907) / 2,  # 0.2231436
        "ratio/min": 0.4,
        "ratio/mean": (1.6 + 1.2 + 0.4 + 0.4 + 15 + 0.8 / 0.9) / 6,  # 3.2481481
        "ratio/max": 15.0,
        "ratio/capped_frac": 1 / 4,  # one of the four kept tokens exceeds the cap
        # -ln pi: .2231436 + .5108256 + 2 * 1.6094379 + 1.89712 + .2231436 = 6.0731086
        "entropy_proxy": 6.0731086 / 6,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert all(isinstance(v, float) for v in m.values())


def test_golden_gradients():
    lp, inputs = golden_batch()
    loss, _ = dppo.loss(inputs, dppo.Config())
    loss.backward()
    # d loss / d log pi = -A * min(r, 10) / 6 at kept tokens, exactly 0 elsewhere.
    expected = torch.tensor([
        [0.0, -1.2 / 6, 0.0, -0.4 / 6],
        [-10 / 6, 2 * (0.8 / 0.9) / 6, 0.0, 0.0],
    ])
    torch.testing.assert_close(lp.grad, expected, rtol=1e-5, atol=1e-7)
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 2].item() == 0.0  # gated: exactly zero
    assert torch.all(lp.grad[1, 2:] == 0)  # padding with -inf log-probs: exactly zero, not NaN


def test_golden_kl_gate():
    #   t0 mu .5 pi .8  A +1: D = .5 ln(.5/.8) + .5 ln(.5/.2) = .2231436 > .05, rising -> high
    #   t1 mu .5 pi .55 A +1: D = .5 ln(.5/.55) + .5 ln(.5/.45) = .0050252 -> kept
    #   t2 mu .5 pi .3  A -1: D = .5 ln(.5/.3) + .5 ln(.5/.7) = .0871767 > .05, falling -> low
    #   t3 mu .5 pi .9  A -1: D = .5108256 but pi > mu is corrective for A < 0 -> kept
    pi = torch.tensor([[0.8, 0.55, 0.3, 0.9]])
    mu = torch.full((1, 4), 0.5)
    torch.testing.assert_close(
        binary_kl(pi.log(), mu.log()),
        torch.tensor([[0.2231436, 0.0050252, 0.0871767, 0.5108256]], dtype=torch.float64),
        rtol=1e-6, atol=1e-7,
    )
    lp = pi.log().requires_grad_()
    inputs = ObjectiveInputs(lp, mu.log(), torch.tensor([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4))
    loss, m = dppo.loss(inputs, dppo.Config(gate="kl"))
    # kept: t1 -1 * 1.1 * ln .55 = .6576207; t3 +1 * 1.8 * ln .9 = -.1896489; / 4 tokens
    assert loss.item() == pytest.approx((0.6576207 - 0.1896489) / 4, abs=1e-6)  # 0.1169930
    assert m["gate/masked_high_frac"] == 0.25 and m["gate/masked_low_frac"] == 0.25
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.1 / 4, 0.0, 1.8 / 4]]))


def test_golden_ppo_dual_clip_surrogate():
    #   t0 mu .5  pi .8  A +1: pi-mu = .3 > .2 -> gated
    #   t1 mu .5  pi .55 A +1: r = 1.1, inside the clip: loss -1.1, d/dlp = -A r = -1.1
    #   t2 mu .15 pi .6  A -1: not gated (rising is corrective for A < 0); r = 4 > c = 3:
    #      dual clip: loss -max(min(-4, -1.2), -3) = 3, zero gradient
    lp = torch.tensor([[0.8, 0.55, 0.6]]).log().requires_grad_()
    inputs = ObjectiveInputs(lp, torch.tensor([[0.5, 0.5, 0.15]]).log(),
                             torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3))
    loss, m = dppo.loss(inputs, dppo.Config(surrogate="ppo_dual_clip"))
    assert loss.item() == pytest.approx((0 - 1.1 + 3) / 3, abs=1e-6)  # 0.6333333
    assert m["gate/masked_frac"] == pytest.approx(1 / 3)
    assert m["clip/dual_frac"] == pytest.approx(1 / 3) and m["clip/high_frac"] == 0.0
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.1 / 3, 0.0]]))


def test_kept_token_gradient_through_a_real_policy():
    """grad_theta loss == sum over kept tokens of -A * min(pi/mu, C) / N * grad_theta log pi."""
    torch.manual_seed(0)
    vocab, dim, b, t = 7, 5, 3, 6
    w = torch.randn(vocab, dim, requires_grad=True)
    x = torch.randn(b, t, dim)
    tokens = torch.randint(0, vocab, (b, t))

    def logprobs():
        return torch.log_softmax(x @ w.T, -1).gather(-1, tokens[..., None])[..., 0]

    with torch.no_grad():  # a behaviour policy that drifted from pi
        blp = torch.log_softmax(x @ (w + 0.6 * torch.randn_like(w)).T, -1).gather(-1, tokens[..., None])[..., 0]
    adv = torch.randn(b, 1).expand(b, t).contiguous()
    mask = torch.ones(b, t)
    mask[0, :2] = 0
    cfg = dppo.Config(delta_high=0.1, delta_low=0.1, ratio_cap=2.0)
    loss, m = dppo.loss(ObjectiveInputs(logprobs(), blp, adv, mask), cfg)
    assert 0 < m["gate/masked_frac"] < 1 and m["ratio/capped_frac"] > 0  # every branch exercised
    (grad,) = torch.autograd.grad(loss, w)

    lp = logprobs()
    pi, mu = lp.detach().exp(), blp.exp()
    gated = ((adv > 0) & (pi - mu > 0.1)) | ((adv < 0) & (pi - mu < -0.1))
    expected = torch.zeros_like(w)
    for i in range(b):
        for j in range(t):
            if mask[i, j] and not gated[i, j]:
                (g,) = torch.autograd.grad(lp[i, j], w, retain_graph=True)
                expected += -adv[i, j] * min(math.exp(lp[i, j].item() - blp[i, j].item()), 2.0) / mask.sum() * g
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


probs = st.floats(min_value=1e-4, max_value=1.0, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(
    pi=st.lists(probs, min_size=1, max_size=12),
    data=st.data(),
    gate=st.sampled_from(["tv", "kl"]),
    delta=st.floats(min_value=0.01, max_value=0.5),
)
def test_gate_blocks_only_moves_away_from_mu(pi, data, gate, delta):
    n = len(pi)
    mu = data.draw(st.lists(probs, min_size=n, max_size=n))
    adv = data.draw(st.lists(st.sampled_from([-2.0, -0.5, 0.0, 0.5, 2.0]), min_size=n, max_size=n))
    lp = torch.tensor([pi], dtype=torch.float64).log().requires_grad_()
    inputs = ObjectiveInputs(lp, torch.tensor([mu], dtype=torch.float64).log(),
                             torch.tensor([adv], dtype=torch.float64), torch.ones(1, n, dtype=torch.float64))
    loss, _ = dppo.loss(inputs, dppo.Config(gate=gate, delta_high=delta, delta_low=delta, ratio_cap=math.inf))
    loss.backward()
    for p_, m_, a_, g_ in zip(pi, mu, adv, lp.grad[0].tolist()):
        lp_, lm_ = math.log(p_), math.log(m_)
        corrective = (a_ > 0 and lp_ <= lm_) or (a_ < 0 and lp_ >= lm_)
        if a_ == 0:
            assert g_ == 0.0
        elif corrective:  # always passes, with the plain importance-weighted gradient
            assert g_ == pytest.approx(-a_ * math.exp(lp_ - lm_) / n, rel=1e-9)
        else:  # moving away from mu: blocked exactly when the divergence exceeds delta
            div = abs(p_ - m_) if gate == "tv" else float(binary_kl(torch.tensor(lp_), torch.tensor(lm_)))
            if abs(div - delta) > 1e-9:
                assert (g_ == 0.0) == (div > delta), (p_, m_, a_, div)


def test_gate_ignores_tokens_outside_the_loss_mask():
    # Same data twice: once with the would-be-gated tokens counted, once with them masked out.
    lp = torch.tensor([[0.9, 0.6, 0.1, 0.6]]).log()
    blp = torch.full((1, 4), 0.5).log()
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    _, counted = dppo.loss(ObjectiveInputs(lp, blp, adv, torch.ones(1, 4)), dppo.Config())
    _, outside = dppo.loss(ObjectiveInputs(lp, blp, adv, torch.tensor([[0.0, 1.0, 0.0, 1.0]])), dppo.Config())
    assert counted["gate/masked_frac"] == 0.5
    assert outside["gate/masked_frac"] == 0.0 and outside["loss/tokens"] == 2.0
    assert outside["mismatch/kl_masked"] == 0.0


def test_tv_delta_one_never_gates_and_matches_tis():
    from stoa.algos import tis

    lp, inputs = golden_batch()
    loss_d, m = dppo.loss(inputs, dppo.Config(delta_high=1.0, delta_low=1.0, ratio_cap=2.0))
    (g_d,) = torch.autograd.grad(loss_d, lp)
    loss_t, _ = tis.loss(inputs, tis.Config(cap=2.0))
    (g_t,) = torch.autograd.grad(loss_t, lp)
    assert m["gate/masked_frac"] == 0.0
    torch.testing.assert_close(loss_d, loss_t)
    torch.testing.assert_close(g_d, g_t)


@pytest.mark.parametrize("bad", [
    dict(gate="js"), dict(delta_high=0.0), dict(delta_low=-0.1), dict(delta_high=1.5),
    dict(delta_high=math.nan), dict(delta_high=True), dict(ratio_cap=0.5), dict(surrogate="ppo"),
    dict(clip_low=1.5), dict(dual_clip_c=1.0), dict(aggregation="mean"), dict(max_tokens_norm=0),
    dict(delta_high="0.2"),
])
def test_config_bounds(bad):
    with pytest.raises(ValueError):
        dppo.Config(**bad)


def test_config_defaults_follow_the_gate():
    assert (dppo.Config().delta_high, dppo.Config().delta_low) == (0.2, 0.2)
    kl = dppo.Config(gate="kl")
    assert (kl.delta_high, kl.delta_low) == (0.05, 0.05)
    assert dppo.Config(gate="kl", delta_high=2.0).delta_high == 2.0  # KL is unbounded
    assert dppo.Config(ratio_cap=math.inf).ratio_cap == math.inf
