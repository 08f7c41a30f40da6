"""The trainer on several ranks (CPU, gloo): Megatron TP=2 and DP=2, equivalence, a fleet, kill -9.

Every multi-rank process here is a real process: the learner checks start two ranks of
``tests/_multirank_learner.py`` (rank 0 drives the mirrored learner of ``stoa.fleet.trainer.distributed``,
rank 1 follows it); the fleet checks run ``torchrun --nproc-per-node 2`` of the real ``stoa
trainer`` (through ``tests/_cpu_megatron_trainer.py``, which applies the CPU megatron shims)
with a real ``stoa worker``. CPU only: no test here needs a GPU (``benchmarks/gpu_check.sh``
runs the NCCL path).

Equivalence tolerance: after 3 DPPO steps (lr 1e-3, Adam, clipping active) every weight of a
DP=2 or TP=2 run is within 1e-5 of the single-rank run's, i.e. 1% of the most one Adam step
moves a weight (lr). The runs are not bit-identical because float32 sums run in another order:
under DP the two ranks' micro-batch gradients are added by an all-reduce instead of one after
another, under TP each matmul's inner sum is split over the ranks and all-reduced. Gradients
then differ by ~1e-7 relative, and Adam (which divides by sqrt(v)) turns that into at most a
few 1e-6 on weights whose gradient is near zero; measured: 3e-7 (DP), 2e-6 (TP).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from stoa.fleet.config import ConfigError, RunConfig, load_config

from helpers import tiny_fleet_config

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TINY = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
TEXTS = [f"protein P{i} binds receptor R{i % 7} in cell line C{i % 5}; <search> P{i} </search>" for i in range(200)]
TOLERANCE = 1e-5


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    return {**env, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- config ---------------------------------------------------------------------------------------


def test_learner_megatron_section_is_typed_and_checked(tmp_path):
    """``[learner.megatron]`` is MegatronOptions: unknown keys and bad values fail at load, naming the key."""
    path = tmp_path / "run.toml"
    path.write_text('[learner]\nkind = "megatron"\n[learner.megatron]\ntensor_parallel = 2\ntimeout_s = 60\n')
    cfg = load_config(path)
    assert (cfg.learner.megatron.tensor_parallel, cfg.learner.megatron.timeout_s) == (2, 60)
    assert RunConfig.from_dict(json.loads(cfg.to_json())) == cfg
    for override, needle in [({"learner.megatron.tensor_paralel": 2}, "learner.megatron.tensor_paralel"),
                             ({"learner.megatron.tensor_parallel": 0}, "tensor_parallel"),
                             ({"learner.megatron.attention": "flash"}, "learner.megatron.attention"),
                             ({"learner.megatron.timeout_s": "1h"}, "learner.megatron.timeout_s"),
                             ({"learner.kind": "torch"}, "learner.kind")]:  # options of a learner not in use
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            load_config(path, override)


def test_control_messages_round_trip_and_unmirrored_calls_are_refused():
    from types import SimpleNamespace

    from stoa.fleet.trainer.distributed import LeaderLearner, Message

    m = Message("train_step", {"episode_bytes": 2, "objective": {"kind": "x", "cap": float("inf")}}, b"\x00\x01")
    assert Message.decode(m.encode()) == m
    leader = LeaderLearner(None, SimpleNamespace(vocab_size=7, gradients=lambda *a: None))
    assert leader.vocab_size == 7
    with pytest.raises(AttributeError, match="not mirrored"):  # rank 0 alone would leave the others out
        leader.gradients


# -- the learner on two ranks ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from stoa.models.tiny import TinyConfig, build_tiny

    return build_tiny(tmp_path_factory.mktemp("m"), TEXTS, TinyConfig(**TINY))


def _learner_job(model: Path, out: Path, world: int, tp: int) -> Path:
    """3 RL steps through rank 0's mirrored learner on ``world`` CPU ranks; returns ``out``."""
    out.mkdir(parents=True)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(TESTS / "_multirank_learner.py"), str(model), str(out), str(tp)],
                              env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port)), stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errs)
    return out


