"""``stoa export``: torch and Megatron learner checkpoints as Hugging Face folders that
transformers and mlx_lm load, scoring exactly as the learner that wrote them (CPU, tiny models)."""

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

from stoa.backends.export import ExportError, export_checkpoint
from stoa.backends.learner import LearnerConfig, make_learner
from stoa.models.tiny import TinyConfig, build_tiny
from stoa.types import Episode, Segment
from helpers import random_episodes

TINY = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
TEXTS = [f"protein P{i} binds receptor R{i % 7} in cell line C{i % 5}; <search> P{i} </search>" for i in range(200)]
CFG = dict(lr=1e-2, micro_batch_tokens=96)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("untied"), TEXTS, TinyConfig(**TINY, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tied"), TEXTS, TinyConfig(**TINY, seed=1))


def _trained(ln, seed: int = 0) -> None:
    """Two RL steps, so the exported weights are not the starting folder's."""
    eps = random_episodes(8, ln.vocab_size, seed=seed)
    adv = np.random.default_rng(seed).standard_normal(8)
    ln.train_step(eps, adv)
    ln.train_step(eps, -adv)


def _hf_logprobs(model, episodes: list[Episode]) -> list[np.ndarray]:
    out = []
    for ep in episodes:
        ids = torch.from_numpy(ep.tokens().astype(np.int64))[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(np.concatenate([[0.0], lp.numpy()]))
    return out


def _check_scores(out: Path, learner_lps: list[np.ndarray], episodes: list[Episode], atol: float = 2e-5) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for got, want in zip(_hf_logprobs(model, episodes), learner_lps):
        np.testing.assert_allclose(got[1:], want[1:], rtol=1e-5, atol=atol)
    assert AutoTokenizer.from_pretrained(out)("protein P1 binds").input_ids


def _write_run_dir(root: Path, model_dir: Path) -> Path:
    """A run folder as the trainer leaves it: config.json naming model.path, checkpoints/ inside."""
    run_dir = root / "runs" / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"name": "r", "model": {"path": str(model_dir)}}))
    return run_dir


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_torch_checkpoint_exports_a_folder_transformers_and_mlx_load(which, tied_dir, untied_dir, tmp_path):
    import mlx.core as mx
    import mlx_lm

    model_dir = tied_dir if which == "tied" else untied_dir
    ln = make_learner("torch", model_dir, LearnerConfig(**CFG))
    _trained(ln)
    run_dir = _write_run_dir(tmp_path, model_dir)
    ln.save_checkpoint(run_dir / "checkpoints" / "v000000000002", extra={"version": 2})
    out = export_checkpoint(run_dir, tmp_path / "hf")  # a run folder: its newest checkpoint, its model.path

    eps = random_episodes(6, ln.vocab_size, seed=3)
    _check_scores(out, ln.logprobs(eps), eps)
    files = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    from safetensors.numpy import load_file

    start, exported = load_file(str(model_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(exported) == set(start) and not all(np.array_equal(start[k], exported[k]) for k in start)
    assert json.loads((out / "stoa_export.json").read_text())["step"] == 2

    model, _ = mlx_lm.load(str(out))
    ids = eps[0].tokens().astype(np.int64)
    mlx_logits = np.array(model(mx.array(ids[None].astype(np.int32)))[0].astype(mx.float32))
    with torch.no_grad():
        torch_logits = ln.model(input_ids=torch.from_numpy(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(mlx_logits, torch_logits, atol=2e-4, rtol=1e-4)


def test_bfloat16_export_and_clear_refusals(tied_dir, untied_dir, tmp_path):
    ln = make_learner("torch", tied_dir, LearnerConfig(**CFG))
    ck = tmp_path / "ck"
    ln.save_checkpoint(ck)
    out = export_checkpoint(ck, tmp_path / "bf16", model_dir=tied_dir, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "np") as h:
        assert {h.get_slice(k).get_dtype() for k in h.keys()} == {"BF16"}  # noqa: SIM118

    with pytest.raises(ExportError, match="--model"):  # no run folder around it to find the model from
        export_checkpoint(ck, tmp_path / "x")
    with pytest.raises(ExportError, match="does not hold the model"):
        export_checkpoint(ck, tmp_path / "x", model_dir=untied_dir)
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(ck, out, model_dir=tied_dir)
    with pytest.raises(ExportError, match="does not exist"):
        export_checkpoint(tmp_path / "nope", tmp_path / "x")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp*"))


def test_cli_export_says_what_it_wrote_and_fails_in_one_line(tied_dir, tmp_path):
    ln = make_learner("torch", tied_dir, LearnerConfig(**CFG))
    ln.save_checkpoint(tmp_path / "ck")
    stoa = [sys.executable, "-m", "stoa", "export"]
    ok = subprocess.run(stoa + [str(tmp_path / "ck"), str(tmp_path / "hf"), "--model", str(tied_dir)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "wrote" in ok.stdout, ok.stderr
    bad = subprocess.run(stoa + [str(tmp_path / "ck"), str(tmp_path / "hf2")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "--model" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.splitlines()) == 1


# -- Megatron ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_cpu():
    """A gloo world of one and the two CPU shims of tests/test_megatron.py, undone afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    assert not dist.is_initialized()
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    mp.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
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


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_megatron_checkpoint_exports_the_learners_model(which, tied_dir, untied_dir, megatron_cpu, tmp_path):
    model_dir = tied_dir if which == "tied" else untied_dir
    ln = make_learner("megatron", model_dir, LearnerConfig(**CFG))
    _trained(ln)
    ln.save_checkpoint(tmp_path / "ck")
    out = export_checkpoint(tmp_path / "ck", tmp_path / "hf", model_dir=model_dir)
    eps = random_episodes(6, ln.vocab_size, seed=4)
    _check_scores(out, ln.logprobs(eps), eps)
    from safetensors.numpy import load_file

    exported, learner = load_file(str(out / "model.safetensors")), ln.export_weights()
    assert set(exported) == set(learner) and all(np.array_equal(exported[k], learner[k]) for k in learner)


_TP2_WORKER = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    rank, port, folder, ck, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    import numpy as np, torch, torch.distributed as dist
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # the test shim (tests/test_megatron.py)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    from safetensors.numpy import save_file
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.types import Episode, Segment
    rng = np.random.default_rng(0)
    ln = make_learner("megatron", folder, LearnerConfig(lr=1e-2, micro_batch_tokens=64), tensor_parallel=2)
    eps = [Episode(rng.integers(0, ln.vocab_size, 5), [Segment("model", rng.integers(0, ln.vocab_size, 9),
           np.full(9, -1.0, np.float32))], 0.0) for _ in range(4)]
    ln.train_step(eps, np.array([1.0, -1.0, 0.5, -0.5]))
    ln.save_checkpoint(ck)
    lps = ln.logprobs(eps)
    if rank == 0:
        save_file({f"lp{i}": x for i, x in enumerate(lps)}, out)
    dist.destroy_process_group()  # gloo's threads joined before exit (else, rarely: "terminate called ...")
""")


def test_tensor_parallel_checkpoint_merges_into_one_folder(tmp_path):
    """Two gloo ranks, tensor parallel 2, an odd vocabulary (padded): the shards merge exactly."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    folder = build_tiny(tmp_path / "m", TEXTS, TinyConfig(**{**TINY, "vocab_size": 399}, tie_word_embeddings=False))
    port, ck, lps = _free_port(), tmp_path / "ck", tmp_path / "lps.safetensors"
    procs = [subprocess.Popen([sys.executable, "-c", _TP2_WORKER, str(r), str(port), str(folder), str(ck), str(lps)],
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    with safe_open(str(ck / "rank00001.safetensors"), "pt") as h:
        assert h.metadata() == {"tp_rank": "1", "pp_rank": "0", "dp_rank": "0"}
    out = export_checkpoint(ck, tmp_path / "hf", model_dir=folder)
    rng = np.random.default_rng(0)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    eps = [Episode(rng.integers(0, vocab, 5), [Segment("model", rng.integers(0, vocab, 9),
           np.full(9, -1.0, np.float32))], 0.0) for _ in range(4)]
    got = load_file(str(lps))
    _check_scores(out, [got[f"lp{i}"] for i in range(4)], eps)
