"""Packing plans, varlen layouts, the LR schedule and LearnerConfig bounds (numpy and torch only)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stoa.backends.learner import LearnerConfig, lr_at
from stoa.backends.packing import build_micro_batches, plan_micro_batches

lengths_st = st.lists(st.integers(1, 60), min_size=1, max_size=40)


BLOCK_HEAVY = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'transformers', 'megatron', 'mlx', 'mlx_lm'}:
            raise ImportError(f'{name} is blocked in this test')
sys.meta_path.insert(0, Block())
"""


def test_packing_imports_neither_torch_nor_transformers():
    """Both learners plan their micro-batches with this module; planning stays as light as `import stoa`."""
    code = BLOCK_HEAVY + textwrap.dedent("""
        import numpy as np
        from stoa.backends.packing import build_micro_batches, plan_micro_batches
        import stoa.backends.learner
        print(plan_micro_batches([5, 3, 4], 8, True), len(build_micro_batches([np.arange(5), np.arange(3)], 8, True)))
        try:
            import torch
        except ImportError:
            print("blocked")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[[[0, 1]], [[2]]] 1", "blocked"]


@settings(max_examples=150, deadline=None)
@given(lengths_st, st.integers(1, 128), st.booleans())
def test_plan_places_every_episode_once_within_budget(lengths, budget, packing):
    plan = plan_micro_batches(lengths, budget, packing)
    placed = sorted(i for mb in plan for row in mb for i in row)
    assert placed == list(range(len(lengths)))
    for mb in plan:
        if packing:
            assert len(mb) == 1
            row = mb[0]
            assert sum(lengths[i] for i in row) <= budget or len(row) == 1
        else:
            assert all(len(row) == 1 for row in mb)
            assert len(mb) * max(lengths[row[0]] for row in mb) <= budget or len(mb) == 1


@settings(max_examples=100, deadline=None)
@given(lengths_st, st.integers(8, 128), st.booleans())
def test_micro_batches_lay_out_tokens_and_positions(lengths, budget, packing):
    rng = np.random.default_rng(len(lengths))
    toks = [rng.integers(0, 1000, n) for n in lengths]
    for mb in build_micro_batches(toks, budget, packing):
        got = dict(mb.split(mb.input_ids))
        for i, arr in got.items():
            np.testing.assert_array_equal(arr, toks[i])
        for i, arr in mb.split(mb.position_ids):
            np.testing.assert_array_equal(arr, np.arange(lengths[i]))
        assert mb.num_tokens == sum(lengths[i] for i in got)
        if packing:
            # Gathering through the buckets and scattering back via slot is the identity on real
            # positions, and each bucket row holds exactly one episode, in order.
            flat = mb.input_ids.reshape(-1)
            blocks = np.concatenate([flat[idx] for idx, _, _ in mb.varlen.buckets])
            np.testing.assert_array_equal(blocks[mb.varlen.slot], flat)
            starts = {s: n for _, _, s, n in mb.placements}
            for idx, n, w in mb.varlen.buckets:
                for r in idx.reshape(n, w):
                    k = starts.pop(int(r[0]))
                    np.testing.assert_array_equal(r[:k], np.arange(r[0], r[0] + k))
                    assert np.all(r[k:] == r[0])
            assert not starts
        else:
            assert mb.attention_mask.sum() == mb.num_tokens


def test_varlen_buckets_bound_padding_work():
    toks = [np.zeros(n, np.int64) for n in (64, 60, 33, 32, 20, 9, 8, 2)]
    (mb,) = build_micro_batches(toks, 1000, packing=True)
    exact = sum(len(t) ** 2 for t in toks)
    padded = sum(n * w * w for _, n, w in mb.varlen.buckets)
    assert padded <= 4 * exact and len(mb.varlen.buckets) > 1


def test_varlen_attention_equals_per_episode_attention():
    from stoa.backends.torch.attention import VarlenTensors, varlen_attention

    torch.manual_seed(0)
    lengths = [7, 3, 12, 1, 5]
    (mb,) = build_micro_batches([np.zeros(n) for n in lengths], 100, packing=True)
    total = mb.input_ids.shape[1]
    q, k, v = torch.randn(1, 4, total, 8), torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 8)
    out, _ = varlen_attention(None, q, k, v, None, scaling=0.3, stoa_varlen=VarlenTensors.from_layout(mb.varlen, "cpu"))
    for i, _r, s, n in mb.placements:
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s : s + n], k[:, :, s : s + n].repeat_interleave(2, 1), v[:, :, s : s + n].repeat_interleave(2, 1),
            is_causal=True, scale=0.3)
        torch.testing.assert_close(out[0, s : s + n], ref[0].transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_lr_schedule_golden_numbers():
    c = LearnerConfig(lr=1.0, warmup_steps=4)
    assert [lr_at(c, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    lin = LearnerConfig(lr=2.0, schedule="linear", total_steps=4, min_lr_ratio=0.5)
    assert [lr_at(lin, s) for s in range(6)] == [2.0, 1.75, 1.5, 1.25, 1.0, 1.0]
    cos = LearnerConfig(lr=1.0, schedule="cosine", warmup_steps=1, total_steps=5)
    got = [lr_at(cos, s) for s in range(7)]
    assert got == pytest.approx([1.0, 1.0, (1 + np.cos(np.pi / 4)) / 2, 0.5, (1 - np.cos(np.pi / 4)) / 2, 0.0, 0.0])


@pytest.mark.parametrize("bad", [
    dict(lr=0.0), dict(lr=float("nan")), dict(betas=(0.9, 1.0)), dict(eps=0.0), dict(grad_clip=-1.0),
    dict(schedule="cosine"), dict(schedule="step"), dict(schedule="linear", warmup_steps=5, total_steps=5),
    dict(min_lr_ratio=1.5), dict(micro_batch_tokens=0), dict(dtype="float16"), dict(device="tpu"),
    dict(threads=-1),
])
def test_learner_config_rejects_out_of_bounds(bad):
    with pytest.raises(ValueError):
        LearnerConfig(**bad)
