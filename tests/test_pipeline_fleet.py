"""A 2-stage pipeline in a real fleet: `stoa trainer`, `stoa worker --stages 2` (the driver,
stage 0) and `stoa stage --stage 1/2`, separate processes meeting in a store, each under a
memory cap that one whole-model worker would exceed. Every trust check stays on: the trainer
re-derives the pipeline's episodes with the whole model as for any worker."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from stoa.fleet.run import fetch_run
from stoa.transport.chain import WeightSubscriber

from helpers import tiny_fleet_config
from test_fleet import Fleet, check_accounting, trained_groups

pytest.importorskip("torch", reason="the pipeline stages run the torch engine")
pytestmark = pytest.mark.slow


def start(tmp: Path, steps: int) -> Fleet:
    cfg = tmp / "pipe.toml"
    cfg.write_text(tiny_fleet_config("pipe", model={"tiny": {"num_layers": 2, "hidden_size": 128}},
                                     rollout={"engine": "torch"}, trainer={"steps": steps}))
    return Fleet(tmp, cfg)


def key_of(path: Path) -> str:
    """The key id of the key at ``path`` (made now when absent, as the process would at its start)."""
    from stoa.transport.identity import load_or_create_worker_key
    from stoa.transport.signing import key_id

    return key_id(load_or_create_worker_key(path).public_key())


def stage(f: Fleet, cap: float, name: str = "stage1", pipeline: str = "p0") -> object:
    return f._spawn(["stage", "--stage", "1/2", "--store", str(f.store_dir), "--run", f.cfg.name, "--public-key",
                     str(f.pub), "--cache", str(f.tmp / "cache" / name), "--max-memory-mb", f"{cap:.4f}",
                     "--pipeline", pipeline, "--driver-key", key_of(f.tmp / "cache" / "driver" / "worker.key")],
                    f"{name}.log")


def driver(f: Fleet, cap: float) -> object:
    return f.worker("driver", "--stages", "2", "--max-memory-mb", f"{cap:.4f}", "--stage-keys",
                    key_of(f.tmp / "cache" / "stage1" / "stage.key"))


def memory_cap(f: Fleet) -> tuple[float, float, float]:
    """(largest stage's need, the cap, the whole model's need) in MiB, measured on the published
    weights: the cap lies between, so one whole-model worker would be over it."""
    from stoa.backends.torch.pipeline import Stage, split_layers

    f.wait_for(lambda: WeightSubscriber(f.store, f.cfg.name, f.pub).head() is not None, what="the first weights")
    cfg, model_dir = fetch_run(f.store, f.cfg.name, f.pub, f.tmp / "probe")
    state = WeightSubscriber(f.store, f.cfg.name, f.pub).sync(None).state
    rc = cfg.rollout

    def need(part):
        return Stage(model_dir, part, state, rc.engine_mode).memory().total(rc.max_batch, rc.max_episode_tokens) / 2**20

    stages, whole = max(need(p) for p in split_layers(2, 2)), need((0, 2))
    return stages, (stages + whole) / 2, whole


def check_run(f: Fleet) -> list[str]:
    """The run's integrity: nothing quarantined, nobody banned, no group trained twice, and every
    batch the driver uploaded was trained on, checked as probation work, dropped with a reason in
    the ledger, or is still waiting for the trainer: none vanished."""
    st, run = f.store, f.cfg.name
    assert st.list(f"{run}/quarantine/") == [], st.list(f"{run}/quarantine/")
    assert st.list(f"{run}/bans/") == []
    trained = trained_groups(f.ledger())
    assert trained and len(trained) == len(set(trained)), trained
    check_accounting(f, ("driver",))
    return trained


def test_a_two_stage_pipeline_trains_under_a_memory_cap(tmp_path):
    f = start(tmp_path, steps=4)
    try:
        trainer = f.trainer()
        stages, cap, whole = memory_cap(f)
        assert stages < cap < whole
        st, drv = stage(f, cap), driver(f, cap)
        small = stage(f, stages / 2, "small", "p-small")  # a cap under the stage's need: refused at start
        assert f.wait(small, 120) == 2 and "over --max-memory-mb" in f.log("small.log"), f.log("small.log")[-2000:]
        assert f.wait(trainer, 240) == 0, f.log("trainer.log")[-3000:]
        assert f.wait(drv, 60) == 0, f.log("driver.log")[-3000:]
        assert f.wait(st, 60) == 0, f.log("stage1.log")[-3000:]
        trained = check_run(f)
        assert len(f.rows("train")) == 4 and len(trained) >= 8
        log = f.log("driver.log")
        assert "drives pipeline p0: stage 0 of 2" in log and "0 cohorts dropped" in log, log[-2000:]
        assert "peak RSS" in f.log("stage1.log")
    finally:
        f.close()


def test_a_stage_killed_mid_run_costs_no_accepted_work_and_no_ban(tmp_path):
    f = start(tmp_path, steps=6)
    try:
        trainer = f.trainer()
        _, cap, _ = memory_cap(f)
        st, drv = stage(f, cap), driver(f, cap)
        hb = f"{f.cfg.name}/workers/driver.json"
        f.wait_for(lambda: f.store.exists(hb) and b"generating" in f.store.get(hb), what="the driver to generate")
        time.sleep(float(np.random.default_rng(0).uniform(0.0, 0.3)))
        st.send_signal(signal.SIGKILL)
        st.wait()
        st = stage(f, cap)
        assert f.wait(trainer, 300) == 0, f.log("trainer.log")[-3000:]
        assert f.wait(drv, 60) == 0, f.log("driver.log")[-3000:]
        check_run(f)
        assert len(f.rows("train")) == 6
        log = f.log("driver.log")
        assert log.count("connected stage 1") >= 2, log[-3000:]  # the restarted stage was found again
    finally:
        f.close()


LIAR = """
import logging, sys
import numpy as np
from pathlib import Path
from stoa.fleet.stages.server import StageServer
from stoa.transport.frames import Frame
from stoa.transport.store import LocalStore

