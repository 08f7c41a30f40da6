"""The quantized CPU decoder's decode step in one C call (`kernels/step.c`, `stoa.backends.torch.cstep`):
on small random models of each Llama-shaped family's real structure (q|k|v biases, q/k norms,
sliding windows, grouped heads) it computes what the decoder's torch path computes, writes the
same keys and values, serves rows anywhere in the cache and pipeline parts, leaves Gemma to the
torch path, and refuses shapes it does not take before writing anything."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the kernel is the torch engine's")

from helpers import FAMILY_TEXTS, family_structure  # noqa: E402

from stoa.backends.torch import qlinear  # noqa: E402

lib = qlinear.library()
pytestmark = pytest.mark.skipif(lib is None, reason=f"kernel library unavailable: {qlinear.available()[1]}")
integer_ok = qlinear.integer_available()[0]
MODES = ["quantized", pytest.param("int24", marks=pytest.mark.skipif(not integer_ok, reason="no AVX-512 VNNI here"))]


@pytest.fixture(scope="module", params=["qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "mistral-7b-v0.1"])
def family(request, tmp_path_factory):
    from stoa.models.presets import build_preset

    return request.param, build_preset(tmp_path_factory.mktemp(request.param), family_structure(request.param),
                                       FAMILY_TEXTS, tokenizer_vocab=300, init_std=0.05)


def engine(path, mode):
    from stoa.backends.engine import EngineConfig, make_engine

    return make_engine(path, "torch", config=EngineConfig(max_batch=8), device="cpu", mode=mode)


def decode(eng, kernel: bool, rows, prompt, steps):
    """Logits of ``steps`` decode steps after a prefill of ``prompt`` into cache ``rows`` (which
    sit anywhere in a 12-row cache), and that cache's keys."""
    from stoa.backends.torch.decoder import KVCache

    dec, spec = eng.decoder, eng.decoder.spec
    keep = dec.step_kernel
    dec.step_kernel = keep if kernel else None
    served = keep.served
    try:
        n, m = prompt.shape
        cache = KVCache(spec.num_hidden_layers, 12, spec.num_key_value_heads, spec.head_dim, torch.float32,
                        torch.device("cpu"), capacity=m + steps)
        dec.forward(prompt, torch.zeros(n, dtype=torch.int64), m, cache, rows)
        out = []
        g = torch.Generator().manual_seed(7)
        for t in range(steps):
            ids = torch.randint(0, spec.vocab_size, (n, 1), generator=g)
            h = dec.forward(ids, torch.full((n,), m + t), m + t + 1, cache, rows)
            out.append(dec.logits(h[:, 0]))
        assert keep.served - served == (steps if kernel else 0)  # a refused step falls back to torch unseen
        return torch.stack(out), torch.stack(cache.k), torch.stack(cache.v)
    finally:
        dec.step_kernel = keep


@pytest.mark.parametrize("mode", MODES)
def test_it_computes_what_the_torch_path_computes(family, mode):
    name, path = family
    eng = engine(path, mode)
    assert eng.decoder.step_kernel is not None
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, eng.decoder.spec.vocab_size, (5, 21), generator=g)
    rows = torch.tensor([9, 2, 11, 0, 5])  # past the 16-token window after a few steps
    (za, ka, va), (zb, kb, vb) = (decode(eng, k, rows, prompt, 6) for k in (True, False))
    scale = zb.abs().max().item()
    tol = 2e-5 if mode == "quantized" else 2e-4  # float32 sums in another order; int24: rounding grid steps
    print(f"{name} {mode}: max |dlogit| {(za - zb).abs().max().item():.2e} of {scale:.2f}")
    assert (za - zb).abs().max().item() < tol * scale
    assert (ka - kb).abs().max().item() < tol * kb.abs().max().item()
    assert (va - vb).abs().max().item() < tol * vb.abs().max().item()
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[rows] = False
    assert not ka[:, untouched].any() and not va[:, untouched].any()  # only the batch's own rows are written


