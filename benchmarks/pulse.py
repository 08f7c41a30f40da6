"""PULSE weight deltas vs full int8 checkpoints vs a naive sparse baseline.

Three workloads:

* ``tiny``: a tiny Qwen2 (``stoa.models.tiny``) trained for real with torch AdamW through
  ``transformers`` on a causal-LM loss; every optimizer step is exported, quantized with the
  trainer's policy against the previous version, and delta-coded.
* ``synthetic``: a Llama-shaped model of >= 100M parameters (bf16, like most HF checkpoints)
  taking one Adam step at steady state (``adam_step``), with the learning rate bisected so that
  0.1%, 0.5% and 2% of the int8 codes change. The previous version is itself a steady-state version of the policy
  (bf16 codes move once from MLX's float32 scale to the stored one on the first kept version).
* ``--model PATH`` (a Hugging Face folder, e.g. SmolLM2-135M-Instruct): that model trained for real
  with torch AdamW on supervised chat-template demonstrations (short additions, loss on the
  answer), at ``examples/smollm2_addition.toml``'s learning rate and at 1e-6, 1e-5 and 1e-4 (or
  ``--lrs``); float32 weights exported and quantized as the trainer does, each step measured
  after the one-off settling step (``--quick``: the example's rate, one measured step). Replaces
  the other two workloads.

Per row: full int8 state bytes (the safetensors anchor), delta bytes and their ratio; bits per
changed code (code tensors only) against the entropy bound (per tensor: n*H(k/n) for the change
positions plus k*H(d) for the code differences, summed); the naive baseline measured in the same
run (int32 flat indices + raw new values of every changed element, zstd level 3) and PULSE's
size relative to it; encode and apply seconds; and the time for 14 workers, each on a 50 Mbit/s
link, to fetch a full checkpoint vs a delta. ``--json PATH`` writes every row plus, for the 0.5%
synthetic case, ``bits_per_changed_code``, ``entropy_bound_bits_per_changed_code`` and
``ratio_vs_naive`` at the top level.

    python benchmarks/pulse.py [--quick] [--json out.json] [--params 110e6] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import tomllib

import ml_dtypes
import numpy as np
import zstandard

from stoa.transport.pulse import apply_delta, apply_delta_inplace, encode_delta, encode_state, state_hash
from stoa.transport.quant import RequantPolicy, dequantize_state, is_quantized, quantize_state

BF16 = np.dtype(ml_dtypes.bfloat16)
WORKERS, LINK_BPS = 14, 50e6


# --- measurements ----------------------------------------------------------------------------------

def naive_delta(prev: dict, new: dict) -> bytes:
    """The baseline: for each tensor with changes, int32 flat indices and the raw new values, zstd."""
    parts = []
    for name in sorted(prev):
        a, b = prev[name].reshape(-1), new[name].reshape(-1)
        u = np.dtype(f"<u{a.itemsize}")
        idx = np.flatnonzero(a.view(u) != b.view(u)).astype(np.int32)
        if idx.size:
            parts += [name.encode(), idx.size.to_bytes(8, "little"), idx.tobytes(), b[idx].tobytes()]
    return zstandard.ZstdCompressor(level=3).compress(b"".join(parts))


def code_names(state: dict) -> list[str]:
    return [n for n, a in state.items() if a.dtype == np.uint8 and n.endswith(".weight")]


def entropy_bound_bits(prev: dict, new: dict) -> tuple[float, int, int]:
    """(bits, changed codes, total codes) of the per-tensor iid entropy bound over code tensors."""
    bits, k_all, n_all = 0.0, 0, 0
    for name in code_names(prev):
        a, b = prev[name].reshape(-1), new[name].reshape(-1)
        ch = a != b
        k, n = int(ch.sum()), a.size
        k_all, n_all = k_all + k, n_all + n
        if 0 < k < n:
            p = k / n
            bits += n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
        if k:
            _, counts = np.unique((b[ch].astype(np.int16) - a[ch]).astype(np.int8), return_counts=True)
            q = counts / k
            bits += k * float(-(q * np.log2(q)).sum())
    return bits, k_all, n_all


def measure(label: str, prev: dict, new: dict, repeat: int = 1) -> dict:
    full = len(encode_state(new))
    t = time.perf_counter()
    for _ in range(repeat):
        blob = encode_delta(prev, new)
    enc_s = (time.perf_counter() - t) / repeat
    t = time.perf_counter()
    out = apply_delta(prev, blob)
    apply_s = time.perf_counter() - t
    assert state_hash(out) == state_hash(new), "delta did not reproduce the new state"
    del out
    live = {k: v.copy() for k, v in prev.items()}
    t = time.perf_counter()
    apply_delta_inplace(live, blob)
    inplace_s = time.perf_counter() - t
    del live
    codes = code_names(prev)
    code_bits = len(encode_delta({n: prev[n] for n in codes}, {n: new[n] for n in codes})) * 8
    bound, k, n = entropy_bound_bits(prev, new)
    naive = len(naive_delta(prev, new))
    n_scales = sum(int((prev[x] != new[x]).sum()) for x in prev if x.endswith(".scales"))
    g_scales = sum(prev[x].size for x in prev if x.endswith(".scales"))
    return {
        "case": label, "code_change_rate": k / n, "changed_codes": k, "codes": n,
        "scales_changed_rate": n_scales / max(g_scales, 1),
        "full_bytes": full, "delta_bytes": len(blob), "ratio_delta_vs_full": len(blob) / full,
        "bits_per_changed_code": code_bits / max(k, 1),
        "entropy_bound_bits_per_changed_code": bound / max(k, 1),
        "naive_bytes": naive, "ratio_vs_naive": len(blob) / naive,
        "encode_s": enc_s, "apply_s": apply_s, "apply_inplace_s": inplace_s,
        "sync_full_s": full * 8 / LINK_BPS, "sync_delta_s": len(blob) * 8 / LINK_BPS,
        "fleet_bytes_full": WORKERS * full, "fleet_bytes_delta": WORKERS * len(blob),
    }


# --- synthetic >= 100M-parameter model -----------------------------------------------------------

def llama_shapes(params: float) -> dict[str, tuple[int, ...]]:
    """Llama-style (tied embeddings) shapes: width 768, MLP 2048, vocab 32000, layers to ``params``."""
    h, inter, vocab = 768, 2048, 32000
    per_layer = 4 * h * h + 3 * h * inter + 2 * h
    layers = max(1, math.ceil((params - vocab * h - h) / per_layer))
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{m}.weight"] = (h, h)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def adam_step(rng, w: np.ndarray, lr: float, b1: float = 0.9) -> np.ndarray:
    """One Adam step at steady state under noise-dominated gradients.

    Then m / sqrt(v) is ~N(0, (1 - b1) / (1 + b1)) per element whatever the gradient's scale; rows
    whose gradients keep a direction take larger steps, modelled by a log-normal factor per row.
    """
    row = np.exp(rng.normal(0, 0.5, (w.shape[0],) + (1,) * (w.ndim - 1))).astype(np.float32)
    u = rng.standard_normal(w.shape, dtype=np.float32)
    u *= row * np.float32(lr * math.sqrt((1 - b1) / (1 + b1)))
    return w - u


def init_weight(rng, name: str, shape) -> np.ndarray:
    if len(shape) == 1:
        return (1 + 0.05 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


def synthetic_versions(shapes, lr: float, policy: RequantPolicy, seed: int, dtype=BF16, errors=None):
    """(previous state, new state) of the synthetic model, one tensor at a time (lean memory).

    With ``errors`` (a list), appends (sum of |dequantized - float|, count) over quantized tensors.
    """
    prev, new = {}, {}
    for j, (name, shape) in enumerate(shapes.items()):
        rng = np.random.default_rng([seed, j])
        w0 = init_weight(rng, name, shape)
        w1 = adam_step(rng, w0, lr)
        t0, t1 = {name: w0.astype(dtype)}, {name: w1.astype(dtype)}
        del w0
        s0 = quantize_state(t0)
        if policy.kind == "keep":
            s0 = quantize_state(t0, previous=s0, policy=policy)  # a steady-state version
        s1 = quantize_state(t1, previous=s0, policy=policy)
        if errors is not None and is_quantized(name, shape):
            deq = dequantize_state(s1)[name].astype(np.float32)
            errors.append((float(np.abs(deq - w1).sum()), w1.size))
        prev.update(s0)
        new.update(s1)
    return prev, new


def tune_lr(target: float, policy: RequantPolicy, seed: int) -> float:
    """The learning rate at which ~``target`` of one MLP matrix's codes change (bisection in log)."""
    shapes = {"model.layers.0.mlp.up_proj.weight": (2048, 768)}
    lo, hi = 1e-8, 1e-2
    for _ in range(18):
        mid = math.sqrt(lo * hi)
        prev, new = synthetic_versions(shapes, mid, policy, seed)
        name = next(iter(shapes))
        rate = float((prev[name] != new[name]).mean())
        lo, hi = (mid, hi) if rate < target else (lo, mid)
    return math.sqrt(lo * hi)


