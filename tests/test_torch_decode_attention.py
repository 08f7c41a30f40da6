"""The torch engine's C decode attention (`kernels/attention.c`): one new query a row against that
row's cached keys and values computes what the torch path computes (grouped heads, sliding
windows, rows anywhere in the cache), refuses shapes it does not take, and the engine's decode
steps on it draw what the torch path draws."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the kernel is the torch engine's")

from stoa.backends.torch import qlinear  # noqa: E402

lib = qlinear.library()
pytestmark = pytest.mark.skipif(lib is None, reason=f"kernel library unavailable: {qlinear.available()[1]}")


def kernel(q, kc, vc, rows, pos, scale, window=0):
    n, nq, d = q.shape
    nkv = kc.shape[1]
    out = torch.full_like(q, float("nan"))
    rc = lib.stoa_attn_decode(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), rows.data_ptr(), pos.data_ptr(), n, nkv,
                              nq // nkv, d, kc.shape[2], scale, window, out.data_ptr(), 2)
    return rc, out


def reference(q, kc, vc, rows, pos, scale, window=0):
    """The decoder's torch path: scores of every row over the longest length, masked, softmax, values."""
    n, nq, d = q.shape
    nkv = kc.shape[1]
    longest = int(pos.max()) + 1
    keys, vals = kc[rows, :, :longest].double(), vc[rows, :, :longest].double()
    s = torch.matmul(q.double().view(n, nkv, nq // nkv, d), keys.transpose(-1, -2)) * scale
    k = torch.arange(longest)
    seen = k[None] <= pos[:, None]
    if window:
        seen &= k[None] > pos[:, None] - window
    p = torch.softmax(s.masked_fill(~seen[:, None, None], -math.inf), dim=-1)
    return torch.matmul(p, vals).view(n, nq, d)


@pytest.mark.parametrize("n,nkv,rep,d,cap,window", [(9, 3, 3, 64, 160, 0), (5, 2, 4, 128, 64, 0), (7, 1, 8, 64, 300, 20),
                                                    (3, 4, 1, 32, 40, 0), (2, 2, 2, 256, 33, 5)])
def test_it_is_the_torch_paths_attention(n, nkv, rep, d, cap, window):
    g = torch.Generator().manual_seed(n * 100 + d)
    kc = torch.randn(n + 4, nkv, cap, d, generator=g)
    vc = torch.randn(n + 4, nkv, cap, d, generator=g)
    q = torch.randn(n, nkv * rep, d, generator=g) * 3
    rows = torch.randperm(n + 4, generator=g)[:n]  # rows anywhere in the cache, in any order
    pos = torch.randint(0, cap, (n,), generator=g)
    pos[0] = 0  # a row that sees only its own position
    rc, got = kernel(q, kc, vc, rows, pos, 0.125, window)
    assert rc == 0
    want = reference(q, kc, vc, rows, pos, 0.125, window)
    assert (got.double() - want).abs().max().item() < 2e-5 * want.abs().max().item()
    assert torch.equal(got[0], vc[rows[0], :, 0].repeat_interleave(rep, 0))  # one position: its value, exactly


def test_shapes_it_does_not_take_are_refused():
    kc = torch.zeros(2, 1, 8, 64)
    q = torch.zeros(1, 1, 64)
    rows, pos = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    assert kernel(q, kc, kc, rows, pos, 1.0)[0] == 0
    assert kernel(q, kc, kc, rows, torch.tensor([8]), 1.0)[0] == -1  # a position past the cache
    odd = torch.zeros(2, 1, 8, 12)
    assert kernel(torch.zeros(1, 1, 12), odd, odd, rows, pos, 1.0)[0] == -1  # a head width of no whole vector


def test_the_engines_decode_steps_draw_what_the_torch_path_draws(tmp_path):
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine
    from stoa.envs import make as make_env
    from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts
    from stoa.models.tiny import TinyConfig, build_tiny

    corpus = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
    tiny = build_tiny(tmp_path, list(tokenizer_texts(generate(corpus))),
                      TinyConfig(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=256, seed=0))
    s = SamplingConfig(max_turn_tokens=12, max_episode_tokens=400, seed=3)
    env = lambda: make_env("stoa/SyntheticSearch-v0", config=corpus)  # noqa: E731
    reqs = [RolloutRequest(i, f"g{i}", 3) for i in range(5)]
    fast = make_engine(tiny, "torch", config=EngineConfig(max_batch=8), device="cpu")
    plain = make_engine(tiny, "torch", state=fast.state, config=EngineConfig(max_batch=8), device="cpu")
    for eng in (fast, plain):  # a bound quantized decoder's C decode step would take every decode step
        eng.decoder.use_step_kernel = False
        eng.decoder.bind(eng.state)
        assert eng.decoder.step_kernel is None
    attend, served = fast.decoder._decode_attention, []
    assert attend is not None

    def counted(*args):
        rc = attend(*args)
        served.append(rc == 0)
        return rc

    fast.decoder._decode_attention = counted
    plain.decoder._decode_attention = None  # the torch path
    a, b = fast.rollout(env, reqs, s), plain.rollout(env, reqs, s)
    assert len(served) > 20 and all(served)  # fast's decode steps (two layers each) all took the C attention
    assert sum(np.array_equal(x.tokens(), y.tokens()) for x, y in zip(a, b)) >= len(a) - 1
    same = [(x, y) for x, y in zip(a, b) if np.array_equal(x.tokens(), y.tokens())]
    gap = max(float(np.abs(x.behavior_logprobs() - y.behavior_logprobs())[x.loss_mask()].max()) for x, y in same)
    assert gap < 1e-5
