"""Rollout engine throughput: multi-turn search episodes, KV reuse, and mlx_lm.batch_generate.

Two models: the tiny demo model (built offline with ``stoa.models.tiny`` on the synthetic
corpus) and a ~100M-parameter random Qwen2 (same tokenizer; 12 layers, width 768). For each:

* **multi-turn**: ``stoa/SyntheticSearch-v0`` episodes (G samples per prompt, several turns with
  observations), with and without KV reuse across turns: episodes/hour, generated tokens/s,
  prefill tokens and wall time; ``prefill_saved_fraction`` is the prefill avoided by reuse.
* **single-turn vs mlx_lm**: the same chat prompts, one turn of up to N tokens at temperature 1,
  through our engine and through ``mlx_lm.batch_generate`` (same weights and compute mode with
  ``mlx_lm``'s own layers, same batch size, measured in the same run): the ratio of generated
  tokens/s (``ratio_vs_mlx_lm_batch_generate``, the minimum over the models). Also timed:
  ``batch_generate`` with ``return_logprobs=True``, and on our engine's model object (our CPU
  fast ops included), which isolates the generation loop.
* **modes**: int8 kernels (``quantized``) vs float32 compute from int8 codes (``dequantized``).
* **mismatch**: per model token, int8 engine log-prob vs float32 torch (transformers) log-prob of
  the same tokens: mean |delta|, and KL(mu || pi) by the k1 and k3 estimators.

* **like for like** (``--model``): every engine on the same footing as llama.cpp's
  ``llama-batched-bench``: prompts of exactly 32 tokens, 128 generated per row whatever is
  sampled (EOS does not end a row, so the batch size holds), batch 1, 16 and 64, the same
  threads; generated tokens/s over the whole run (prefill included) and achieved GFLOP/s (2 per
  weight of every matrix multiplied per token, plus attention), against this machine's float32
  matmul GFLOP/s measured in the same run. Engines: the torch engine (its CPU default: the int8
  kernel, ``int24`` on CPUs with AVX-512 VNNI, else ``quantized``; the kernel in float32,
  ``quantized``; its 16-bit integer path, ``int16``; float32 weights, ``dequantized``), the MLX engine
  (dequantized), ``transformers``' ``generate`` (float32, eager loop), llama.cpp F32 and Q8_0
  (GGUF converted from the same folder; ``benchmarks/llamacpp.py``; skipped, saying why, when
  ``scripts/build_llama_cpp.sh`` has not been run).

``--model PATH`` (a Hugging Face folder, e.g. SmolLM2-135M-Instruct) measures that model instead
of the two built ones, with the same prompts and the same comparisons, plus the like-for-like table.

* **same work** (``--same-work [CONFIG ...]``, only this): a worker's own work through the public
  API. For each run config (default: ``examples/smollm2_search.toml``, multi-turn search, and
  ``examples/smollm2_addition.toml``, one turn), ``make_engine(model, "torch", mode="auto")`` with
  the run's engine config, then ``engine.rollout`` on the task's train prompts with the run's
  sampling (temperature, turn and episode caps, the task's stop strings): cohorts of 1, 16 and 64
  rows (groups of the run's group size; best of 2, the same seed, so the same episodes). Per row:
  prompt, generated and environment tokens. llama.cpp (``llama-batched-bench``, F32 and Q8_0) then
  runs as many rows of the engine's mean lengths: prompt = mean prompt + environment tokens (every
  token the engine prefills, prefilled up front), generated = mean generated, prefill included in
  its time. Printed: generated tokens/s of both and their ratio, and where the engine's wall time
  went in each cohort (:class:`stoa.backends.cohort.RolloutProfile`): prefill, decode forward,
  sampler, KV cache, environment, tokenizer, and the Python between steps. The model:
  ``--model``, else ``~/.cache/stoa/models/SmolLM2-135M-Instruct``; ``--quick`` (batches 1 and 16,
  one try each) uses the tiny random model unless ``--model`` is given, and skips llama.cpp then.

    python benchmarks/rollout.py [--quick] [--json out.json] [--threads 2] [--model PATH]
                                 [--engines torch,torch-q,torch-int16,torch-f32,mlx]
    python benchmarks/rollout.py --same-work [CONFIG ...] [--quick] [--model PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# prompts x samples per prompt (multi-turn), max turn tokens, single-turn prompts and tokens,
# batch, the other compute mode's single-turn prompts and tokens (0: skip), mismatch episodes,
# best-of repeats of the single-turn comparison.
SCALES = {
    "quick": {"tiny": (8, 8, 16, 48, 32, 64, 4, 8, 8, 2), "qwen2-100m": (2, 1, 6, 4, 8, 4, 0, 0, 1, 1)},
    "full": {"tiny": (32, 8, 16, 128, 64, 64, 16, 16, 16, 3), "qwen2-100m": (8, 4, 16, 16, 32, 16, 4, 8, 8, 3)},
}
MODEL_SCALES = {"quick": (1, 2, 8, 4, 16, 4, 0, 0, 2, 1), "full": (4, 4, 16, 16, 32, 16, 0, 0, 8, 3)}
"""``--model``'s workload (same fields as SCALES)."""


