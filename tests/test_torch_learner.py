"""The torch learner on tiny real models (Qwen2 from stoa.models.tiny; Qwen3 and Llama saved by
transformers): packing, temperature, loss masking, DPPO direction, checkpoints, export, MLX parity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stoa.algos import OBJECTIVES, ObjectiveInputs, resolve_objective
from stoa.backends.learner import Learner, LearnerConfig, LearnerError, make_learner
from stoa.models.tiny import TinyConfig, build_tiny
from helpers import random_episodes
from stoa.types import Episode, Segment

TINY = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
TEXTS = [f"protein P{i} binds receptor R{i % 7} in cell line C{i % 5}; <search> P{i} </search>" for i in range(200)]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("qwen2"), TEXTS, TinyConfig(**TINY))


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("untied"), TEXTS, TinyConfig(**TINY, tie_word_embeddings=False, seed=1))


def _hf_family_dir(root: Path, family: str) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    cfg = Qwen3Config(**common) if family == "qwen3" else LlamaConfig(**common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    return root


def learner(path: Path, **kw) -> Learner:
    return make_learner("torch", path, LearnerConfig(**{"lr": 1e-3, "micro_batch_tokens": 96, **kw}))


def direct_logprobs(model: torch.nn.Module, ep: Episode, temperature: float) -> np.ndarray:
    """Reference: one unpacked forward of the HF model, float64 log-softmax."""
    ids = torch.from_numpy(ep.tokens().astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / temperature
    lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    return np.concatenate([[0.0], lp.numpy()])


# -- log-probs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_packed_logprobs_equal_unpacked(family, qwen2_dir, tmp_path):
    path = qwen2_dir if family == "qwen2" else _hf_family_dir(tmp_path, family)
    packed, padded = learner(path), learner(path, packing=False)
    eps = random_episodes(24, packed.vocab_size, seed=1)
    a, b = packed.logprobs(eps), padded.logprobs(eps)
    assert [len(x) for x in a] == [len(e) for e in eps]
    for ep, x, y in zip(eps, a, b):
        ref = direct_logprobs(packed.model, ep, 1.0)
        assert x.dtype == np.float32 and x[0] == 0.0 and np.all(x <= 0)
        np.testing.assert_allclose(x, ref, rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=2e-5)


def test_packing_puts_several_episodes_in_a_row(qwen2_dir):
    from stoa.backends.packing import build_micro_batches

    eps = random_episodes(24, 300, seed=1)
    mbs = build_micro_batches([e.tokens() for e in eps], 96, packing=True)
    assert len(mbs) < len(eps) and all(m.attention_mask is None for m in mbs)
    assert sorted(p[0] for m in mbs for p in m.placements) == list(range(len(eps)))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_logprobs_at_temperature_match_direct(temperature, qwen2_dir):
    ln = learner(qwen2_dir)
    eps = random_episodes(6, ln.vocab_size, seed=2)
    for ep, x in zip(eps, ln.logprobs(eps, temperature=temperature)):
        np.testing.assert_allclose(x, direct_logprobs(ln.model, ep, temperature), rtol=1e-5, atol=2e-5)
    # None: each episode at its own sampling temperature.
    for ep, x in zip(eps, ln.logprobs(eps, temperature=None)):
        np.testing.assert_allclose(x, direct_logprobs(ln.model, ep, ep.temperature), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("packing", [True, False])
def test_model_only_logprobs_are_the_full_ones_at_model_tokens_and_zero_elsewhere(packing, qwen2_dir):
    ln = learner(qwen2_dir, packing=packing)
    eps = random_episodes(7, ln.vocab_size, seed=4)
    for ep, full, only in zip(eps, ln.logprobs(eps, None), ln.logprobs(eps, None, model_only=True)):
        mask = ep.loss_mask() & (np.arange(len(ep)) > 0)
        assert only.shape == full.shape and only.dtype == np.float32
        np.testing.assert_allclose(only[mask], full[mask], rtol=1e-6, atol=1e-6)
        assert not only[~mask].any()


def test_chunked_log_softmax_matches_unchunked(qwen2_dir):
    whole, chunked = learner(qwen2_dir), learner(qwen2_dir, logits_chunk_elements=3 * 400)
    eps = random_episodes(8, whole.vocab_size, seed=3)
    for x, y in zip(whole.logprobs(eps), chunked.logprobs(eps)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    adv = np.linspace(-1, 1, len(eps))
    _, g1 = whole.gradients(eps, adv)
    _, g2 = chunked.gradients(eps, adv)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-5, atol=1e-7)


def test_gradient_checkpointing_gives_the_same_gradient(qwen2_dir):
    plain, ckpt = learner(qwen2_dir), learner(qwen2_dir, gradient_checkpointing=True)
    eps = random_episodes(8, plain.vocab_size, seed=3)
    adv = np.linspace(-1, 1, len(eps))
    (m1, g1), (m2, g2) = plain.gradients(eps, adv), ckpt.gradients(eps, adv)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-5, atol=1e-8)


# -- gradients ---------------------------------------------------------------------------------


def test_only_model_tokens_reach_the_lm_head_in_training(qwen2_dir):
    ln = learner(qwen2_dir)
    eps = random_episodes(10, ln.vocab_size, seed=4)
    rows = []
    hook = ln.model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(o.shape[0]))
    ln.train_step(eps, np.ones(len(eps)))
    hook.remove()
    assert sum(rows) == sum(e.num_model_tokens for e in eps) < sum(len(e) for e in eps)


def test_gradient_matches_a_masked_reference_and_ignores_env_tokens(qwen2_dir):
    """Learner gradient == autograd of DPPO over an unpacked forward with the loss mask; a
    reference that also counts env tokens differs (the comparison is sensitive)."""
    from stoa.algos import dppo

    ln = learner(qwen2_dir)
    eps = random_episodes(8, ln.vocab_size, seed=5)
    adv = np.array([1.0, -0.5, 0.3, -1.2, 0.8, 0.0, -0.2, 0.6])
    _, grads = ln.gradients(eps, adv)

    def reference(mask_of) -> dict[str, torch.Tensor]:
        ln.model.zero_grad(set_to_none=True)
        width = max(len(e) for e in eps)
        lp = torch.zeros(len(eps), width)
        blp, advs, mask = (torch.zeros(len(eps), width) for _ in range(3))
        for i, e in enumerate(eps):
            ids = torch.from_numpy(e.tokens().astype(np.int64))[None]
            logits = ln.model(input_ids=ids).logits[0] / e.temperature
            tok = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            lp[i, 1 : len(e)] = tok
            m = torch.from_numpy(mask_of(e).astype(np.float32))
            mask[i, : len(e)] = m
            blp[i, : len(e)] = torch.from_numpy(e.behavior_logprobs())
            advs[i, : len(e)] = float(adv[i]) * m
        dppo.loss(ObjectiveInputs(lp, blp, advs, mask), dppo.Config())[0].backward()
        return {n: p.grad.clone() for n, p in ln.model.named_parameters()}

    ref = reference(lambda e: e.loss_mask())
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], rtol=1e-4, atol=1e-7)
    leaky = reference(lambda e: np.arange(len(e)) > 0)
    assert not torch.allclose(leaky["model.embed_tokens.weight"], grads["model.embed_tokens.weight"], rtol=1e-3)


def test_trailing_env_tokens_change_nothing(qwen2_dir):
    """Env tokens after the last model token: no loss term and no later context, so a step with
    them replaced by other tokens gives bit-identical metrics and weights."""
    vocab = learner(qwen2_dir).vocab_size
    base = random_episodes(6, vocab, seed=6, temperature=1.0)
    rng = np.random.default_rng(0)

    def with_tail(tail_seed: int) -> list[Episode]:
        r = np.random.default_rng(tail_seed)
        return [Episode(e.prompt_tokens, [*e.segments, Segment("env", r.integers(0, vocab, 5))], e.reward,
                        temperature=e.temperature) for e in base]

    adv = rng.standard_normal(len(base))
    results = []
    for tail in (1, 2):
        ln = learner(qwen2_dir, packing=False, micro_batch_tokens=1)
        m = ln.train_step(with_tail(tail), adv)
        results.append((m, ln.export_weights()))
    (m1, w1), (m2, w2) = results
    for k in m1:
        if k not in ("seconds", "tokens_per_s"):
            assert m1[k] == m2[k], k
    assert all(np.array_equal(w1[n], w2[n]) for n in w1)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batching_does_not_change_the_gradient(aggregation, qwen2_dir):
    objective = resolve_objective("dppo", {"aggregation": aggregation})
    eps = random_episodes(12, 300, seed=7)
    adv = np.random.default_rng(1).standard_normal(len(eps))
    one = learner(qwen2_dir, micro_batch_tokens=10_000)
    many = learner(qwen2_dir, micro_batch_tokens=40)
    padded = learner(qwen2_dir, micro_batch_tokens=40, packing=False)
    m1, g1 = one.gradients(eps, adv, objective)
    for other in (many, padded):
        m2, g2 = other.gradients(eps, adv, objective)
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-8)
        assert m2["gate/masked_frac"] == m1["gate/masked_frac"]
        for n in g1:
            torch.testing.assert_close(g2[n], g1[n], rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_scaling_kept_advantages_by_their_share_is_the_whole_batch_mean(name, aggregation, qwen2_dir):
    """What the trainer's ``average_over = "step"`` relies on: leaving zero-advantage episodes out
    and scaling the rest's advantages by :func:`signal_share` gives the loss and gradient of the
    whole batch, for every built-in objective and aggregation."""
    from stoa.algos.advantages import signal_share

    objective = resolve_objective(name, {"aggregation": aggregation})
    eps = random_episodes(16, 300, seed=11)
    adv = np.random.default_rng(2).standard_normal(len(eps))
    keep = np.arange(len(eps)) // 4 != 1  # the second group (4 samples) carries no signal, as a whole
    adv[~keep] = 0.0
    share = signal_share([e.num_model_tokens for e in eps], keep, aggregation)
    assert 0.3 < share < 1.0
    one = learner(qwen2_dir, micro_batch_tokens=10_000)
    m_all, g_all = one.gradients(eps, adv, objective)
    kept = [e for e, k in zip(eps, keep) if k]
    m_kept, g_kept = one.gradients(kept, adv[keep] * share, objective)
    m_raw, g_raw = one.gradients(kept, adv[keep], objective)
    assert m_kept["loss"] == pytest.approx(m_all["loss"], rel=1e-5, abs=1e-8)
    for n in g_all:
        torch.testing.assert_close(g_kept[n], g_all[n], rtol=1e-4, atol=1e-8)
    assert m_raw["loss"] != pytest.approx(m_all["loss"], rel=1e-3)  # unscaled: the kept-only mean


def test_signal_share_counts_tokens_or_sequences():
    from stoa.algos.advantages import signal_share

    assert signal_share([3, 1, 0, 4], [True, False, True, False]) == pytest.approx(3 / 8)
    assert signal_share([3, 1, 0, 4], [True, False, True, False], "seq_mean_token_mean") == pytest.approx(1 / 3)
    assert signal_share([0, 0], [False, False]) == 1.0
    with pytest.raises(ValueError, match="same shape"):
        signal_share([1, 2], [True])


def test_dppo_step_moves_log_probs_with_the_advantage(qwen2_dir):
    """On-policy batch (behaviour = current log-probs): after steps, positive-advantage episodes
    became likelier and negative ones less likely; the importance-sampled objective rose."""
    ln = learner(qwen2_dir, lr=3e-3)
    eps = random_episodes(16, ln.vocab_size, seed=8, temperature=1.0)
    before = ln.logprobs(eps)
    for e, lp in zip(eps, before):  # make the batch on-policy: behaviour log-probs = current ones
        k = len(e.prompt_tokens)
        for s in e.segments:
            if s.kind == "model":
                s.logprobs = lp[k : k + len(s.tokens)].copy()
            k += len(s.tokens)
    adv = np.where(np.arange(len(eps)) % 2 == 0, 1.0, -1.0)
    metrics = [ln.train_step(eps, adv) for _ in range(3)]
    after = ln.logprobs(eps)
    delta = np.array([((a - b) * e.loss_mask()).sum() / e.num_model_tokens for e, a, b in zip(eps, after, before)])
    assert delta[adv > 0].mean() > 0 > delta[adv < 0].mean()
    surrogate = [np.mean([adv[i] * np.exp(after[i] - before[i])[e.loss_mask()].mean() for i, e in enumerate(eps)]),
                 np.mean(adv)]
    assert surrogate[0] > surrogate[1]
    assert metrics[0]["gate/masked_frac"] == 0.0 and metrics[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert ln.step == 3 and ln.version == 3


# Options that change each objective's loss on the batch below (its gate, clip or aggregation acts;
# TIS's cap would not: a random tiny model's ratios pi/mu are mostly below 1).
ACTIVE = {
    "dppo": {"gate": "kl", "delta_high": 0.01, "delta_low": 0.01},
    "ppo": {"clip_low": 0.05, "clip_high": 0.05},
    "tis": {"cap": 1.0, "aggregation": "seq_mean_token_sum_norm", "max_tokens_norm": 8.0},
    "icepop": {"ratio_low": 0.9, "ratio_high": 1.1},
    "reinforce": {"aggregation": "seq_mean_token_mean"},
    "gepo": {"clip_low": 0.05, "clip_high": 0.05, "aggregation": "seq_mean_token_mean"},
}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_train_step_runs_each_builtin_objective_with_its_config(name, qwen2_dir):
    """The step's loss and metrics are the resolved objective's, over the log-probs the step
    started from; the same objective with default options would have reported otherwise."""
    ln = learner(qwen2_dir, micro_batch_tokens=40)
    eps = random_episodes(8, ln.vocab_size, seed=17)
    adv = np.random.default_rng(4).standard_normal(len(eps)).astype(np.float32)
    objective = resolve_objective(name, ACTIVE[name])
    width = max(len(e) for e in eps)
    lp, blp, advs, mask = (torch.zeros(len(eps), width) for _ in range(4))
    for i, (e, x) in enumerate(zip(eps, ln.logprobs(eps, temperature=None))):
        mask[i, : len(e)] = torch.from_numpy(e.loss_mask().astype(np.float32))
        lp[i, : len(e)] = torch.from_numpy(x)
        blp[i, : len(e)] = torch.from_numpy(e.behavior_logprobs())
        advs[i] = float(adv[i]) * mask[i]
    groups: dict[str, int] = {}  # the learner numbers Episode.group_id in order of appearance
    index = torch.tensor([groups.setdefault(e.group_id, len(groups)) for e in eps])
    inputs = ObjectiveInputs(lp, blp, advs, mask, group_index=index)
    ref_loss, ref = objective.loss(inputs)
    default_loss, _ = resolve_objective(name).loss(inputs)
    got = ln.train_step(eps, adv, objective)
    assert got["loss"] == pytest.approx(float(ref_loss), rel=1e-4, abs=1e-6)
    assert abs(float(default_loss) - float(ref_loss)) > 1e-3  # the options mattered
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    assert got["micro_batches"] > 1 and ln.step == 1 and np.isfinite(got["grad_norm"])


def test_sft_step_lowers_the_loss(qwen2_dir):
    ln = learner(qwen2_dir, lr=3e-3)
    eps = random_episodes(8, ln.vocab_size, seed=9, temperature=1.0)
    lp = ln.logprobs(eps)
    expected = -sum(float(x[e.loss_mask()].sum()) for e, x in zip(eps, lp)) / sum(e.num_model_tokens for e in eps)
    losses = [ln.sft_step(eps)["loss"] for _ in range(4)]
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0]


# -- schedule, validation ----------------------------------------------------------------------


def test_lr_schedule_is_applied(qwen2_dir):
    ln = learner(qwen2_dir, lr=1e-3, schedule="linear", warmup_steps=2, total_steps=6)
    eps = random_episodes(4, ln.vocab_size, seed=10)
    lrs = [ln.sft_step(eps)["lr"] for _ in range(7)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])
    ln.reset_optimizer(LearnerConfig(lr=2e-4, micro_batch_tokens=96))
    assert ln.step == 0 and ln.version == 7 and ln.sft_step(eps)["lr"] == 2e-4
    moments = {k: v["exp_avg"].clone() for k, v in enumerate(ln._optimizer.state.values())}
    ln.reset_optimizer(LearnerConfig(lr=5e-5, micro_batch_tokens=96), keep_state=True)  # a new rate only
    assert ln.step == 1 and all(torch.equal(moments[k], v["exp_avg"]) for k, v in enumerate(ln._optimizer.state.values()))
    assert ln.sft_step(eps)["lr"] == 5e-5 and ln.step == 2


def test_bad_batches_raise_clear_errors(qwen2_dir):
    ln = learner(qwen2_dir)
    assert isinstance(ln, Learner)  # the runtime-checkable protocol
    eps = random_episodes(3, ln.vocab_size, seed=11)
    with pytest.raises(LearnerError, match="empty batch"):
        ln.train_step([], np.zeros(0))
    with pytest.raises(LearnerError, match="advantages"):
        ln.train_step(eps, np.zeros(2))
    with pytest.raises(LearnerError, match="advantages"):
        ln.train_step(eps, np.array([0.0, np.nan, 1.0]))
    with pytest.raises(LearnerError, match="advantages"):
        ln.train_step(eps, np.array([True, False, True]))
    with pytest.raises(LearnerError, match=r"got the bare name 'ppo'; resolve it first"):
        ln.train_step(eps, np.zeros(3), objective="ppo")  # type: ignore[arg-type]
    from stoa.algos import ppo

    with pytest.raises(LearnerError, match=r"got a bare stoa.algos.ppo.Config; pair it with"):
        ln.train_step(eps, np.zeros(3), objective=ppo.Config())  # type: ignore[arg-type]
    bad = Episode(np.array([1, ln.vocab_size]), [Segment("model", np.array([2]), np.array([-1.0]))], 0.0)
    with pytest.raises(LearnerError, match="outside"):
        ln.logprobs([bad])
    with pytest.raises(LearnerError, match="unknown learner kind"):
        make_learner("jax", qwen2_dir)  # type: ignore[arg-type]
    assert ln.step == 0


# -- weights and checkpoints -------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_export_weights_match_the_hf_folder(which, qwen2_dir, untied_dir):
    import ml_dtypes
    from safetensors.numpy import load_file

    path = qwen2_dir if which == "tied" else untied_dir
    ln = learner(path)
    disk = load_file(str(path / "model.safetensors"))
    w = ln.export_weights()
    assert set(w) == set(disk) and ("lm_head.weight" in w) == (which == "untied")
    for n in disk:
        assert w[n].dtype == np.float32 and w[n].shape == disk[n].shape
        np.testing.assert_array_equal(w[n], disk[n])
    b = ln.export_weights("bfloat16")
    assert all(v.dtype == ml_dtypes.bfloat16 and v.shape == disk[n].shape for n, v in b.items())
    np.testing.assert_allclose(b["model.norm.weight"].astype(np.float32), disk["model.norm.weight"])
    emb = b["model.embed_tokens.weight"].astype(np.float32)
    ref = disk["model.embed_tokens.weight"]
    assert np.abs(emb - ref).max() <= np.abs(ref).max() / 256  # bf16 keeps 8 significant bits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_export_quantizes_to_the_same_state_bit_for_bit(dtype, untied_dir):
    """Publishing one tensor at a time (``iter_weights`` into ``quantize_state``) gives the state the
    whole-dict path gave, with and without a previous state (the ``keep`` requantization)."""
    import ml_dtypes

    from stoa.transport.quant import quantize_state

    ln = learner(untied_dir)

    def whole() -> dict[str, np.ndarray]:  # the whole-dict export, written out independently
        seen, out = set(), {}
        for k, v in ln.model.state_dict().items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                out[k] = (v.detach().float().numpy().copy() if dtype == "float32" else
                          v.detach().to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy())
        return out

    first = quantize_state(whole())
    it = ln.iter_weights(dtype)
    name, arr = next(it)  # one host tensor at a time, in the folder's order
    assert name == next(iter(first)) and isinstance(arr, np.ndarray)
    streamed = quantize_state(ln.iter_weights(dtype))
    ln.train_step(random_episodes(8, 300, seed=3), np.random.default_rng(0).standard_normal(8))
    again, streamed_again = quantize_state(whole(), previous=first), quantize_state(ln.iter_weights(dtype), previous=streamed)
    for a, b in ((first, streamed), (again, streamed_again)):
        assert list(a) == list(b)
        assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)) for k in a)
    assert any(not np.array_equal(first[k], again[k]) for k in first)  # the step moved some codes
    assert {k: v.tobytes() for k, v in ln.export_weights(dtype).items()} == {k: v.tobytes() for k, v in whole().items()}


def test_checkpoint_resumes_bit_exactly(qwen2_dir, tmp_path):
    eps_a, eps_b = random_episodes(8, 300, seed=12), random_episodes(8, 300, seed=13)
    adv = np.random.default_rng(2).standard_normal(8)
    cfg = dict(lr=2e-3, schedule="cosine", warmup_steps=1, total_steps=10, weight_decay=0.1)

    straight = learner(qwen2_dir, **cfg)
    straight.train_step(eps_a, adv)
    straight.sft_step(eps_a)
    extra = {"consumed": ["batch-0001", "batch-0002"], "policy_version": 2}
    straight.save_checkpoint(tmp_path / "ckpt", extra=extra)
    expected = straight.train_step(eps_b, adv)

    resumed = learner(qwen2_dir, **cfg)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == extra
    assert (resumed.step, resumed.version) == (2, 2)
    got = resumed.train_step(eps_b, adv)
    for k in expected:
        if k not in ("seconds", "tokens_per_s"):
            assert got[k] == expected[k], k
    w1, w2 = straight.export_weights(), resumed.export_weights()
    assert all(np.array_equal(w1[n], w2[n]) for n in w1)
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["extra"] == extra and meta["step"] == 2
    assert not list(tmp_path.glob(".ckpt.tmp-*"))  # no temp dir left behind
    with pytest.raises(LearnerError, match="exists"):
        straight.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(LearnerError, match="JSON"):
        straight.save_checkpoint(tmp_path / "ckpt2", extra={"x": object()})
    assert not (tmp_path / "ckpt2").exists()


def test_checkpoint_of_another_model_is_refused(qwen2_dir, untied_dir, tmp_path):
    learner(untied_dir).save_checkpoint(tmp_path / "c")
    with pytest.raises(LearnerError, match="another model"):
        learner(qwen2_dir).load_checkpoint(tmp_path / "c")
    meta = tmp_path / "c" / "meta.json"
    good = meta.read_text()
    meta.write_text(good[: len(good) // 2])  # torn
    with pytest.raises(LearnerError, match="not JSON"):
        learner(untied_dir).load_checkpoint(tmp_path / "c")
    meta.write_text(json.dumps({**json.loads(good), "format": "stoa.megatron_learner.v1"}))
    with pytest.raises(LearnerError, match="is not a stoa.torch_learner.v1 checkpoint"):
        learner(untied_dir).load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "rng.safetensors").unlink()
    with pytest.raises(LearnerError, match="complete"):
        learner(untied_dir).load_checkpoint(tmp_path / "c")


# -- precision and devices ---------------------------------------------------------------------


def test_bf16_autocast_path_on_cpu_runs_close_to_fp32(qwen2_dir):
    """The CUDA compute dtype, exercised on CPU at a tiny size (bf16 is slow on this CPU)."""
    fp32, bf16 = learner(qwen2_dir), learner(qwen2_dir, dtype="bfloat16")
    eps = random_episodes(3, fp32.vocab_size, seed=14)
    for x, y in zip(fp32.logprobs(eps), bf16.logprobs(eps)):
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, x, atol=0.1)
    m = bf16.train_step(eps, np.array([1.0, -1.0, 0.5]))
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gpu_bf16_train_step_matches_cpu_direction(qwen2_dir):
    gpu, cpu = learner(qwen2_dir, device="cuda"), learner(qwen2_dir, device="cpu")
    eps = random_episodes(16, cpu.vocab_size, seed=15)
    for x, y in zip(cpu.logprobs(eps), gpu.logprobs(eps)):
        np.testing.assert_allclose(y, x, atol=0.1)
    adv = np.random.default_rng(3).standard_normal(len(eps))
    _, gc = cpu.gradients(eps, adv)
    _, gg = gpu.gradients(eps, adv)
    flat = lambda g: torch.cat([v.float().cpu().flatten() for v in g.values()])  # noqa: E731
    assert torch.nn.functional.cosine_similarity(flat(gc), flat(gg), dim=0) > 0.99
    assert np.isfinite(gpu.train_step(eps, adv)["loss"])


# -- rollout-engine parity ---------------------------------------------------------------------


def test_logprobs_match_the_mlx_engine_float32_recomputation(qwen2_dir, tmp_path):
    """The rollout engine's weights (int8 state) dequantized into an HF folder: the learner and the
    engine's float32 teacher-forced scoring agree on the same episodes."""
    pytest.importorskip("mlx.core")
    import shutil

    from safetensors.numpy import save_file

    from stoa.backends.engine import make_engine
    from stoa.transport.quant import dequantize_state

    engine = make_engine(qwen2_dir, "mlx", mode="dequantized")
    weights = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in dequantize_state(engine.state).items()}
    for f in qwen2_dir.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, tmp_path / f.name)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ln = learner(tmp_path)
    eps = random_episodes(10, ln.vocab_size, seed=16)
    for x, y in zip(ln.logprobs(eps, temperature=None), engine.score(eps, temperature=None)):
        assert x.shape == y.shape and y[0] == 0.0
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=2e-5)