class Liar:
    '''Serves its layers, then adds noise to every hidden state it answers (and signs it).'''
    def __init__(self, service):
        self.service = service
    def reset(self):
        self.service.reset()
    def handle(self, f):
        out = self.service.handle(f)
        if out is not None and out.arrays and out.arrays[0].ndim == 3:
            y = out.arrays[0]
            out = Frame(out.op, out.meta, (y + 0.5 * y.std() * np.random.default_rng(0).standard_normal(y.shape, np.float32),))
        return out

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
store, run, pub, cache, driver_key = sys.argv[1:]
sys.exit(StageServer(LocalStore(store), run, pub, "p0", 1, 3, Path(cache), driver_keys=[driver_key],
                     wrap_service=Liar).run())
"""


def test_a_stage_computing_wrong_activations_is_named_and_dropped_and_the_driver_is_not_banned(tmp_path):
    """A 3-stage pipeline whose middle stage (a process with an accepted key, its share hashes the
    signed ones) adds noise to its activations and signs them: the driver's spot check recomputes
    the stage from the cohort's signed transcript before the upload, names it, drops it and refuses
    its key; no batch of it is uploaded, the driver's key is not banned, and an honest stage in its
    place finishes the run."""
    import subprocess
    import sys

    from test_fleet import env

    cfg = tmp_path / "pipe.toml"
    cfg.write_text(tiny_fleet_config("pipe", model={"tiny": {"num_layers": 3, "hidden_size": 128}},
                                     rollout={"engine": "torch"}, trainer={"steps": 3}))
    f = Fleet(tmp_path, cfg)
    try:
        trainer = f.trainer()
        dkey = key_of(f.tmp / "cache" / "driver" / "worker.key")
        liar_cache = f.tmp / "cache" / "liar"
        liar_key, honest_key = key_of(liar_cache / "stage.key"), key_of(f.tmp / "cache" / "honest" / "stage.key")
        liar = subprocess.Popen([sys.executable, "-c", LIAR, str(f.store_dir), f.cfg.name, str(f.pub), str(liar_cache),
                                 dkey], env=env(), stdout=open(f.tmp / "liar.log", "ab"), stderr=subprocess.STDOUT)
        f.procs.append(liar)
        last = f._spawn(["stage", "--stage", "2/3", "--store", str(f.store_dir), "--run", f.cfg.name, "--public-key",
                         str(f.pub), "--cache", str(f.tmp / "cache" / "stage2"), "--pipeline", "p0", "--driver-key", dkey],
                        "stage2.log")
        drv = f.worker("driver", "--stages", "3", "--stage-keys",
                       ",".join([liar_key, honest_key, key_of(f.tmp / "cache" / "stage2" / "stage.key")]))
        f.wait_for(lambda: "computed outputs its layers do not make" in f.log("driver.log"), timeout=300,
                   what="the driver to blame the lying stage")
        f.wait_for(lambda: f"stage 1's key {liar_key} was blamed" in f.log("driver.log"), timeout=60,
                   what="the driver to refuse the liar's announcement")
        liar.kill()  # its operator's move: a liar left running squats the announcement (a writer can stall a pipeline)
        liar.wait()
        honest = f._spawn(["stage", "--stage", "1/3", "--store", str(f.store_dir), "--run", f.cfg.name, "--public-key",
                           str(f.pub), "--cache", str(f.tmp / "cache" / "honest"), "--pipeline", "p0", "--driver-key",
                           dkey], "honest.log")
        assert f.wait(trainer, 400) == 0, f.log("trainer.log")[-3000:]
        assert f.wait(drv, 60) == 0, f.log("driver.log")[-3000:]
        for p in (honest, last):
            f.wait(p, 60)
        check_run(f)  # nothing quarantined, nobody banned, every uploaded batch accounted for
        log = f.log("driver.log")
        assert f"stage 1 (key {liar_key}) computed outputs" in log, log[-3000:]
        assert log.count("computed outputs its layers do not make") == 1
    finally:
        f.close()