LIKE = {"quick": ((16,), 32, 32), "full": ((1, 16, 64), 32, 128)}
"""Like-for-like workload: batches, prompt tokens, generated tokens per row."""

SAME_WORK = {"quick": ((1, 16), 1), "full": ((1, 16, 64), 2)}
"""``--same-work``: rows per cohort, best-of tries of each cohort."""
SAME_WORK_CONFIGS = ("smollm2_search.toml", "smollm2_addition.toml")
"""The example runs whose work ``--same-work`` plays by default (in ``examples/``)."""
REAL_MODEL = Path.home() / ".cache" / "stoa" / "models" / "SmolLM2-135M-Instruct"
TINY = dict(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
            init_std=0.05)
"""The tiny demo model's shape (``stoa.models.tiny.TinyConfig`` fields)."""


ISAS = {"native": ("", ""), "avx2": ("haswell", "avx2")}
"""``--isa``: the kernel's ``$STOA_KERNEL_MARCH`` and llama.cpp's build (``$STOA_LLAMA_ISA``) for it."""


def _reexec(threads: int, isa: str = "native") -> None:
    """Restart with OpenBLAS's thread count fixed (it is read when stoa.backends.mlx loads OpenBLAS)
    and, for ``--isa avx2``, both engines built for AVX2 without AVX-512."""
    from stoa.backends import openmp

    openmp.dedicated()  # as a worker's torch engine waits (llama.cpp's OpenMP reads the same variables)
    env = dict(os.environ)
    env.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["STOA_KERNEL_MARCH"], env["STOA_LLAMA_ISA"] = ISAS[isa]
    if any(os.environ.get(k, "") != env.get(k) for k in ("OPENBLAS_NUM_THREADS", "STOA_KERNEL_MARCH", "STOA_LLAMA_ISA")):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def build_models(root: Path, corpus) -> dict[str, Path]:
    from stoa.envs.synthetic import generate, tokenizer_texts
    from stoa.models.tiny import TinyConfig, build_tiny

    texts = list(tokenizer_texts(generate(corpus)))
    tiny = build_tiny(root / "tiny", texts, TinyConfig(**TINY))
    big = build_tiny(root / "qwen2-100m", texts, TinyConfig(vocab_size=2048, hidden_size=768, num_layers=12,
                                                            num_heads=12, num_kv_heads=2, intermediate_size=3072))
    return {"tiny": tiny, "qwen2-100m": big}


def n_params(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "np") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())


def multi_turn(eng, make_env, prompts, g, turn_tokens, kv_reuse, warm=True):
    from dataclasses import replace

    from stoa.backends.engine import RolloutRequest, SamplingConfig

    eng.config = replace(eng.config, kv_reuse=kv_reuse)
    s = SamplingConfig(max_turn_tokens=turn_tokens, max_episode_tokens=1024, seed=0)
    if warm:
        eng.rollout(make_env, [RolloutRequest(0, "warm", 2)], s)
    c0 = time.process_time()
    eps = eng.rollout(make_env, [RolloutRequest(i, f"g{i}", g) for i in range(prompts)], s)
    cpu = time.process_time() - c0
    st = eng.last_stats()
    return eps, {
        "mode": eng.mode, "episodes": st.episodes, "wall_s": st.wall_s, "cpu_s": cpu,
        "episodes_per_hour": st.episodes / st.wall_s * 3600, "gen_tokens_per_s": st.model_tokens / st.wall_s,
        "model_tokens": st.model_tokens, "env_tokens": st.env_tokens, "prefill_tokens": st.prefill_tokens,
        "prefill_saved_kv": st.prefill_saved_kv, "prefill_saved_shared": st.prefill_saved_shared,
        "prefill_saved_fraction": st.prefill_saved_fraction, "mean_turns": st.turns / st.episodes,
        "mean_episode_tokens": float(np.mean([len(e) for e in eps])),
    }


