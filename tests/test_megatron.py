"""The Megatron-core learner on tiny real models, against transformers and the torch learner.

megatron-core's GPTModel runs on this CPU-only machine only with two shims (FACTS.md): a
``torch.cuda.current_device`` that answers "cpu" and megatron's inference RNG tracker. They live
in the module fixture below, applied on a gloo world of one and undone afterwards; the library
never patches megatron. The real (CUDA) path is tested in ``tests/test_megatron_cuda.py``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from stoa.algos import resolve_objective
from stoa.backends.learner import Learner, LearnerConfig, LearnerError, make_learner
from stoa.models.tiny import TinyConfig, build_tiny
from helpers import random_episodes
from stoa.types import Episode, Segment

TINY = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
TEXTS = [f"protein P{i} binds receptor R{i % 7} in cell line C{i % 5}; <search> P{i} </search>" for i in range(200)]
CFG = dict(lr=1e-3, micro_batch_tokens=96)
_REAL_CURRENT_DEVICE = torch.cuda.current_device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_cpu():
    """A gloo world of one on a free loopback port, megatron's parallel state and the two CPU shims."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    assert not dist.is_initialized()
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    mp.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)  # restored by mp.undo()
    mp.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        mp.undo()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("qwen2"), TEXTS, TinyConfig(**TINY))


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("untied"), TEXTS, TinyConfig(**TINY, tie_word_embeddings=False, seed=1))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, qwen2_dir) -> dict[str, Path]:
    """Qwen3 (q/k norm, head_dim != hidden/heads) and Llama folders saved by transformers itself."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    out = {"qwen2": qwen2_dir}
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=5e5)
    for name, cfg in (("qwen3", Qwen3Config(**common, head_dim=32)), ("llama", LlamaConfig(**common, head_dim=16))):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # non-trivial norms so a mapping mistake in them shows
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(0.2 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = path
    return out


def megatron(path: Path, **kw) -> Learner:
    opts = {k: kw.pop(k) for k in ("attention", "tensor_parallel") if k in kw}
    return make_learner("megatron", path, LearnerConfig(**{**CFG, **kw}), **opts)


def torch_learner(path: Path, **kw) -> Learner:
    return make_learner("torch", path, LearnerConfig(**{**CFG, **kw}))


def hf_logprobs(path: Path, ep: Episode, temperature: float) -> np.ndarray:
    """Reference: one unpacked transformers forward, float64 log-softmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.from_numpy(ep.tokens().astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / temperature
    lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    return np.concatenate([[0.0], lp.numpy()])


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a - b) / np.maximum(np.abs(b), 1e-6)).max())


# -- forward parity ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_gptmodel_log_softmax_matches_transformers(family, family_dirs, megatron_cpu):
    """Full-vocabulary log-softmax of megatron's GPTModel (local spec) vs the transformers model."""
    from transformers import AutoModelForCausalLM

    path = family_dirs[family]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, ref.config.vocab_size, (2, 24)))
    with torch.no_grad():
        want = torch.log_softmax(ref(input_ids=ids).logits.double(), -1)
    for attention in ("local", "sdpa"):
        m = megatron(path, attention=attention)
        mask = ~torch.ones(24, 24, dtype=torch.bool).tril()[None, None]  # megatron: True = masked
        with torch.no_grad():
            got = torch.log_softmax(m.model(ids, None, mask).double(), -1)
        assert float(((got - want).abs() / want.abs()).max()) < 1e-5, attention


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_packed_learner_logprobs_match_transformers(family, family_dirs, megatron_cpu):
    path = family_dirs[family]
    m = megatron(path)
    eps = random_episodes(10, m.vocab_size, seed=1)
    got = m.logprobs(eps, temperature=None)
    assert m._packed and any(len(mb.placements) > 1 for mb in m._micro_batches(
        [e.tokens() for e in eps], [1.0] * len(eps))[0])  # several episodes really share a row
    for ep, x in zip(eps[:4], got):
        assert x.dtype == np.float32 and x.shape == (len(ep),) and x[0] == 0.0 and np.all(x <= 0)
        assert rel_err(x[1:], hf_logprobs(path, ep, ep.temperature)[1:]) < 1e-5


@pytest.mark.parametrize("layout", ["packed", "padded", "local"])
def test_learner_logprobs_match_torch_learner(layout, untied_dir, megatron_cpu):
    kw = {"packed": {}, "padded": {"packing": False}, "local": {"attention": "local"}}[layout]
    m, t = megatron(untied_dir, **kw), torch_learner(untied_dir)
    eps = random_episodes(16, m.vocab_size, seed=2)
    for temperature in (1.0, None):
        for x, y in zip(m.logprobs(eps, temperature), t.logprobs(eps, temperature)):
            assert rel_err(x[1:], y[1:]) < 1e-5
    for ep, x, y in zip(eps, m.logprobs(eps, None, model_only=True), t.logprobs(eps, None, model_only=True)):
        assert rel_err(x[1:], y[1:]) < 1e-5 and not x[~ep.loss_mask()].any()