def measured_steps(case: str, loss_fn, opt, export, steps: int, policy: RequantPolicy) -> tuple[dict, list[dict]]:
    """``steps + 1`` optimizer steps, each exported and quantized as the trainer does; the last
    ``steps`` measured (the first kept version is the one-off settling step). Returns the mean row
    (with ``steps``) and the per-step rows."""
    state = quantize_state(export())
    history = []
    for step in range(steps + 1):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        new = quantize_state(export(), previous=state, policy=policy)
        if step > 0:
            history.append(measure(case, state, new))
        state = new
    row = {k: (float(np.mean([h[k] for h in history])) if isinstance(history[0][k], (int, float))
               else history[0][k]) for k in history[0]}
    row["steps"] = len(history)
    return row, history


# --- tiny model, real torch optimizer steps ----------------------------------------------------------

def tiny_rows(steps: int, lrs: list[float], policy: RequantPolicy, quick: bool) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from stoa.models.tiny import TinyConfig, build_tiny

    words = ("the kinase binds a receptor in neurons and regulates expression of protein which "
             "gene does Kavorin inhibit in hepatocytes answer search information").split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, 12)) for _ in range(800)]
    cfg = TinyConfig(vocab_size=1024, hidden_size=256, num_layers=4 if not quick else 2, num_heads=4,
                     num_kv_heads=2, intermediate_size=1024)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny(Path(d) / "tiny", texts, cfg)
        for lr in lrs:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            tied = model.config.tie_word_embeddings

            def export() -> dict[str, np.ndarray]:
                sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
                if tied:
                    sd.pop("lm_head.weight", None)  # mlx_lm drops the tied head too
                return sd

            vocab = model.config.vocab_size
            batch = torch.from_numpy(rng.integers(0, vocab, (8, 64)))
            row, _ = measured_steps(f"tiny AdamW lr={lr:g}", lambda: model(input_ids=batch, labels=batch).loss,
                                    opt, export, steps, policy)
            row["params"] = int(sum(p.numel() for p in model.parameters()))
            rows.append(row)
    return rows