def _timed(fn) -> tuple[int, float, float]:
    """(tokens, wall s, CPU s of this process) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = fn()
    return n, time.perf_counter() - t0, time.process_time() - c0


def single_turn(eng, make_env, prompts, max_tokens, batch, repeats, stock=None, extras=True):
    """Our engine (one turn, EOS or the cap ends it) vs mlx_lm.batch_generate, same prompts.

    ``stock``: the same weights in the same compute mode with ``mlx_lm``'s own layers (what a user
    of plain ``mlx_lm`` runs): the baseline. ``batch_generate`` also runs on our engine's model
    object (isolating the generation loop) and with ``return_logprobs=True``. Runs alternate and
    each side keeps its best of ``repeats``, so a burst of load from other processes does not
    decide the ratio; CPU seconds are kept too. ``extras=False`` (``--quick``) keeps only the
    stock baseline."""
    import gymnasium
    from mlx_lm import batch_generate
    from mlx_lm.sample_utils import make_sampler

    from stoa.backends.engine import RolloutRequest, SamplingConfig

    class OneTurn(gymnasium.Wrapper):
        def step(self, action):
            return "", 0.0, True, False, {"metrics": {}}

    env = lambda: OneTurn(make_env())  # noqa: E731
    s = SamplingConfig(max_turn_tokens=max_tokens, stop_strings=(), seed=1)
    reqs = [RolloutRequest(i, f"p{i}", 1) for i in range(prompts)]
    probe = make_env()
    toks = [eng.codec.prompt_tokens(probe.reset(options={"index": i})[0]) for i in range(prompts)]
    kw = dict(max_tokens=max_tokens, sampler=make_sampler(temp=1.0), completion_batch_size=batch,
              prefill_batch_size=batch)

    def ours():
        return sum(e.num_model_tokens for e in eng.rollout(env, reqs, s))

    def theirs(model, **extra):
        r = batch_generate(model, eng.tokenizer, toks, return_token_ids=True, **kw, **extra)
        return sum(len(t) for t in r.token_ids)

    compare = stock is not None
    sides = {"ours": ours}
    if compare:
        sides |= {"mlx_lm": lambda: theirs(stock)}
        if extras:
            sides |= {"mlx_lm_same_model": lambda: theirs(eng.mlx_model),
                      "mlx_lm_logprobs": lambda: theirs(stock, return_logprobs=True)}
    for fn in sides.values():  # warm-up
        fn()
    best: dict[str, tuple[int, float, float]] = {}
    for _ in range(repeats):
        for key, fn in sides.items():
            n, wall, cpu = _timed(fn)
            if key not in best or n / wall > best[key][0] / best[key][1]:
                best[key] = (n, wall, cpu)
    out: dict = {"mode": eng.mode, "repeats": repeats}
    for key, (n, wall, cpu) in best.items():
        out |= {f"{key}_tokens": n, f"{key}_tokens_per_s": n / wall, f"{key}_tokens_per_cpu_s": n / cpu}
    if compare:
        out["ratio_vs_mlx_lm_batch_generate"] = out["ours_tokens_per_s"] / out["mlx_lm_tokens_per_s"]
        out["ratio_vs_mlx_lm_batch_generate_cpu"] = out["ours_tokens_per_cpu_s"] / out["mlx_lm_tokens_per_cpu_s"]
        if extras:
            out["ratio_vs_mlx_lm_with_logprobs"] = out["ours_tokens_per_s"] / out["mlx_lm_logprobs_tokens_per_s"]
            out["ratio_vs_mlx_lm_same_model"] = out["ours_tokens_per_s"] / out["mlx_lm_same_model_tokens_per_s"]
    return out


def mismatch(path, eps, threads):
    """int8 behaviour log-probs vs float32 torch on the same tokens."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    d = []
    with torch.no_grad():
        for ep in eps:
            x = torch.tensor(ep.tokens()[None], dtype=torch.long)
            logits = model(x).logits[0, :-1].float() / ep.temperature
            lp = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].numpy()
            m = ep.loss_mask()[1:]
            d.append(ep.behavior_logprobs()[1:][m] - lp[m])
    d = np.concatenate(d)
    r = np.exp(-d)
    return {"tokens": int(d.size), "mean_abs_dlogprob": float(np.abs(d).mean()),
            "max_abs_dlogprob": float(np.abs(d).max()), "kl_k1": float(d.mean()),
            "kl_k3": float((r - 1 - np.log(r)).mean())}


class _OneTurn:
    """A text task of fixed prompts: one model turn, then the episode ends."""

    stop_strings: tuple[str, ...] = ()
    spec = None

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    @property
    def unwrapped(self):
        return self

    def reset(self, seed=None, options=None):
        return self.texts[int((options or {}).get("index", 0))], {}

    def step(self, text):
        return "", 0.0, True, False, {"metrics": {}}


def exact_prompts(codec, n: int, length: int, seed: int = 0) -> list[str]:
    """``n`` prompts whose chat-templated tokens number exactly ``length``."""
    words = "the river runs to the sea and a town lies on its bank where people trade fish and grain".split()
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        text = " ".join(rng.choice(words, size=length))
        while len(codec.prompt_tokens(text)) > length and " " in text:
            text = text.rsplit(" ", 1)[0]
        if len(codec.prompt_tokens(text)) == length:
            out.append(text)
    return out