def test_pipeline_parts_run_it_and_chain_to_the_whole(family):
    from stoa.backends.torch.decoder import Decoder, KVCache

    name, path = family
    from transformers import AutoConfig

    whole = engine(path, "quantized")
    spec = whole.decoder.spec
    hf = AutoConfig.from_pretrained(path)
    kw = dict(attention_bias=bool(getattr(hf, "attention_bias", False)), mlp_bias=bool(getattr(hf, "mlp_bias", False)),
              quantized=True)
    n_layers = spec.num_hidden_layers
    parts = [Decoder(spec, hf, torch.device("cpu"), part=(a, b), **kw) for a, b in ((0, 1), (1, n_layers))]
    for p in parts:
        p.bind(whole.state)
        for k, t in p.views.items():
            if not t.is_meta:
                t.copy_(whole.decoder.views[k])
        assert p.step_kernel is not None
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, spec.vocab_size, (3, 9), generator=g)
    caches = [KVCache(p.part[1] - p.part[0], 3, spec.num_key_value_heads, spec.head_dim, torch.float32,
                      torch.device("cpu"), capacity=16) for p in parts]
    whole_cache = KVCache(n_layers, 3, spec.num_key_value_heads, spec.head_dim, torch.float32, torch.device("cpu"),
                          capacity=16)
    start = torch.zeros(3, dtype=torch.int64)
    whole.decoder.forward(ids, start, 9, whole_cache)
    x = ids
    for p, c in zip(parts, caches):
        x = p.forward(x, start, 9, c)
    step = torch.randint(0, spec.vocab_size, (3, 1), generator=g)
    want = whole.decoder.forward(step, torch.full((3,), 9), 10, whole_cache)
    x = step
    for p, c in zip(parts, caches):
        x = p.forward(x, torch.full((3,), 9), 10, c)
    assert torch.equal(x, want)  # the same C arithmetic, split at a layer boundary
    assert whole.decoder.step_kernel.served == 1 and all(p.step_kernel.served == 1 for p in parts)


def test_gemma_and_unquantized_decoders_keep_the_torch_path(tmp_path):
    from stoa.models.presets import build_preset

    path = build_preset(tmp_path, family_structure("gemma-2-2b"), FAMILY_TEXTS, tokenizer_vocab=300, init_std=0.05)
    assert engine(path, "quantized").decoder.step_kernel is None


def test_a_decoder_that_opts_out_binds_without_it(family):
    _, path = family
    eng = engine(path, "quantized")
    eng.decoder.use_step_kernel = False
    eng.decoder.bind(eng.state)
    assert eng.decoder.step_kernel is None
    assert engine(path, "dequantized").decoder.step_kernel is None  # float32 weights: no int8 projections


def test_shapes_it_does_not_take_are_refused_before_anything_is_written(family):
    from stoa.backends.torch import cstep
    from stoa.backends.torch.decoder import KVCache

    _, path = family
    eng = engine(path, "quantized")
    dec, spec = eng.decoder, eng.decoder.spec
    step = dec.step_kernel
    cache = KVCache(spec.num_hidden_layers, 2, spec.num_key_value_heads, spec.head_dim, torch.float32,
                    torch.device("cpu"), capacity=8)
    dec._tables(8)
    x = torch.randn(2, 1, spec.hidden_size)
    rows = torch.tensor([0, 1])
    assert step(x, rows, torch.tensor([3, 256]), cache, dec._cos, dec._sin) is None  # past the cache
    assert step(x, torch.tensor([0, -1]), torch.tensor([3, 4]), cache, dec._cos, dec._sin) is None  # a bad row
    assert step(x, torch.tensor([0, 2]), torch.tensor([3, 4]), cache, dec._cos, dec._sin) is None  # a row past it
    assert not any(t.any() for t in cache.k + cache.v)
    bad = (cstep._Layer * step._n)()
    ctypes.memmove(bad, step._layers, ctypes.sizeof(bad))
    bad[0].o.N += 64  # a matrix whose shape does not chain
    out = x.reshape(2, -1).clone()
    kc = (ctypes.c_void_p * step._n)(*[t.data_ptr() for t in cache.k])
    vc = (ctypes.c_void_p * step._n)(*[t.data_ptr() for t in cache.v])
    tab = lambda ts: (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])  # noqa: E731
    h, nq, nkv, d = step._dims
    rc = lib.stoa_decode_layers(bad, step._n, out.data_ptr(), 2, rows.data_ptr(), torch.tensor([1, 2]).data_ptr(),
                                h, nq, nkv, d, 256, kc, vc, tab(dec._cos), tab(dec._sin), 256, 1e-6, 0.125, 0, 1)
    assert rc == -1 and torch.equal(out, x.reshape(2, -1)) and not any(t.any() for t in cache.k + cache.v)
    assert np.isfinite(step(x, rows, torch.tensor([3, 4]), cache, dec._cos, dec._sin).numpy()).all()