@pytest.fixture(scope="module")
def single_rank(model_dir, tmp_path_factory) -> Path:
    return _learner_job(model_dir, tmp_path_factory.mktemp("ref") / "out", 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_two_ranks_match_a_single_rank_run_after_three_rl_steps(layout, model_dir, single_rank, tmp_path):
    from safetensors.numpy import load_file

    out = _learner_job(model_dir, tmp_path / "out", 2, 2 if layout == "tp2" else 1)
    ref, got = load_file(str(single_rank / "weights.safetensors")), load_file(str(out / "weights.safetensors"))
    init = load_file(str(model_dir / "model.safetensors"))
    assert set(got) == set(ref) == set(init)
    assert max(float(np.abs(ref[k] - init[k]).max()) for k in ref) > 100 * TOLERANCE  # the steps really moved
    diff = {k: float(np.abs(got[k] - ref[k]).max()) for k in ref}
    assert max(diff.values()) <= TOLERANCE, sorted(diff.items(), key=lambda kv: -kv[1])[:3]
    m_ref, m_got = (json.loads((d / "metrics.json").read_text()) for d in (single_rank, out))
    for a, b in zip(m_got, m_ref):
        for k in ("loss", "grad_norm", "gate/masked_frac", "tokens", "loss_tokens", "micro_batches"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    assert all(m["grad_norm"] > 0.1 for m in m_ref)  # the clip (0.1) acted: its global norm is checked too

    # Each rank's checkpoint file: DP replicas are identical; under TP, replicated norms agree exactly.
    r0, r1 = (load_file(str(out / "ckpt" / f"rank{r:05d}.safetensors")) for r in (0, 1))
    params = [k for k in r0 if k.startswith("model/")]
    assert json.loads((out / "ckpt" / "meta.json").read_text())["layout"]["world"] == 2
    if layout == "dp2":
        assert all(np.array_equal(r0[k], r1[k]) for k in params)
    else:
        norms = [k for k in params if "layernorm" in k]
        assert norms and all(np.array_equal(r0[k], r1[k]) for k in norms)
        assert not np.array_equal(r0["model/decoder.layers.0.mlp.linear_fc2.weight"],
                                  r1["model/decoder.layers.0.mlp.linear_fc2.weight"])  # shards differ


# -- the fleet: torchrun stoa trainer + a real worker ------------------------------------------------

def fleet_config(steps: int, tp: int) -> str:
    """The fleet tests' run with a 2-layer model (TP=2 splits its 2 kv heads) on the Megatron learner."""
    return tiny_fleet_config("multirank", model={"tiny": {"num_layers": 2, "num_kv_heads": 2}},
                             trainer={"steps": steps},
                             learner={"kind": "megatron", "device": "cpu",
                                      "megatron": {"tensor_parallel": tp, "timeout_s": 120}})


class Job:
    """A ``torchrun`` trainer job of a run plus its workers; kills whatever is left at the end."""

    def __init__(self, tmp: Path, steps: int, tp: int):
        from stoa.transport.signing import generate_private_key, save_keypair

        self.tmp = tmp
        self.config = tmp / "run.toml"
        self.config.write_text(fleet_config(steps, tp))
        self.cfg = load_config(self.config)
        self.store_dir, self.run_dir, self.pids = tmp / "store", tmp / "run", tmp / "pids"
        self.key, self.pub = save_keypair(generate_private_key(), tmp / "keys", "run")
        self.procs: list[subprocess.Popen] = []

    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen:
        p = subprocess.Popen(argv, env=_env(STOA_TEST_PID_DIR=str(self.pids)), stdout=open(self.tmp / log, "ab"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def trainer(self, *extra: str, nproc: int = 2) -> subprocess.Popen:
        return self._spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                            str(TESTS / "_cpu_megatron_trainer.py"), "trainer", str(self.config), "--store",
                            str(self.store_dir), "--key", str(self.key), "--run-dir", str(self.run_dir), *extra],
                           "trainer.log")

    def worker(self, wid: str) -> subprocess.Popen:
        return self._spawn([sys.executable, "-m", "stoa", "worker", "--store", str(self.store_dir), "--run",
                            self.cfg.name, "--public-key", str(self.pub), "--id", wid, "--cache",
                            str(self.tmp / "cache" / wid)], f"{wid}.log")

    def log(self, name: str = "trainer.log") -> str:
        p = self.tmp / name
        return p.read_text(errors="replace") if p.exists() else ""

    def said(self, text: str) -> bool:
        """Whether the trainer's log holds ``text``, across torchrun's rank prefixes and wrapped lines."""
        flat = " ".join(re.sub(r"\[rank\d+\]:", " ", self.log()).replace("│", " ").split())
        return text in flat

    def rows(self, kind: str) -> list[dict]:
        from stoa.fleet.metrics import read_metrics

        path = self.run_dir / "metrics.jsonl"
        return [r for r in read_metrics(path) if r["kind"] == kind] if path.exists() else []

    def ledger(self) -> list[dict]:
        p = self.run_dir / "ledger.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []

    def wait(self, proc: subprocess.Popen, timeout: float = 300) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit in {timeout}s; trainer log:\n{self.log()[-4000:]}") from None

    def wait_for(self, cond, what: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while not cond():
            if time.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}; trainer log:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def trained_groups(ledger: list[dict]) -> list[str]:
    return [g for e in ledger for g in e.get("trained", [])]


@pytest.mark.slow
def test_torchrun_trainer_tp2_with_a_real_worker(tmp_path):
    """`torchrun --nproc-per-node 2 stoa trainer` (TP=2) trains with a worker, checkpoints per rank;
    started again without --resume, rank 0's refusal reaches rank 1, which exits saying why."""
    job = Job(tmp_path, steps=4, tp=2)
    try:
        trainer, worker = job.trainer(), job.worker("w0")
        assert job.wait(trainer) == 0, job.log()[-4000:]
        assert job.wait(worker, 120) == 0, job.log("w0.log")[-3000:]
        trained = trained_groups(job.ledger())
        assert len(trained) == len(set(trained)) == 4 * 2
        assert [r["rl_step"] for r in job.rows("train")] == [1, 2, 3, 4]
        assert [r["version"] for r in job.rows("eval")] == [0, 4]
        warm = [r for r in job.rows("warmstart") if "warmstart/p_final_turn" in r]
        assert [r["phase"] for r in warm] == ["practice", "habit"]  # demonstrations broadcast, scored on 2 ranks
        ck = sorted((job.run_dir / "checkpoints").glob("v*"))[-1]
        assert sorted(p.name for p in ck.iterdir()) == ["meta.json", "rank00000.safetensors", "rank00001.safetensors"]
        meta = json.loads((ck / "meta.json").read_text())
        assert meta["layout"]["tp"] == 2 and meta["layout"]["world"] == 2 and meta["extra"]["rl_step"] == 4
        from stoa.transport.chain import WeightSubscriber
        from stoa.transport.pulse import state_hash
        from stoa.transport.store import LocalStore

        sub = WeightSubscriber(LocalStore(job.store_dir), job.cfg.name, job.pub)
        res = sub.sync(None)
        assert res.version == sub.head() == 4 and state_hash(res.state) == sub.manifest(4).state_hash

        again = job.trainer()  # the run has published weights: rank 0 refuses, rank 1 hears why
        assert job.wait(again, 180) != 0
        assert job.said("rank 1 stops: rank 0 failed: StartRefused") and job.said("already has published weights")
    finally:
        job.close()


@pytest.mark.slow
def test_kill_one_rank_takes_the_job_down_and_resume_continues(tmp_path):
    """kill -9 rank 1 of a DP=2 job mid-run: torchrun ends the job; --resume (2 ranks) trains on with
    no lost or doubled group and new version numbers; a resume on 1 rank is refused by name."""
    job = Job(tmp_path, steps=6, tp=1)
    try:
        trainer = job.trainer()
        workers = [job.worker("w0"), job.worker("w1")]
        job.wait_for(lambda: len(job.rows("train")) >= 3 and (job.pids / "rank1.pid").exists(), "three RL steps")
        os.kill(int((job.pids / "rank1.pid").read_text()), signal.SIGKILL)
        assert job.wait(trainer, 120) != 0  # the whole job went down
        killed_at = max(r["version"] for r in job.rows("train"))

        one = job.trainer("--resume", nproc=1)
        assert job.wait(one, 180) != 0
        assert job.said("was written by 2 rank(s)") and job.said("resume with the same world size")

        resumed = job.trainer("--resume")
        assert job.wait(resumed) == 0, job.log()[-4000:]
        for w in workers:
            assert job.wait(w, 120) == 0
        ledger = job.ledger()
        trained = trained_groups(ledger)
        assert len(trained) == len(set(trained)) == 6 * 2, "a group was lost or trained on twice"
        assert max(e["rl_step"] for e in ledger) == 6
        events = [r for r in job.rows("event") if r.get("event") == "resumed"]
        assert len(events) == 1 and events[0]["version"] > killed_at  # versions never repeat
    finally:
        job.close()