def matmul_gflops(threads: int) -> float:
    """This machine's float32 matmul GFLOP/s (torch, 2048^3, best of 5) with ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = min(_timed(lambda: (a @ b, 1)[1])[1] for _ in range(5))
    return 2 * 2048**3 / best / 1e9


def _engine_run(eng, texts: list[str], batch: int, gen: int) -> float:
    """Generated tokens/s of one single-turn cohort of ``batch`` rows of exactly ``gen`` tokens."""
    from stoa.backends.engine import RolloutRequest, SamplingConfig

    from dataclasses import replace as _replace

    eng._codec = _replace(eng.codec, eos_ids=frozenset())  # fixed lengths: no row ends at EOS (this benchmark only)
    s = SamplingConfig(max_turn_tokens=gen, max_episode_tokens=len(eng.codec.prompt_tokens(texts[0])) + gen + 1,
                       stop_strings=(), seed=1)
    reqs = [RolloutRequest(i, f"p{i}", 1) for i in range(batch)]
    from dataclasses import replace

    eng.config = replace(eng.config, max_batch=batch)
    eng.rollout(lambda: _OneTurn(texts), reqs, replace(s, max_turn_tokens=2))  # warm-up
    n, wall, _ = _timed(lambda: sum(e.num_model_tokens for e in eng.rollout(lambda: _OneTurn(texts), reqs, s)))
    assert n == batch * gen, (n, batch, gen)
    return n / wall


def _generate_run(model, ids, gen: int) -> float:
    import torch

    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=gen, min_new_tokens=gen,
              pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=ids[:, :8], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        n, wall, _ = _timed(lambda: model.generate(input_ids=ids, **kw).shape[0] * gen)
    return n / wall


def like_for_like(path: Path, threads: int, quick: bool, engines: list[str]) -> dict:
    """Every engine and llama.cpp at fixed prompt and generation lengths (see the module docstring)."""
    import llamacpp
    import torch
    import transformers

    from stoa.backends.engine import EngineConfig, EngineError, make_engine
    from stoa.models.presets import decode_flops

    batches, prompt, gen = LIKE["quick" if quick else "full"]
    cfg = json.loads((path / "config.json").read_text())
    flops = decode_flops(cfg, prompt + gen / 2)
    torch.set_num_threads(threads)
    out: dict = {"batches": list(batches), "prompt": prompt, "gen": gen, "threads": threads,
                 "matmul_gflops": matmul_gflops(threads), "flops_per_token": flops, "load_before": _load(),
                 "tokens_per_s": {}}
    tps = out["tokens_per_s"]
    built = {"torch": lambda: make_engine(path, "torch", config=EngineConfig(max_batch=max(batches)), device="cpu"),
             "torch-int24": lambda: make_engine(path, "torch", mode="int24",
                                                config=EngineConfig(max_batch=max(batches)), device="cpu"),
             "torch-int16": lambda: make_engine(path, "torch", mode="int16",
                                                config=EngineConfig(max_batch=max(batches)), device="cpu"),
             "torch-q": lambda: make_engine(path, "torch", mode="quantized",
                                            config=EngineConfig(max_batch=max(batches)), device="cpu"),
             "torch-f32": lambda: make_engine(path, "torch", mode="dequantized",
                                              config=EngineConfig(max_batch=max(batches)), device="cpu"),
             "mlx": lambda: make_engine(path, "mlx", mode="dequantized", config=EngineConfig(max_batch=max(batches)))}
    texts = None
    for name in engines:
        try:
            eng = built[name]()
        except EngineError as e:  # the integer path on a CPU without AVX-512 VNNI
            print(f"[rollout] like-for-like: no {name} engine here: {e}", file=sys.stderr)
            continue
        texts = texts or exact_prompts(eng.codec, max(batches), prompt)
        label = f"torch engine ({eng.mode})" if name.startswith("torch") else f"{name} engine"
        tps[label] = {b: _engine_run(eng, texts, b, gen) for b in batches}
        del eng
        print(f"[rollout] like-for-like: {name} engine done", file=sys.stderr)
    if not quick:
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False) for t in texts])
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        tps["transformers generate"] = {b: _generate_run(model, ids[:b], gen) for b in batches}
        del model
    why = llamacpp.status()
    out["llama_cpp"] = why or "built"
    if why is None:
        for kind in ("f32", "q8_0"):
            rows = llamacpp.batched_bench(llamacpp.gguf(path, kind), threads, prompt, gen, list(batches))
            tps[f"llama.cpp {kind.upper()}"] = {b: rows[b]["tokens_per_s"] for b in batches}
    out["gflops"] = {k: {b: v * flops / 1e9 for b, v in row.items()} for k, row in tps.items()}
    out["load_after"] = _load()
    return out


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def same_work(path: Path, configs: list[Path], threads: int, quick: bool, llama_cpp: bool) -> dict:
    """A worker's work on the torch engine and llama.cpp on rows of its mean lengths (see the
    module docstring); ``llama_cpp=False``: say why not instead."""
    import torch

    from stoa.backends.engine import make_engine
    from stoa.fleet.config import load_config
    from stoa.fleet.task import import_env_module

    batches, tries = SAME_WORK["quick" if quick else "full"]
    torch.set_num_threads(threads)
    out: dict = {"model": str(path), "threads": threads, "batches": list(batches), "tries": tries,
                 "load_before": _load(), "tasks": {}}
    engines: dict[str, object] = {}  # by prompt format: one engine per format the configs ask for
    for config in configs:
        run = load_config(config)
        import_env_module(run.env)
        rc, env = run.rollout, run.env
        make_env = lambda env=env: env.make(env.train_split)  # noqa: E731  (a worker's factory)
        fmt = run.model.prompt_format
        if fmt not in engines:
            engines[fmt] = make_engine(path, "torch", mode="auto", config=rc.engine_config(fmt), device="cpu")
        eng = engines[fmt]
        sampling = rc.sampling(seed=1)
        task: dict = {"config": str(config), "env": env.id, "engine_mode": eng.mode, "group_size": rc.group_size,
                      "temperature": sampling.temperature, "max_turn_tokens": sampling.max_turn_tokens,
                      "max_episode_tokens": sampling.max_episode_tokens, "rows": {}}
        for b in batches:
            task["rows"][b] = _same_work_cohort(eng, make_env, sampling, b, rc.group_size, tries)
        out["tasks"][Path(config).stem.removeprefix("smollm2_")] = task
        print(f"[rollout] same work: {config} done", file=sys.stderr)
    del engines, eng
    out["llama_cpp"] = _same_work_llama(path, out["tasks"], threads) if llama_cpp else (
        "skipped: --quick's random model (give --model for a real one)")
    out["load_after"] = _load()
    return out


@contextlib.contextmanager
def _timing_sampler(eng, profile):
    """Time the torch engine's sampler inside its decode steps (``next_tokens`` calls ``eng.sample``)."""
    eng.sample = profile.timed(eng.sample, "sample_s")  # an instance attribute shadows the method
    try:
        yield
    finally:
        del eng.sample


