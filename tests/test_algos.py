"""The objective contract: inputs, registry, aggregation across micro-batches, and properties
every built-in objective must have (empty batches, padding, on-policy agreement)."""

import dataclasses
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stoa.algos as algos
from stoa.algos import OBJECTIVES, ObjectiveInputs, batch_normalizer, get_objective, make_objective

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def random_batch(seed: int, b: int = 5, t: int = 7, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    blp = (lp + 0.5 * torch.randn(b, t, generator=g, dtype=dtype)).clamp(max=0)
    adv = torch.randn(b, 1, generator=g, dtype=dtype).expand(b, t).contiguous()
    mask = (torch.rand(b, t, generator=g) < 0.7).to(dtype)
    mask[0] = 0  # one sequence without counted tokens
    return lp, blp, adv, mask


# -- inputs -------------------------------------------------------------------------------------


def test_inputs_validation():
    ok = [torch.zeros(2, 3) for _ in range(4)]
    ObjectiveInputs(*ok)
    with pytest.raises(ValueError, match="shapes differ"):
        ObjectiveInputs(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        ObjectiveInputs(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3))
    with pytest.raises(TypeError, match="float"):
        ObjectiveInputs(*ok[:3], torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.Tensor"):
        ObjectiveInputs(*ok[:3], [[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="only 0 and 1"):
        ObjectiveInputs(*ok[:3], torch.full((2, 3), 0.5))
    for bad in (-1.0, math.nan, math.inf, True, "3"):
        with pytest.raises(ValueError, match="normalizer"):
            ObjectiveInputs(*ok, normalizer=bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ObjectiveInputs(*ok).mask = ok[0]


def test_bool_mask_is_accepted_and_converted():
    inputs = ObjectiveInputs(*[torch.zeros(2, 3)] * 3, torch.tensor([[True, False, True]] * 2))
    assert inputs.mask.dtype == torch.float32 and inputs.mask.sum().item() == 4


def test_low_precision_inputs_compute_in_float32():
    lp, blp, adv, mask = random_batch(0, dtype=torch.float32)
    ref, _ = algos.dppo.loss(ObjectiveInputs(lp, blp, adv, mask), algos.dppo.Config())
    lp16 = lp.to(torch.bfloat16).requires_grad_()
    out, _ = algos.dppo.loss(ObjectiveInputs(lp16, blp.bfloat16(), adv.bfloat16(), mask.bfloat16()),
                             algos.dppo.Config())
    assert out.dtype == torch.float32
    out.backward()
    assert lp16.grad.dtype == torch.bfloat16
    assert out.item() == pytest.approx(ref.item(), rel=0.05, abs=0.02)


# -- registry ------------------------------------------------------------------------------------


def test_registry_lists_the_builtins_and_resolves_them():
    assert list(OBJECTIVES) == ["dppo", "ppo", "tis", "icepop", "reinforce"]
    assert algos.DEFAULT_OBJECTIVE == "dppo"
    for name, target in OBJECTIVES.items():
        cfg_cls, fn = get_objective(name)
        module = getattr(algos, name)
        assert cfg_cls is module.Config and fn is module.loss
        assert get_objective(target) == (cfg_cls, fn)


def test_make_objective_from_a_toml_table():
    import tomllib

    table = tomllib.loads('[objective]\nname = "dppo"\ngate = "kl"\ndelta_high = 0.1\nratio_cap = 5\n')["objective"]
    cfg, fn = make_objective(table.pop("name"), **table)
    assert cfg == algos.dppo.Config(gate="kl", delta_high=0.1, delta_low=0.05, ratio_cap=5)
    assert fn is algos.dppo.loss
    cfg, _ = make_objective()
    assert cfg == algos.dppo.Config()
    with pytest.raises(ValueError, match=r"no option\(s\) \['delta'\].*valid options: \[.*'delta_high'"):
        make_objective("dppo", delta=0.1)
    with pytest.raises(ValueError, match="ratio_cap"):
        make_objective("dppo", ratio_cap=0.0)


def test_custom_objective_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_objective.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from stoa.algos.base import aggregate, prepare
        import torch

        @dataclass(frozen=True)
        class Config:
            scale: float = 2.0

        def scaled_pg(inputs, config):
            p = prepare(inputs)
            per_token = torch.where(p.counted, -config.scale * p.adv * p.lp, 0)
            return aggregate(per_token, p.counted, "token_mean", max_tokens_norm=1.0), {}
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, fn = make_objective("my_objective:scaled_pg", scale=3.0)
    lp, blp, adv, mask = random_batch(1)
    custom, _ = fn(ObjectiveInputs(lp, blp, adv, mask), cfg)
    base, _ = algos.reinforce.loss(ObjectiveInputs(lp, blp, adv, mask), algos.reinforce.Config())
    torch.testing.assert_close(custom, 3 * base)


@pytest.mark.parametrize("name,error", [
    ("grpo", ValueError), ("stoa.algos.base", ValueError), ("stoa.algos.base:nothing", ValueError),
    ("math:sqrt", ValueError), ("no_such_module_xyz:loss", ImportError), (":loss", ValueError), (3, ValueError),
])
def test_bad_objective_names(name, error):
    with pytest.raises(error):
        get_objective(name)


def test_import_boundaries():
    # stoa.algos brings torch but never mlx/megatron; `import stoa` does not bring stoa.algos.
    code = (
        "import sys, stoa; assert 'stoa.algos' not in sys.modules and 'torch' not in sys.modules;"
        "import stoa.algos; heavy = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'megatron')];"
        "assert not heavy, heavy; from stoa.algos import dppo, advantages; print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# -- properties of every objective ----------------------------------------------------------------

ALL = [(name, agg) for name in OBJECTIVES for agg in AGGREGATIONS]


@pytest.mark.parametrize("name,aggregation", ALL)
def test_all_masked_batch_gives_finite_zero(name, aggregation):
    cfg, fn = make_objective(name, aggregation=aggregation)
    lp = torch.full((2, 3), -math.inf, requires_grad=True)  # padding may hold anything
    inputs = ObjectiveInputs(lp, torch.full((2, 3), math.nan), torch.ones(2, 3), torch.zeros(2, 3))
    for normalizer in (None, 0.0, 7.0):
        loss, m = fn(dataclasses.replace(inputs, normalizer=normalizer), cfg)
        assert loss.item() == 0.0
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.all(g == 0)
        assert all(math.isfinite(v) for v in m.values()) and m["loss/tokens"] == 0.0


@pytest.mark.parametrize("name,aggregation", ALL)
def test_micro_batches_sum_to_the_full_batch(name, aggregation):
    cfg, fn = make_objective(name, aggregation=aggregation, max_tokens_norm=16.0)
    lp, blp, adv, mask = random_batch(2, b=6)
    full_lp = lp.clone().requires_grad_()
    full, _ = fn(ObjectiveInputs(full_lp, blp, adv, mask), cfg)
    (g_full,) = torch.autograd.grad(full, full_lp)

    parts = [slice(0, 1), slice(1, 4), slice(4, 6)]
    n = batch_normalizer(mask, aggregation)
    assert n == sum(batch_normalizer(mask[s], aggregation) for s in parts)
    total, grads = 0.0, []
    for s in parts:
        mb_lp = lp[s].clone().requires_grad_()
        out, _ = fn(ObjectiveInputs(mb_lp, blp[s], adv[s], mask[s], normalizer=n), cfg)
        (g,) = torch.autograd.grad(out, mb_lp)
        total, grads = total + out.item(), grads + [g]
    assert total == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(torch.cat(grads), g_full, rtol=1e-12, atol=1e-12)


def test_normalizer_zero_with_counted_tokens_is_an_error():
    lp, blp, adv, mask = random_batch(3)
    with pytest.raises(ValueError, match="normalizer is 0"):
        algos.dppo.loss(ObjectiveInputs(lp, blp, adv, mask, normalizer=0), algos.dppo.Config())


@pytest.mark.parametrize("name", list(OBJECTIVES))
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), pad=st.integers(1, 4))
def test_padding_and_masked_tokens_change_nothing(name, seed, pad):
    """Appending masked positions full of garbage leaves loss, gradients and metrics unchanged."""
    cfg, fn = make_objective(name, aggregation="seq_mean_token_mean")
    lp, blp, adv, mask = random_batch(seed)
    b = lp.shape[0]
    g = torch.Generator().manual_seed(seed)
    junk = torch.randn(b, pad, generator=g, dtype=lp.dtype) * 50
    junk[:, 0] = math.inf
    lp_a = lp.clone().requires_grad_()
    lp_b = torch.cat([lp, -junk.abs()], 1).requires_grad_()
    out_a, m_a = fn(ObjectiveInputs(lp_a, blp, adv, mask), cfg)
    out_b, m_b = fn(ObjectiveInputs(lp_b, torch.cat([blp, junk], 1), torch.cat([adv, junk], 1),
                                    torch.cat([mask, torch.zeros(b, pad, dtype=mask.dtype)], 1)), cfg)
    (g_a,) = torch.autograd.grad(out_a, lp_a)
    (g_b,) = torch.autograd.grad(out_b, lp_b)
    assert out_a.item() == pytest.approx(out_b.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(g_b[:, : lp.shape[1]], g_a, rtol=1e-12, atol=1e-12)
    assert torch.all(g_b[:, lp.shape[1]:] == 0)
    assert m_a == pytest.approx(m_b, rel=1e-12, abs=1e-12)


def test_on_policy_all_objectives_give_the_reinforce_gradient():
    """With pi == mu every ratio is 1: no gate, clip or cap is active, so the gradients agree."""
    lp, _, adv, mask = random_batch(4)
    grads = {}
    for name in OBJECTIVES:
        cfg, fn = make_objective(name)
        x = lp.clone().requires_grad_()
        out, m = fn(ObjectiveInputs(x, lp.clone(), adv, mask), cfg)
        (grads[name],) = torch.autograd.grad(out, x)
        assert m["mismatch/kl_all"] == 0.0 and m["ratio/min"] == m["ratio/max"] == 1.0
        assert m.get("gate/masked_frac", 0.0) == 0.0 and m.get("clip/frac", 0.0) == 0.0
    for name, g in grads.items():
        torch.testing.assert_close(g, grads["reinforce"], msg=name)
    assert grads["reinforce"].abs().sum() > 0


# DPPO, TIS and IcePop detach their importance weight on purpose, so finite differences of their
# loss value are not their gradient; the golden-gradient tests cover them instead.
@pytest.mark.parametrize("name", ["ppo", "reinforce"])
def test_float64_gradcheck(name):
    cfg, fn = make_objective(name)
    lp, blp, adv, mask = random_batch(5, b=3, t=4)
    # Keep ratios away from every gate/clip/cap boundary so the loss is smooth where checked.
    blp = blp.clamp(max=-0.05)
    lp = blp + 0.01 * torch.sin(torch.arange(12, dtype=blp.dtype)).reshape(3, 4)
    x = lp.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: fn(ObjectiveInputs(v, blp, adv, mask), cfg)[0], (x,))


REWARDS_GPU, IDS_GPU = [1.0, 0.0, 1.0, 0.5, 0.5], ["a", "a", "a", "b", "b"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_cuda_gpu_bf16_matches_cpu(name):
    from stoa.algos.advantages import group_advantages

    cfg, fn = make_objective(name)
    lp, blp, adv, mask = random_batch(6, dtype=torch.float32)
    lp = lp.bfloat16().float()  # the values a bf16 trainer would produce
    ref, m_ref = fn(ObjectiveInputs(lp, blp, adv, mask), cfg)
    x = lp.cuda().bfloat16().requires_grad_()
    out, m = fn(ObjectiveInputs(x, blp.cuda(), adv.cuda(), mask.cuda().bool()), cfg)
    out.backward()
    assert out.device.type == "cuda" and x.grad is not None and torch.isfinite(x.grad.float()).all()
    assert out.item() == pytest.approx(ref.item(), rel=1e-4, abs=1e-5)
    assert m == pytest.approx(m_ref, rel=1e-4, abs=1e-5)
    a_gpu, s_gpu = group_advantages(torch.tensor(REWARDS_GPU, device="cuda"), IDS_GPU)
    a_cpu, _ = group_advantages(REWARDS_GPU, IDS_GPU)
    assert a_gpu.device.type == "cuda" and s_gpu["zero_variance_mask"].device.type == "cuda"
    torch.testing.assert_close(a_gpu.cpu(), a_cpu)