def test_logprobs_match_the_rollout_engines_mlx_float32_recomputation(qwen2_dir, megatron_cpu):
    mx = pytest.importorskip("mlx.core")
    from mlx_lm import load

    model, _ = load(str(qwen2_dir))
    m = megatron(qwen2_dir)
    eps = random_episodes(6, m.vocab_size, seed=9)
    for ep, x in zip(eps, m.logprobs(eps, temperature=None)):
        logits = model(mx.array(ep.tokens()[None]))[0].astype(mx.float32) / ep.temperature
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ref = np.array(mx.take_along_axis(lp[:-1], mx.array(ep.tokens()[1:, None]), axis=-1))[:, 0]
        np.testing.assert_allclose(x[1:], ref, rtol=1e-5, atol=2e-5)


def test_chunked_vocab_parallel_logprobs_match_log_softmax():
    from stoa.backends.megatron.ops import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g, requires_grad=True)
    targets = torch.randint(0, 45, (37,), generator=g)
    inv = torch.rand(37, generator=g) + 0.5
    w = torch.randn(37, generator=g)
    got = vocab_parallel_logprobs(logits, targets, inv, vocab_size=45, chunk_elements=200)  # 4-row chunks
    (got * w).sum().backward()
    g_got, logits.grad = logits.grad.clone(), None
    want = torch.log_softmax(logits[:, :45] * inv[:, None], -1).gather(1, targets[:, None])[:, 0]
    (want * w).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_got, logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(g_got[:, 45:], torch.zeros(37, 5))  # padded vocabulary gets no gradient


# -- training parity ---------------------------------------------------------------------------


def test_dppo_loss_and_gradient_match_torch_learner(qwen2_dir, megatron_cpu):
    m, t = megatron(qwen2_dir), torch_learner(qwen2_dir)
    eps = random_episodes(16, m.vocab_size, seed=3)
    adv = np.random.default_rng(0).standard_normal(len(eps))
    dppo = resolve_objective("dppo")
    mm, gm = m.gradients(eps, adv, dppo)
    mt, gt = t.gradients(eps, adv, dppo)
    assert abs(mm["loss"] - mt["loss"]) <= 1e-5 * abs(mt["loss"])
    assert mm["gate/masked_frac"] == mt["gate/masked_frac"] > 0  # the gate acted, identically
    assert set(gm) == set(gt)
    for name in gt:
        a, b = gm[name].flatten().double(), gt[name].flatten().double()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99999, name
        assert abs(a.norm() - b.norm()) <= 1e-4 * b.norm(), name
    # Environment tokens are never trained on: trailing ones (after the last model token) change nothing.
    longer = [Episode(e.prompt_tokens, [*e.segments, Segment("env", np.arange(1, 9))], e.reward,
                      temperature=e.temperature) for e in eps]
    _, g_long = m.gradients(longer, adv, dppo)
    for name in gm:
        torch.testing.assert_close(g_long[name], gm[name], rtol=1e-4, atol=1e-7)
    sft_m, sft_t = m.gradients(eps)[0], t.gradients(eps)[0]
    assert abs(sft_m["loss"] - sft_t["loss"]) <= 1e-5 * sft_t["loss"]


@pytest.mark.parametrize("name,options", [("ppo", {"clip_low": 0.05, "clip_high": 0.05}),
                                          ("reinforce", {"aggregation": "seq_mean_token_mean"})])
def test_other_objectives_match_torch_learner(name, options, qwen2_dir, megatron_cpu):
    """The shared objective plumbing: same Objective value, same loss, metrics and gradient."""
    m, t = megatron(qwen2_dir), torch_learner(qwen2_dir)
    eps = random_episodes(12, m.vocab_size, seed=9)
    adv = np.random.default_rng(1).standard_normal(len(eps)).astype(np.float32)
    objective = resolve_objective(name, options)
    (mm, gm), (mt, gt) = m.gradients(eps, adv, objective), t.gradients(eps, adv, objective)
    assert set(mm) == set(mt)
    for k in mt:
        assert mm[k] == pytest.approx(mt[k], rel=1e-4, abs=1e-6), k
    assert mt.get("clip/frac", 1.0) > 0  # PPO's clip acted
    for k in gt:
        a, b = gm[k].flatten().double(), gt[k].flatten().double()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99999, k