# --- a pretrained model, real optimizer steps ------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "smollm2_addition.toml"


def example_lr() -> float:
    """The RL learning rate of the real-model example (``[learner] lr``)."""
    return float(tomllib.loads(EXAMPLE.read_text())["learner"]["lr"])


def model_rows(path: Path, steps: int, lrs: list[float], policy: RequantPolicy, batch: int = 8) -> list[dict]:
    """Each learning rate: fresh AdamW on the model, ``steps + 1`` SFT steps, the last ``steps`` measured."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    rng = np.random.default_rng(0)
    rows_ids, rows_labels = [], []
    for a, b in rng.integers(10, 100, size=(batch, 2)):
        chat = [{"role": "user", "content": f"What is {a} + {b}? Reply with <answer> number </answer>."}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        full = prompt + tok.encode(f"<answer> {a + b} </answer>", add_special_tokens=False) + [tok.eos_token_id]
        rows_ids.append(full)
        rows_labels.append([-100] * len(prompt) + full[len(prompt):])
    width = max(map(len, rows_ids))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows_ids])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows_labels])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows_ids])
    rows = []
    for lr in lrs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        tied = model.config.tie_word_embeddings

        def export() -> dict[str, np.ndarray]:
            sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
            if tied:
                sd.pop("lm_head.weight", None)
            return {k: v for k, v in sd.items() if "inv_freq" not in k}

        row, history = measured_steps(f"{path.name} AdamW lr={lr:g}",
                                      lambda: model(input_ids=ids, attention_mask=attn, labels=labels).loss,
                                      opt, export, steps, policy)
        row.update(lr=lr, params=int(sum(p.numel() for p in model.parameters())),
                   per_step=[{k: h[k] for k in ("code_change_rate", "ratio_delta_vs_full", "delta_bytes")}
                             for h in history])
        rows.append(row)
        print(f"[pulse] {row['case']}: {100 * row['code_change_rate']:.3f}% codes changed, delta "
              f"{100 * row['ratio_delta_vs_full']:.2f}% of full", file=sys.stderr)
        del model, opt
    return rows


# --- report ----------------------------------------------------------------------------------------

def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def print_table(rows: list[dict]) -> None:
    head = ("case", "codes chg", "full int8", "PULSE delta", "delta/full", "bits/chg code", "entropy bound",
            "naive", "PULSE/naive", "encode s", "apply s", "14 workers full s", "delta s")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        print(" | ".join([
            r["case"], f"{100 * r['code_change_rate']:.2f}%", fmt_bytes(r["full_bytes"]), fmt_bytes(r["delta_bytes"]),
            f"{100 * r['ratio_delta_vs_full']:.2f}%", f"{r['bits_per_changed_code']:.2f}",
            f"{r['entropy_bound_bits_per_changed_code']:.2f}", fmt_bytes(r["naive_bytes"]),
            f"{r['ratio_vs_naive']:.3f}", f"{r['encode_s']:.2f}", f"{r['apply_s']:.2f}",
            f"{r['sync_full_s']:.1f}", f"{r['sync_delta_s']:.2f}"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller tiny model, one synthetic size; < 1 min")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--params", type=float, default=110e6, help="synthetic model size (>= 100M for the report)")
    ap.add_argument("--rates", default="0.001,0.005,0.02", help="synthetic code change rates to tune for")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--model", type=Path, help="a Hugging Face folder: measure real steps of that model instead")
    ap.add_argument("--lrs", help="--model's learning rates (default: the example's, then 1e-6,1e-5,1e-4)")
    ap.add_argument("--steps", type=int, help="--model's measured steps per learning rate (default 2; quick 1)")
    args = ap.parse_args(argv)
    try:
        import torch

        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    policy = RequantPolicy()
    t_start = time.perf_counter()
    rows: list[dict] = []
    if args.model:
        return model_main(args, policy, t_start)
    rates = [0.005] if args.quick else [float(x) for x in args.rates.split(",")]
    tiny_lrs = [2e-6] if args.quick else [2e-6, 1e-5]
    rows += tiny_rows(steps=1 if args.quick else 4, lrs=tiny_lrs, policy=policy, quick=args.quick)
    shapes = llama_shapes(args.params)
    n_params = sum(math.prod(s) for s in shapes.values())
    for rate in rates:
        lr = tune_lr(rate, policy, seed=1)
        prev, new = synthetic_versions(shapes, lr, policy, seed=2)
        row = measure(f"synthetic {n_params / 1e6:.0f}M bf16 Adam, target {100 * rate:g}%", prev, new)
        row.update(params=n_params, lr=lr, target_rate=rate)
        rows.append(row)
        del prev, new
    if not args.quick:  # how the re-quantization policy moves sparsity, at the 0.5% learning rate
        lr = next(r["lr"] for r in rows if r.get("target_rate") == 0.005)
        sub = {k: v for i, (k, v) in enumerate(shapes.items()) if i < 16}
        base_err = None
        for pol in (RequantPolicy("fresh"), policy, RequantPolicy(hysteresis=0.1)):
            errors: list[tuple[float, int]] = []
            prev, new = synthetic_versions(sub, lr, pol, seed=3, errors=errors)
            err = sum(e for e, _ in errors) / sum(n for _, n in errors)
            base_err = base_err or err
            row = measure(f"policy {pol.kind} shrink={pol.shrink} hyst={pol.hysteresis} (2 layers)", prev, new)
            row.update(policy=pol.__dict__, mean_abs_error=err, error_vs_fresh=err / base_err)
            rows.append(row)
            print(f"{row['case']}: {100 * row['code_change_rate']:.2f}% codes changed, "
                  f"delta {fmt_bytes(row['delta_bytes'])}, mean |dequantized - float| {err:.3e} ({err / base_err:.3f}x fresh)")
    print_table(rows)
    print(f"\n14 workers each on a {LINK_BPS / 1e6:.0f} Mbit/s link fetch in parallel; the store serves "
          f"{WORKERS}x the bytes. Total {time.perf_counter() - t_start:.0f} s.")
    if args.json:
        main_row = next(r for r in rows if r.get("target_rate") == 0.005)
        out = {k: main_row[k] for k in ("bits_per_changed_code", "entropy_bound_bits_per_changed_code",
                                        "ratio_vs_naive", "ratio_delta_vs_full", "code_change_rate")}
        out["rows"] = rows
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def model_main(args: argparse.Namespace, policy: RequantPolicy, t_start: float) -> int:
    ex = example_lr()
    lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else [ex] if args.quick else [ex, 1e-6, 1e-5, 1e-4]
    steps = args.steps or (1 if args.quick else 2)
    rows = model_rows(args.model, steps, lrs, policy)
    print_table(rows)
    print(f"\n{args.model.name}: {rows[0]['params'] / 1e6:.0f}M parameters, {steps} measured step(s) per learning "
          f"rate after the settling step; the example's learning rate is {ex:g}. Total "
          f"{time.perf_counter() - t_start:.0f} s.")
    if args.json:
        main_row = next((r for r in rows if r["lr"] == ex), rows[0])
        out = {k: main_row[k] for k in ("bits_per_changed_code", "entropy_bound_bits_per_changed_code",
                                        "ratio_vs_naive", "ratio_delta_vs_full", "code_change_rate", "lr")}
        out.update(model=args.model.name, example_lr=ex, rows=rows)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