def _same_work_cohort(eng, make_env, sampling, rows: int, group_size: int, tries: int) -> dict:
    """One cohort of ``rows`` episodes (groups of ``group_size``, or of one where it does not
    divide ``rows``) through ``engine.rollout``, the fastest of ``tries`` (same seed: same episodes)."""
    from dataclasses import replace

    from stoa.backends.cohort import profiled
    from stoa.backends.engine import RolloutRequest

    g = group_size if rows % group_size == 0 else 1
    reqs = [RolloutRequest(i, f"g{i}", g) for i in range(rows // g)]
    eng.config = replace(eng.config, max_batch=rows)
    eng.rollout(make_env, reqs, replace(sampling, max_turn_tokens=2))  # warm-up: environments, cache
    best = None
    for _ in range(tries):
        with profiled() as prof, _timing_sampler(eng, prof):
            t0 = time.perf_counter()
            eps = eng.rollout(make_env, reqs, sampling)
            wall = time.perf_counter() - t0
        if best is None or wall < best[0]:
            best = (wall, eps, prof, eng.last_stats())
    wall, eps, prof, st = best
    prompt = [len(e.prompt_tokens) for e in eps]
    gen = [e.num_model_tokens for e in eps]
    env = [sum(len(s.tokens) for s in e.segments if s.kind == "env") for e in eps]
    return {"rows": rows, "group_size": g, "wall_s": wall, "tokens_per_s": sum(gen) / wall,
            "prompt_tokens": prompt, "gen_tokens": gen, "env_tokens": env, "mean_prompt": float(np.mean(prompt)),
            "mean_gen": float(np.mean(gen)), "mean_env": float(np.mean(env)), "mean_turns": st.turns / st.episodes,
            "prefill_tokens": st.prefill_tokens, "prefill_saved_shared": st.prefill_saved_shared,
            "decode_steps": st.decode_steps, "finish_reasons": dict(st.finish_reasons),
            "breakdown": breakdown(prof, wall)}


BREAKDOWN = ("prefill", "decode_forward", "sampler", "kv_cache", "environment", "tokenizer", "python")
"""The parts of a rollout's wall time, in :func:`breakdown`'s order."""


def breakdown(p, wall: float) -> dict:
    """Seconds of ``wall`` (one ``engine.rollout`` call's wall time) by part, from its
    :class:`~stoa.backends.cohort.RolloutProfile` ``p``: the parts sum to ``wall``; ``python`` is
    the rest (the loop's bookkeeping between steps, and the call's own entry and exit)."""
    parts = {"prefill": p.prefill_s, "decode_forward": p.decode_s - p.sample_s, "sampler": p.sample_s,
             "kv_cache": p.cache_s, "environment": p.env_s, "tokenizer": p.tokenizer_s}
    parts["python"] = wall - sum(parts.values())
    return {**parts, "wall_s": wall, "sampler_timed": p.sample_s > 0,
            "rows_per_decode_step": p.decode_rows / p.decode_steps if p.decode_steps else 0.0}


def _same_work_llama(path: Path, tasks: dict, threads: int) -> str:
    """llama.cpp F32 and Q8_0 on each cohort's rows at its mean lengths (prefill included): into
    each cohort's ``llama_cpp``; returns ``"built"`` or why not."""
    import subprocess

    import llamacpp

    why = llamacpp.status()
    if why is not None:
        return why
    try:
        ggufs = {kind.upper(): llamacpp.gguf(path, kind) for kind in ("f32", "q8_0")}
        for task in tasks.values():
            for b, r in task["rows"].items():
                pp, tg = round(r["mean_prompt"] + r["mean_env"]), max(1, round(r["mean_gen"]))
                r["llama_cpp"] = {"prompt": pp, "gen": tg}
                for kind, f in ggufs.items():
                    r["llama_cpp"][kind] = llamacpp.batched_bench(f, threads, pp, tg, [b])[b]["tokens_per_s"]
    except subprocess.CalledProcessError as e:  # a GGUF conversion or a run; its last error line
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        last = err.strip().splitlines()[-1:] or [f"exit status {e.returncode}"]
        return f"failed: {' '.join(Path(str(c)).name for c in e.cmd[:2])}: {last[0]}"
    return "built"


def print_same_work(r: dict) -> None:
    modes = ", ".join(sorted({t["engine_mode"] for t in r["tasks"].values()}))
    print(f"\nSame work: {r['model']}, torch engine (auto: {modes}), {r['threads']} threads, best of "
          f"{r['tries']}; load {r['load_before']} -> {r['load_after']}")
    print(f"{'task':<10}{'rows':>5}{'prompt':>8}{'gen':>7}{'env':>7}{'turns':>6}{'engine tok/s':>14}"
          f"{'Q8_0 tok/s':>12}{'ratio':>7}{'F32 tok/s':>11}{'ratio':>7}")
    for name, t in r["tasks"].items():
        for b, c in t["rows"].items():
            ll = c.get("llama_cpp", {})
            cells = "".join(f"{ll[k]:>12.1f}{c['tokens_per_s'] / ll[k]:>7.2f}" if k in ll else f"{'-':>12}{'-':>7}"
                            for k in ("Q8_0", "F32"))
            print(f"{name:<10}{b:>5}{c['mean_prompt']:>8.1f}{c['mean_gen']:>7.1f}{c['mean_env']:>7.1f}"
                  f"{c['mean_turns']:>6.2f}{c['tokens_per_s']:>14.1f}{cells}")
    if r["llama_cpp"] != "built":
        print(f"llama.cpp: {r['llama_cpp']}")
    else:
        print("llama.cpp: rows of prompt = the engine's mean prompt + env tokens, gen = its mean gen; "
              "generated tokens/s, prefill included")
    labels = dict(zip(BREAKDOWN, ("prefill", "decode fwd", "sampler", "KV cache", "env", "tokenizer", "python")))
    print("\nWhere the engine's wall time goes (% of one rollout's wall time)")
    print(f"{'task':<10}{'rows':>5}{'wall s':>8}" + "".join(f"{labels[k]:>11}" for k in BREAKDOWN)
          + f"{'rows/step':>10}")
    untimed = False
    for name, t in r["tasks"].items():
        for b, c in t["rows"].items():
            d = c["breakdown"]
            untimed |= not d["sampler_timed"]
            cells = "".join(f"{100 * d[k] / d['wall_s']:>10.1f}%" for k in BREAKDOWN)
            print(f"{name:<10}{b:>5}{d['wall_s']:>8.2f}{cells}{d['rows_per_decode_step']:>10.1f}")
    if untimed:
        print("sampler: not timed here (the engine's decode step did not call engine.sample); inside decode fwd")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads (< 1 minute)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--threads", type=int, default=2, help="BLAS / torch threads")
    ap.add_argument("--skip-mismatch", action="store_true", help="do not load torch")
    ap.add_argument("--model", type=Path, help="a Hugging Face folder to measure instead of the built models")
    ap.add_argument("--engines", default="torch,torch-q,torch-int16,torch-f32,mlx",
                    help="engines of the like-for-like table (--model): torch (auto: the int8 kernel on CPUs, on its "
                         "24-bit integer path where the CPU has AVX-512 VNNI), torch-q (the kernel in float32), "
                         "torch-int24 / torch-int16 (its 24- / 16-bit integer path; on AVX2 without VNNI auto leaves "
                         "them, being slower there), torch-f32 (float32 weights), mlx")
    ap.add_argument("--like-only", action="store_true", help="--model: only the like-for-like table")
    ap.add_argument("--same-work", nargs="*", type=Path, metavar="CONFIG",
                    help="only the same-work table: these run configs' work (default: examples/"
                         + " and examples/".join(SAME_WORK_CONFIGS) + ") on the torch engine and on llama.cpp")
    ap.add_argument("--isa", choices=sorted(ISAS), default="native",
                    help="avx2: build the torch engine's kernels and llama.cpp (`scripts/build_llama_cpp.sh avx2`) "
                         "for AVX2 without AVX-512, to measure an AVX2-only CPU's code path on an AVX-512 one")
    args = ap.parse_args()
    _reexec(args.threads, args.isa)
    if args.same_work is not None:
        run_same_work(args)
        return
    import stoa.envs
    from stoa.envs.synthetic import SyntheticConfig

    from stoa.backends.engine import EngineConfig
    from stoa.backends.mlx import MLXEngine

    scale = SCALES["quick" if args.quick else "full"]
    corpus = SyntheticConfig(seed=0)
    make_env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", config=corpus)  # noqa: E731
    t_start = time.perf_counter()
    results: dict = {"quick": args.quick, "threads": args.threads, "isa": args.isa, "models": {}}
    if args.model:
        scale = {args.model.name: MODEL_SCALES["quick" if args.quick else "full"]}
        results["like_for_like"] = like_for_like(args.model, args.threads, args.quick, args.engines.split(","))
        print_like(results["like_for_like"])
        if args.like_only:
            if args.json:
                args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
            return
    with tempfile.TemporaryDirectory() as tmp:
        models = {args.model.name: args.model} if args.model else build_models(Path(tmp), corpus)
        for name, path in models.items():
            prompts, g, turn, st_prompts, st_tokens, batch, om_prompts, om_tokens, n_mismatch, repeats = scale[name]
            res: dict = {"params": n_params(path), "batch": batch}
            eng = MLXEngine.from_pretrained(path, config=EngineConfig(max_batch=batch))
            res["fast_ops"] = eng.fast_ops
            eps, res["multi_turn_kv_reuse"] = multi_turn(eng, make_env, prompts, g, turn, True)
            _, res["multi_turn_no_reuse"] = multi_turn(eng, make_env, prompts, g, turn, False, warm=False)
            stock = MLXEngine.from_pretrained(path, mode=eng.mode, fast_ops=False).mlx_model
            res["single_turn"] = single_turn(eng, make_env, st_prompts, st_tokens, batch, repeats, stock,
                                             extras=not args.quick)
            del stock
            if om_prompts:
                other = "quantized" if eng.mode == "dequantized" else "dequantized"
                del eng
                eng = MLXEngine.from_pretrained(path, mode=other, config=EngineConfig(max_batch=batch))
                res["single_turn_other_mode"] = single_turn(eng, make_env, om_prompts, om_tokens, batch, 1)
            del eng
            if not args.skip_mismatch:
                res["mismatch"] = mismatch(path, eps[:n_mismatch], args.threads)
            results["models"][name] = res
            print(f"[rollout] {name} done at {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    ms = results["models"]
    results["ratio_vs_mlx_lm_batch_generate"] = min(m["single_turn"]["ratio_vs_mlx_lm_batch_generate"]
                                                    for m in ms.values())
    first = ms.get("tiny", next(iter(ms.values())))
    results["prefill_saved_fraction"] = first["multi_turn_kv_reuse"]["prefill_saved_fraction"]
    results["wall_s"] = time.perf_counter() - t_start
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


def run_same_work(args: argparse.Namespace) -> None:
    """``--same-work``: pick the model (building the tiny one for ``--quick``), run, print, write."""
    configs = args.same_work or [Path(__file__).resolve().parents[1] / "examples" / c for c in SAME_WORK_CONFIGS]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None and args.quick:
            from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts
            from stoa.models.tiny import TinyConfig, build_tiny

            path = build_tiny(Path(tmp) / "tiny", list(tokenizer_texts(generate(SyntheticConfig(seed=0)))),
                              TinyConfig(**TINY))
        elif path is None:
            path = REAL_MODEL
            if not (path / "config.json").is_file():
                sys.exit(f"--same-work: no model at {path} (make setup builds it); give --model PATH or --quick")
        r = same_work(path, configs, args.threads, args.quick, llama_cpp=args.model is not None or not args.quick)
    r["isa"] = args.isa
    from stoa.backends.torch import qlinear

    r["kernel"] = qlinear.available()[1]
    print(f"\nbuilt for: {args.isa} (kernel: {r['kernel']}; integer path: {qlinear.integer_available()[1]})")
    print_same_work(r)
    if args.json:
        args.json.write_text(json.dumps({"same_work": r}, indent=2, sort_keys=True) + "\n")


def print_table(r: dict) -> None:
    print(f"\nRollout engine ({'quick' if r['quick'] else 'full'}, {r['threads']} BLAS threads)")
    print(f"{'model':<11} {'params':>7} {'what':<34} {'value':>12} {'baseline':>12} {'ratio':>7}")
    for name, m in r["models"].items():
        p = f"{m['params'] / 1e6:.1f}M"
        a, b = m["multi_turn_kv_reuse"], m["multi_turn_no_reuse"]
        st, om = m["single_turn"], m.get("single_turn_other_mode")
        rows = [
            (f"multi-turn episodes/hour ({a['mode']})", a["episodes_per_hour"], b["episodes_per_hour"], "no KV reuse"),
            ("multi-turn generated tok/s", a["gen_tokens_per_s"], b["gen_tokens_per_s"], "no KV reuse"),
            ("multi-turn prefill tokens", a["prefill_tokens"], b["prefill_tokens"], "no KV reuse"),
            ("multi-turn wall s", a["wall_s"], b["wall_s"], "no KV reuse"),
            ("single-turn tok/s vs batch_generate", st["ours_tokens_per_s"], st["mlx_lm_tokens_per_s"], "mlx_lm"),
            ("  ... per CPU second", st["ours_tokens_per_cpu_s"], st["mlx_lm_tokens_per_cpu_s"], "mlx_lm"),
        ]
        if "mlx_lm_logprobs_tokens_per_s" in st:
            rows += [("  ... vs batch_generate + logprobs", st["ours_tokens_per_s"], st["mlx_lm_logprobs_tokens_per_s"],
                      "mlx_lm"),
                     ("  ... vs batch_generate, our model", st["ours_tokens_per_s"],
                      st["mlx_lm_same_model_tokens_per_s"], "mlx_lm")]
        if om:
            rows.append((f"single-turn tok/s {st['mode']} vs {om['mode']}", st["ours_tokens_per_s"],
                         om["ours_tokens_per_s"], om["mode"]))
        for what, v, base, _ in rows:
            ratio = v / base if base else math.nan
            print(f"{name:<11} {p:>7} {what:<34} {v:>12.1f} {base:>12.1f} {ratio:>7.2f}")
        print(f"{name:<11} {p:>7} {'prefill saved by KV reuse':<34} {a['prefill_saved_fraction']:>12.3f}"
              f" {'':>12} {'':>7}  (shared prompt prefill saved {a['prefill_saved_shared']} tokens)")
        if "mismatch" in m:
            mm = m["mismatch"]
            print(f"{name:<11} {p:>7} {'int8 vs fp32 torch mean|dlogp|':<34} {mm['mean_abs_dlogprob']:>12.2e}"
                  f"   KL k1 {mm['kl_k1']:.2e}, k3 {mm['kl_k3']:.2e}, max|d| {mm['max_abs_dlogprob']:.2e}"
                  f" ({mm['tokens']} tokens)")
    print(f"ratio_vs_mlx_lm_batch_generate (min over models) {r['ratio_vs_mlx_lm_batch_generate']:.2f}; "
          f"prefill_saved_fraction ({next(iter(r['models']))}) {r['prefill_saved_fraction']:.3f}; "
          f"wall {r['wall_s']:.0f} s")
    if "like_for_like" in r:
        print_like(r["like_for_like"])


def print_like(r: dict) -> None:
    bs = r["batches"]
    print(f"\nLike for like: {r['prompt']}-token prompts, {r['gen']} generated per row, {r['threads']} threads; "
          f"float32 matmul {r['matmul_gflops']:.0f} GFLOP/s; load {r['load_before']} -> {r['load_after']}")
    base = r["tokens_per_s"].get("llama.cpp Q8_0")
    head = "".join(f"{'B=' + str(b) + ' tok/s':>13} {'GFLOP/s':>8} {'vs Q8_0':>8}" for b in bs)
    print(f"{'engine':<24}{head}")
    for name, row in r["tokens_per_s"].items():
        cells = ""
        for b in bs:
            ratio = f"{row[b] / base[b]:>8.2f}" if base else f"{'-':>8}"
            cells += f"{row[b]:>13.1f} {r['gflops'][name][b]:>8.1f} {ratio}"
        print(f"{name:<24}{cells}")
    if r["llama_cpp"] != "built":
        print(f"llama.cpp: {r['llama_cpp']}")


if __name__ == "__main__":
    main()