def test_train_step_matches_torch_learner_and_moves_with_the_advantage(qwen2_dir, megatron_cpu):
    m, t = megatron(qwen2_dir), torch_learner(qwen2_dir)
    eps = random_episodes(12, m.vocab_size, seed=4)
    adv = np.where(np.arange(12) % 2 == 0, 1.0, -1.0)
    before = m.logprobs(eps, temperature=None)
    rm, rt = m.train_step(eps, adv), t.train_step(eps, adv)
    for k in ("loss", "grad_norm", "lr", "tokens", "loss_tokens", "micro_batches", "pad_fraction"):
        assert abs(rm[k] - rt[k]) <= 1e-4 * max(1.0, abs(rt[k])), k
    assert (m.step, m.version) == (1, 1)
    after = m.logprobs(eps, temperature=None)
    masks = [e.loss_mask() for e in eps]
    moved = [float((a[k] - b[k]).mean()) for a, b, k in zip(after, before, masks)]
    assert all(d > 0 for d in moved[0::2]) and all(d < 0 for d in moved[1::2])
    sft0 = m.sft_step(eps)["loss"]
    assert m.sft_step(eps)["loss"] < sft0


def test_bad_inputs_raise_clear_errors(qwen2_dir, megatron_cpu):
    m = megatron(qwen2_dir)
    eps = random_episodes(2, m.vocab_size)
    with pytest.raises(LearnerError, match="empty"):
        m.logprobs([])
    with pytest.raises(LearnerError, match="advantages"):
        m.train_step(eps, np.array([1.0]))
    bad = Episode(np.array([1, m.vocab_size]), [Segment("model", np.array([2]), np.array([-1.0], np.float32))], 0.0)
    with pytest.raises(LearnerError, match="outside"):
        m.logprobs([bad])
    with pytest.raises(LearnerError, match="got the bare name 'nope'"):
        m.train_step(eps, np.zeros(2), objective="nope")  # type: ignore[arg-type]
    from stoa.algos import dppo

    with pytest.raises(LearnerError, match="got a bare stoa.algos.dppo.Config"):
        m.train_step(eps, np.zeros(2), objective=dppo.Config())  # type: ignore[arg-type]
    assert m.step == 0
    with pytest.raises(LearnerError, match="option"):
        make_learner("megatron", qwen2_dir, LearnerConfig(), tensor_paralel=2)
    with pytest.raises(LearnerError, match="tensor parallel size 3"):
        make_learner("megatron", qwen2_dir, LearnerConfig(), tensor_parallel=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_without_the_test_shims_cpu_use_fails_clearly(qwen2_dir, megatron_cpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", _REAL_CURRENT_DEVICE)
    with pytest.raises(LearnerError, match="needs a CUDA device"):
        megatron(qwen2_dir)


def test_data_parallel_dealing_and_a_rank_with_no_work(qwen2_dir, megatron_cpu):
    from stoa.backends.megatron.learner import _deal

    assert _deal([5, 3, 3, 1], 2) == [[0, 3], [1, 2]]  # largest first, to the least loaded rank
    m = megatron(qwen2_dir)
    eps = random_episodes(2, m.vocab_size, seed=8)
    m.dp, m.dp_rank = 4, 3  # as rank 3 of 4 data-parallel ranks: 2 episodes leave it nothing
    mbs, n_tok, _, n_micro = m._micro_batches([e.tokens() for e in eps], [1.0, 1.0])
    assert len(mbs) == 1 and not mbs[0].placements and n_tok == sum(map(len, eps)) and n_micro < 4
    loss_of, _ = m._sft_objective(eps)
    m._run(mbs, loss_of, train=True)  # a one-token dummy keeps the collective schedule in step
    assert all(p.grad is not None and not p.grad.any() for p in m.model.parameters())


def test_sharded_parameters_are_tagged_for_the_gradient_norm(qwen2_dir, megatron_cpu):
    """Weights loaded from HF (``perform_initialization=False``) get megatron's TP tags anyway, so a
    gradient norm under TP (ours on CPU, Megatron's optimizer's on CUDA) counts every shard."""
    m = megatron(qwen2_dir)
    params = dict(m.model.named_parameters())
    tagged = {n for n, p in params.items() if getattr(p, "tensor_model_parallel", False)}
    assert tagged == {n for n in params if "layernorm" not in n}  # every matrix and the qkv bias; norms replicated
    assert {params[n].partition_dim for n in tagged if "linear_proj" in n or "linear_fc2" in n} == {1}


# -- weights and checkpoints -------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_export_weights_equal_the_hf_folder(which, qwen2_dir, untied_dir, megatron_cpu):
    import ml_dtypes
    from safetensors.numpy import load_file

    path = qwen2_dir if which == "tied" else untied_dir
    disk = load_file(str(path / "model.safetensors"))
    m = megatron(path)
    w = m.export_weights()
    assert set(w) == set(disk)
    assert all(w[k].dtype == np.float32 and np.array_equal(w[k], disk[k]) for k in disk)
    b = m.export_weights("bfloat16")
    assert all(v.dtype == ml_dtypes.bfloat16 and v.shape == disk[k].shape for k, v in b.items())
    streamed = list(m.iter_weights("bfloat16"))  # one tensor at a time: the same arrays, in the same order
    assert [k for k, _ in streamed] == list(b) and all(np.array_equal(v.view(np.uint16), b[k].view(np.uint16))
                                                        for k, v in streamed)


def test_checkpoint_resumes_bit_exactly(qwen2_dir, untied_dir, megatron_cpu, tmp_path):
    eps_a, eps_b = random_episodes(8, 300, seed=5), random_episodes(8, 300, seed=6)
    adv = np.random.default_rng(1).standard_normal(8)
    cfg = dict(lr=2e-3, schedule="cosine", warmup_steps=1, total_steps=10, weight_decay=0.1)
    straight = megatron(qwen2_dir, **cfg)
    straight.train_step(eps_a, adv)
    straight.sft_step(eps_a)
    extra = {"consumed": ["batch-0001"], "policy_version": 2}
    straight.save_checkpoint(tmp_path / "ckpt", extra=extra)
    expected = straight.train_step(eps_b, adv)

    resumed = megatron(qwen2_dir, **cfg)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == extra
    assert (resumed.step, resumed.version) == (2, 2)
    got = resumed.train_step(eps_b, adv)
    assert all(got[k] == expected[k] for k in expected if k not in ("seconds", "tokens_per_s"))
    w1, w2 = straight.export_weights(), resumed.export_weights()
    assert all(np.array_equal(w1[k], w2[k]) for k in w1)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["meta.json", "rank00000.safetensors"] and not list(tmp_path.glob(".ckpt.tmp*"))
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["layout"]["tp"] == 1
    with pytest.raises(LearnerError, match="exists"):
        straight.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(LearnerError, match="JSON"):
        straight.save_checkpoint(tmp_path / "c2", extra={"x": object()})
    with pytest.raises(LearnerError, match="another model"):
        megatron(untied_dir).load_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "rank00000.safetensors").unlink()
    with pytest.raises(LearnerError, match="complete"):
        megatron(qwen2_dir).load_checkpoint(tmp_path / "ckpt")


# -- real tensor parallelism over gloo -----------------------------------------------------------

_TP_WORKER = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    rank, port, folder, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import numpy as np, torch, torch.distributed as dist
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # the test shim (see the module docstring)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    from safetensors.numpy import save_file
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.types import Episode, Segment
    rng = np.random.default_rng(0)
    ln = make_learner("megatron", folder, LearnerConfig(micro_batch_tokens=64), tensor_parallel=2)
    eps = [Episode(rng.integers(0, ln.vocab_size, 5), [Segment("model", rng.integers(0, ln.vocab_size, 9),
           np.full(9, -1.0, np.float32))], 0.0, temperature=0.8) for _ in range(4)]
    lps = ln.logprobs(eps, temperature=None)
    w = ln.export_weights()
    assert (w == {}) == (rank == 1)
    if rank == 0:
        save_file({**{f"lp{i}": x for i, x in enumerate(lps)}, **{f"w/{k}": v for k, v in w.items()}}, out)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()  # gloo's threads joined before exit (else, rarely: "terminate called ...")
""")


def test_tp2_over_gloo_matches_transformers_and_exports_exactly(tmp_path):
    """Two processes, tensor parallel 2 (an odd vocabulary gets padded): scores and export."""
    from safetensors.numpy import load_file

    folder = build_tiny(tmp_path / "m", TEXTS, TinyConfig(**{**TINY, "vocab_size": 399}, tie_word_embeddings=False))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    port, out = _free_port(), tmp_path / "out.safetensors"
    procs = [subprocess.Popen([sys.executable, "-c", _TP_WORKER, str(r), str(port), str(folder), str(out)],
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    got = load_file(str(out))
    disk = load_file(str(folder / "model.safetensors"))
    assert vocab % 2 == 1 and set(k[2:] for k in got if k.startswith("w/")) == set(disk)
    assert all(np.array_equal(got["w/" + k], disk[k]) for k in disk)
    rng = np.random.default_rng(0)
    for i in range(4):
        ep = Episode(rng.integers(0, vocab, 5), [Segment("model", rng.integers(0, vocab, 9),
                     np.full(9, -1.0, np.float32))], 0.0, temperature=0.8)
        assert rel_err(got[f"lp{i}"][1:], hf_logprobs(folder, ep, 0.8)[1:]) < 1e-5
