"""One-shot GPU check of both learners (run by ``benchmarks/gpu_check.sh``; see it for setup).

Phases, each timed and recorded even if a later one fails (the JSON is rewritten after each):

1. ``env``: torch / CUDA / GPU / megatron-core / transformers versions.
2. ``functional`` (a small Qwen2): the Megatron learner's CUDA path (distributed optimizer,
   Megatron schedules, DDP gradients) against the torch learner in float32 on the GPU (log-prob
   relative error, gradient cosine), then in bf16: a train step, a checkpoint save / load and a
   bit-exact resumed step, export after the step.
3. ``parity_0.5b``: a Qwen2.5-0.5B-shaped model with random weights, built locally (nothing is
   downloaded): Megatron GPTModel vs transformers logits and log-probs, float32 and bf16.
4. ``throughput_0.5b``: training tokens/s of DPPO steps on multi-turn episodes for both learners
   in bf16, and MFU = model FLOPs / (seconds * peak bf16 FLOP/s).

Model FLOPs per episode of ``n`` tokens: ``6 * N * n + 6 * L * d_attn * n * (n + 1)`` (forward +
backward; ``N`` = parameters in matmuls, LM head included; causal attention). ``--dry-run`` runs
every phase on CPU at toy sizes (with the CPU shims the tests use) to check the script itself.

``--multirank`` (run under ``torchrun``, one process per GPU) checks the multi-rank trainer's
learner path instead: rank 0 drives the mirrored learner of :mod:`stoa.fleet.trainer.distributed` (what
``torchrun ... stoa trainer`` runs), the other ranks follow. For each layout (TP=2 and DP=2 on
two GPUs, TP=1 on one): 3 float32 DPPO steps on the small model, whose exported weights are
compared with the torch learner's after the same steps on rank 0 (``fp32_weights_max_abs_diff``),
then bf16 DPPO steps on the 0.5B-shaped model: tokens/s and MFU over all the job's GPUs.

    python benchmarks/gpu_check.py [--quick] [--dry-run] [--json out.json] [--budget-s 480]
    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_check.py --multirank [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

H200_PEAK_BF16 = 989e12  # dense bf16 tensor-core FLOP/s of an H200 SXM (NVIDIA spec sheet)

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True)
SMALL = dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True)


def write_qwen2(folder: Path, shape: dict, dtype, device, seed: int = 0) -> Path:
    """A random Qwen2 folder (config.json + model.safetensors) of the given shape."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    h, inter, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    g = torch.Generator(device=device).manual_seed(seed)

    def mat(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device=device) * 0.02 * scale).to(dtype).cpu()

    w = {"model.embed_tokens.weight": mat(shape["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(L):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
              p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
              p + "self_attn.q_proj.weight": mat(h, h), p + "self_attn.q_proj.bias": mat(h, scale=5),
              p + "self_attn.k_proj.weight": mat(kv, h), p + "self_attn.k_proj.bias": mat(kv, scale=5),
              p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.v_proj.bias": mat(kv, scale=5),
              p + "self_attn.o_proj.weight": mat(h, h, scale=(2 * L) ** -0.5),
              p + "mlp.gate_proj.weight": mat(inter, h), p + "mlp.up_proj.weight": mat(inter, h),
              p + "mlp.down_proj.weight": mat(h, inter, scale=(2 * L) ** -0.5)}
    if not shape["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(shape["vocab_size"], h)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "use_sliding_window": False,
           "attention_dropout": 0.0, "torch_dtype": str(dtype).split(".")[-1], "head_dim": hd,
           "bos_token_id": 0, "eos_token_id": 1, **shape}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def make_episodes(n: int, vocab: int, seed: int, scale: float = 1.0):
    """Multi-turn episodes: prompt, 0-3 rounds of (model search call, env documents), an answer."""
    from stoa.types import Episode, Segment

    rng = np.random.default_rng(seed)

    def k(lo, hi):
        return max(1, int(rng.integers(lo, hi) * scale))

    out = []
    for i in range(n):
        segs = []
        for _ in range(int(rng.choice([0, 1, 1, 2, 3]))):
            segs.append(Segment("model", rng.integers(0, vocab, (m := k(40, 300))), -rng.uniform(0.05, 4, m).astype(np.float32)))
            segs.append(Segment("env", rng.integers(0, vocab, k(150, 450))))
        segs.append(Segment("model", rng.integers(0, vocab, (m := k(20, 200))), -rng.uniform(0.05, 4, m).astype(np.float32)))
        out.append(Episode(rng.integers(0, vocab, k(60, 250)), segs, reward=float(rng.random()),
                           group_id=str(i // 8), sample_index=i % 8, temperature=1.0))
    return out


def model_flops(shape: dict, lengths) -> float:
    h, L, inter, v = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    n_mat = L * (2 * h * h + 2 * h * kv + 3 * h * inter) + v * h
    return float(sum(6 * n_mat * n + 6 * L * h * n * (n + 1) for n in lengths))


class Check:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.out: dict = {"dry_run": args.dry_run, "quick": args.quick, "phases": {}}

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(self.out, indent=1, default=str))

    def phase(self, name: str, fn, need_s: float) -> None:
        if self.left() < need_s:
            self.out["phases"][name] = {"status": "skipped", "reason": f"{self.left():.0f}s left < {need_s:.0f}s needed"}
            print(f"[gpu_check] {name}: skipped (time)", flush=True)
            return self.save()
        print(f"[gpu_check] {name} ...", flush=True)
        t = time.monotonic()
        rec: dict = {}
        try:
            fn(rec)
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - record and carry on to the next phase
            rec["status"] = "error"
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-3000:]
            print(rec["traceback"], flush=True)
        rec["seconds"] = round(time.monotonic() - t, 2)
        self.out["phases"][name] = rec
        print(f"[gpu_check] {name}: {rec['status']} in {rec['seconds']}s "
              f"{json.dumps({k: v for k, v in rec.items() if k not in ('traceback',)}, default=str)[:900]}", flush=True)
        _free()
        self.save()


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _dry_run_shims() -> None:
    """The CPU shims of tests/test_megatron.py (megatron-core's model code asks for a CUDA device)."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def rel(a, b) -> float:
    return float(max((np.abs(x[1:] - y[1:]) / np.maximum(np.abs(y[1:]), 1e-6)).max() for x, y in zip(a, b)))


def multirank(args) -> None:
    """The ``--multirank`` check (see the module docstring); run by every rank of a torchrun job."""
    import torch

    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.fleet.trainer.distributed import Ranks, follow

    if args.dry_run:
        _dry_run_shims()
        torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and not args.dry_run
    dev = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ranks = Ranks(300.0, cuda)
    if ranks.rank != 0:
        follow(ranks)
        return ranks.close()
    world = ranks.world
    out: dict = {"world": world, "dry_run": args.dry_run, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                 "layouts": {}}
    save = lambda: args.json and Path(args.json).write_text(json.dumps(out, indent=1, default=str))  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="stoa-gpu-multirank-"))  # every rank reads it: one node, one filesystem
    small, big = (TOY, TOY) if args.dry_run else (SMALL, QWEN25_05B)
    small_dir = write_qwen2(work / "small", small, torch.float32, dev)
    big_dir = write_qwen2(work / "big", big, torch.bfloat16, dev)
    layouts = {"tp2": world, "dp2": 1} if world >= 2 else {"tp1": 1}
    t_start = time.monotonic()
    for name, tp in layouts.items():
        rec: dict = {"tensor_parallel": tp, "data_parallel": world // tp}
        out["layouts"][name] = rec
        t = time.monotonic()
        try:
            # float32: the mirrored learner on every rank vs the torch learner on rank 0, same 3 steps.
            eps = make_episodes(16, small["vocab_size"], seed=1, scale=0.1 if args.dry_run else 0.5)
            advs = [np.random.default_rng(k).standard_normal(len(eps)) for k in range(3)]
            cfg = LearnerConfig(lr=1e-4, device=dev, dtype="float32", micro_batch_tokens=2048)
            m = ranks.make_learner("megatron", small_dir, cfg, tensor_parallel=tp, timeout_s=300.0)
            rec["fp32_losses"] = [m.train_step(eps, a)["loss"] for a in advs]
            wm = m.export_weights()
            m.close()
            ref = make_learner("torch", small_dir, cfg)
            rec["fp32_losses_torch"] = [ref.train_step(eps, a)["loss"] for a in advs]
            wt = ref.export_weights()
            del ref
            _free()
            rec["fp32_weights_max_abs_diff"] = max(float(np.abs(wm[k] - wt[k]).max()) for k in wt)
            rec["fp32_weights_max_move"] = max(float(np.abs(wt[k] - v).max()) for k, v in _load(small_dir).items())
            # bf16 throughput of the learner step on the 0.5B shape, over all the job's GPUs.
            n_eps = 8 if args.dry_run else (32 if args.quick else 64)
            eps = make_episodes(n_eps, big["vocab_size"], seed=3, scale=0.05 if args.dry_run else 1.0)
            adv = np.random.default_rng(1).standard_normal(len(eps))
            lengths = [len(e) for e in eps]
            flops = model_flops(big, lengths)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            m = ranks.make_learner("megatron", big_dir, LearnerConfig(lr=1e-6, device=dev, micro_batch_tokens=16384),
                                   tensor_parallel=tp, timeout_s=300.0)
            m.train_step(eps, adv)  # warm-up
            steps = 1 if args.dry_run else 2
            s = float(np.median([m.train_step(eps, adv)["seconds"] for _ in range(steps)]))
            m.close()
            rec |= {"tokens_per_step": int(sum(lengths)), "step_s": s, "tokens_per_s": sum(lengths) / s,
                    "achieved_tflops": flops / s / 1e12, "mfu": flops / s / (H200_PEAK_BF16 * world)}
            if cuda:
                rec["rank0_peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded; the other ranks may be stuck: end the job
            rec |= {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            save()
            raise
        rec["seconds"] = round(time.monotonic() - t, 1)
        print(f"[gpu_check multirank] {name}: {json.dumps({k: v for k, v in rec.items() if k != 'traceback'})}",
              flush=True)
        save()
    out["seconds"] = round(time.monotonic() - t_start, 1)
    save()
    ranks.send("stop")
    ranks.close()
    print(f"\nmulti-rank ({world} rank(s)): layout  fp32 max|dw| vs torch   tokens/s   step s   MFU")
    for name, rec in out["layouts"].items():
        print(f"{'':27s}{name:6s}  {rec['fp32_weights_max_abs_diff']:.2e} (moved {rec['fp32_weights_max_move']:.1e})"
              f"  {rec['tokens_per_s']:9.0f} {rec['step_s']:8.3f} {rec['mfu']:6.1%}", flush=True)


def _load(folder: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--quick", action="store_true", help="smaller batches and fewer steps")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: check the script itself")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip phases that would overrun this")
    ap.add_argument("--multirank", action="store_true", help="the multi-rank check (run under torchrun)")
    args = ap.parse_args()
    if args.multirank:
        return multirank(args)
    import torch

    from stoa.backends.learner import LearnerConfig, make_learner

    if args.dry_run:
        _dry_run_shims()
    cuda = torch.cuda.is_available() and not args.dry_run
    dev = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity must be float32
    torch.backends.cudnn.allow_tf32 = False
    check = Check(args)
    work = Path(tempfile.mkdtemp(prefix="stoa-gpu-check-"))

    def env(rec):
        import megatron.core
        import transformers

        rec |= {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "device": torch.cuda.get_device_name(0) if cuda else "cpu", "megatron_core": megatron.core.__version__,
                "transformers": transformers.__version__}
        if cuda:
            rec["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        from stoa.backends.megatron.model import has_transformer_engine

        rec["transformer_engine"] = has_transformer_engine()

    def learners(folder, dtype, **kw):
        cfg = dict(lr=1e-5, device=dev, dtype=dtype, **kw)
        return (make_learner("megatron", folder, LearnerConfig(**cfg)), make_learner("torch", folder, LearnerConfig(**cfg)))

    def functional(rec):
        shape = TOY if args.dry_run else SMALL
        folder = write_qwen2(work / "small", shape, torch.float32, dev)
        eps = make_episodes(12, shape["vocab_size"], seed=1, scale=0.1 if args.dry_run else 0.5)
        adv = np.random.default_rng(0).standard_normal(len(eps))
        m, t = learners(folder, "float32", micro_batch_tokens=4096)
        rec["fp32_logprob_rel_err"] = rel(m.logprobs(eps, None), t.logprobs(eps, None))
        (lm, gm), (lt, gt) = m.gradients(eps, adv), t.gradients(eps, adv)
        rec["fp32_loss"] = [lm["loss"], lt["loss"]]
        cos = {k: float(torch.nn.functional.cosine_similarity(gm[k].flatten().double(), gt[k].flatten().double().cpu(), dim=0))
               for k in gt}
        rec["fp32_grad_cos_min"] = min(cos.values())
        rec["fp32_grad_cos_worst"] = min(cos, key=cos.get)
        m.close()
        del m, t
        _free()
        m = make_learner("megatron", folder, LearnerConfig(lr=1e-4, device=dev, micro_batch_tokens=4096))
        rec["bf16_first_step"] = {k: v for k, v in m.train_step(eps, adv).items() if k in ("loss", "grad_norm", "tokens_per_s")}
        m.save_checkpoint(work / "ckpt", extra={"check": 1})
        expected = m.train_step(eps, adv)
        w1 = m.export_weights()
        assert m.load_checkpoint(work / "ckpt") == {"check": 1}
        got = m.train_step(eps, adv)
        w2 = m.export_weights()
        rec["resume_bit_exact"] = bool(got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
                                       and all(np.array_equal(w1[k], w2[k]) for k in w1))
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            rec["export_names_match_folder"] = set(w1) == set(f.keys())
        m.close()

    big = TOY if args.dry_run else QWEN25_05B

    def parity(rec):
        folder = write_qwen2(work / "qwen2-0.5b", big, torch.bfloat16, dev)
        rec["params"] = sum(int(np.prod(s)) for s in _shapes(big))
        eps = make_episodes(4, big["vocab_size"], seed=2, scale=0.1 if args.dry_run else 0.5)
        for dtype in ("float32", "bfloat16") if cuda else ("float32",):  # the CPU learner is float32 only
            m, t = learners(folder, dtype, micro_batch_tokens=8192)
            a, b = m.logprobs(eps, None), t.logprobs(eps, None)
            diff = np.concatenate([np.abs(x - y)[1:] for x, y in zip(a, b)])
            rec[dtype] = {"logprob_rel_err_max": rel(a, b), "logprob_abs_err_max": float(diff.max()),
                          "logprob_abs_err_mean": float(diff.mean())}
            ids = torch.from_numpy(eps[0].tokens()[:512].astype(np.int64))[None].to(dev)
            with torch.no_grad():
                lm = m.model(ids, None, None).float()[..., : big["vocab_size"]]
                bf16 = cuda and dtype == "bfloat16"  # the torch learner autocasts its float32 weights
                with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                    lt = t.model(input_ids=ids).logits.float()
            rec[dtype]["logits_abs_err_max"] = float((lm - lt).abs().max())
            rec[dtype]["logits_abs_max"] = float(lt.abs().max())
            m.close()
            del m, t
            _free()

    def throughput(rec):
        folder = work / "qwen2-0.5b"
        if not folder.exists():
            write_qwen2(folder, big, torch.bfloat16, dev)
        n_eps = 8 if args.dry_run else (32 if args.quick else 64)
        eps = make_episodes(n_eps, big["vocab_size"], seed=3, scale=0.05 if args.dry_run else 1.0)
        adv = np.random.default_rng(1).standard_normal(len(eps))
        lengths = [len(e) for e in eps]
        flops = model_flops(big, lengths)
        rec |= {"episodes": n_eps, "tokens_per_step": int(sum(lengths)), "mean_len": float(np.mean(lengths)),
                "model_tflop_per_step": flops / 1e12, "peak_tflops": H200_PEAK_BF16 / 1e12}
        steps = 1 if args.dry_run else (2 if args.quick else 3)
        for kind in ("megatron", "torch"):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            ln = None
            try:  # one learner failing must not hide the other's figures
                ln = make_learner(kind, folder, LearnerConfig(lr=1e-6, device=dev, micro_batch_tokens=16384))
                ln.train_step(eps, adv)  # warm-up (allocator, kernels)
                s = float(np.median([ln.train_step(eps, adv)["seconds"] for _ in range(steps)]))
                rec[kind] = {"tokens_per_s": sum(lengths) / s, "step_s": s, "achieved_tflops": flops / s / 1e12,
                             "mfu": flops / s / H200_PEAK_BF16}
                if cuda:
                    rec[kind]["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            except Exception as e:  # noqa: BLE001
                rec[kind] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            finally:
                if hasattr(ln, "close"):
                    ln.close()
                del ln
                _free()
        if all("tokens_per_s" in rec[k] for k in ("megatron", "torch")):
            rec["megatron_over_torch"] = rec["megatron"]["tokens_per_s"] / rec["torch"]["tokens_per_s"]

    check.phase("env", env, 0)
    check.phase("functional", functional, 60 if cuda else 10)
    check.phase("parity_0.5b", parity, 90 if cuda else 10)
    check.phase("throughput_0.5b", throughput, 120 if cuda else 10)
    check.out["seconds"] = round(time.monotonic() - check.t0, 1)
    check.save()
    print_table(check.out)


def _shapes(shape: dict):
    from stoa.backends.megatron.convert import Arch, hf_shapes

    return hf_shapes(Arch.from_hf_config({"model_type": "qwen2", **shape})).values()


def print_table(out: dict) -> None:
    ph = out["phases"]
    print("\nphase            status   seconds")
    for name, rec in ph.items():
        print(f"{name:16s} {rec.get('status', '?'):8s} {rec.get('seconds', '')}")
    f = ph.get("functional", {})
    if f.get("status") == "ok":
        print(f"\nfunctional: fp32 log-prob rel err {f['fp32_logprob_rel_err']:.2e}, grad cos min "
              f"{f['fp32_grad_cos_min']:.6f}, checkpoint resume bit-exact {f['resume_bit_exact']}")
    p = ph.get("parity_0.5b", {})
    if p.get("status") == "ok":
        for d in ("float32", "bfloat16"):
            if d not in p:
                continue
            r = p[d]
            print(f"parity {d:9s}: log-prob rel err max {r['logprob_rel_err_max']:.2e}, abs mean "
                  f"{r['logprob_abs_err_mean']:.2e}; logits abs err max {r['logits_abs_err_max']:.2e} "
                  f"(of |logit| <= {r['logits_abs_max']:.1f})")
    t = ph.get("throughput_0.5b", {})
    if t.get("status") == "ok":
        print(f"\nlearner   tokens/s   step s   TFLOP/s   MFU     peak GiB   ({t['tokens_per_step']} tokens/step)")
        for k in ("megatron", "torch"):
            r = t[k]
            if "error" in r:
                print(f"{k:9s} error: {r['error'][:100]}")
                continue
            print(f"{k:9s} {r['tokens_per_s']:9.0f} {r['step_s']:8.3f} {r['achieved_tflops']:9.1f} "
                  f"{r['mfu']:6.1%} {r.get('peak_mem_gib', float('nan')):9}")
        if "megatron_over_torch" in t:
            print(f"ratio megatron/torch: {t['megatron_over_torch']:.2f}x")
    print(f"\ntotal {out.get('seconds')} s", flush=True)


if __name__ == "__main__":
    main()
