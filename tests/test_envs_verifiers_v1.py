"""verifiers tasksets by name (``verifiers:<module>``, stoa.envs.vf_v1): the example taskset in
examples/verifiers_v1_env through check_env, right and wrong answers scored by ``Task.score``,
episodes of a real tiny-model engine replayed exactly by the trainer's Replayer, what is refused
and why, a reward that raises is an error, and ``stoa train`` through the fleet.

Each test runs under the ``verifiers.v1`` this process imports (verifiers 0.3 ships it as a
preview of 0.4's API), and :func:`test_the_same_tests_pass_under_verifiers_0_4` runs this whole
file again under verifiers 0.4 itself, in a subprocess whose ``PYTHONPATH`` puts a ``pip install
--target`` of 0.4 (and the versions of openai and mcp it needs) first: 0.4 cannot share a venv with
0.3. scripts/setup.sh makes that folder (``$VENV/verifiers-0.4``; ``STOA_VERIFIERS_0_4`` names
another); without it that test skips, saying so.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="needs verifiers (0.4, or 0.3's preview of verifiers.v1): "
                                           "pip install 'stoa[verifiers]'")

import stoa.envs  # noqa: E402
from stoa.envs import check_env  # noqa: E402
from stoa.envs.vf import RewardError, version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "verifiers_v1_env"
if importlib.util.find_spec("stoa_vf_v1_example") is None:  # not pip-installed: the checkout's copy
    sys.path.insert(0, str(EXAMPLE))

SUMS = "verifiers:stoa_vf_v1_example"
V04 = Path(os.environ.get("STOA_VERIFIERS_0_4") or Path(sys.prefix) / "verifiers-0.4")

_COMMON = '''
import verifiers.v1 as vf


class QData(vf.TaskData):
    answer: str


def questions(task_cls, config, **data):
    return [task_cls(QData(prompt=f"What is {i} + 1?", answer=str(i + 1), **data), config) for i in range(6)]


def said(trace):
    return trace.last_reply.removeprefix("<answer>").removesuffix("</answer>")
'''

VARIANTS = {
    # rewards that raise, or use a judge, a runtime, tools, a clock; a multi-agent env
    "v1_raises": '''
class T(vf.Task[QData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(said(trace) == self.data.answer)

    @vf.reward(weight=0.0)
    async def broken(self, trace) -> float:
        raise KeyError("no such field")


class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return questions(T, self.config.task)
''',
    "v1_judge": '''
class Correct(vf.Judge):
    prompt = "Question: {question}\\nAnswer: {answer}\\nResponse: {response}\\nCorrect? yes/no"


class TC(vf.TaskConfig):
    judge: vf.JudgeConfig = vf.JudgeConfig(base_url="http://127.0.0.1:9")


class T(vf.Task[QData, vf.State, TC]):
    @vf.reward
    async def correct(self, trace) -> float:
        verdict = await Correct(self.config.judge).evaluate(trace=trace, question=self.data.prompt_text,
                                                            answer=self.data.answer, response=trace.last_reply)
        return float(verdict.text.strip().lower().startswith("yes"))


class C(vf.TasksetConfig):
    task: TC = TC()


class S(vf.Taskset[T, C]):
    def load(self):
        return questions(T, self.config.task)
''',
    "v1_runtime": '''
class T(vf.Task[QData]):
    @vf.reward
    async def correct(self, trace, runtime) -> float:
        return float((await runtime.read("/answer.txt")).decode() == self.data.answer)


class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return questions(T, self.config.task)
''',
    "v1_tools": '''
class Calculator(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two numbers."""
        return a + b


class T(vf.Task[QData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(said(trace) == self.data.answer)

    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]


class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return questions(T, self.config.task)
''',
    "v1_timed": '''
class T(vf.Task[QData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(vf.verify_boxed_math_answer(trace.last_reply, self.data.answer))


class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return questions(T, self.config.task, timeout=vf.TaskTimeout(scoring=5))
''',
    "v1_sync": '''
class T(vf.Task[QData]):
    @vf.reward
    def correct(self, trace) -> float:
        return float(said(trace) == self.data.answer)


class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return questions(T, self.config.task)
''',
    "v1_two_agents": '''
class T(vf.Task[QData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(said(trace) == self.data.answer)


class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return questions(T, self.config.task)


class TwoConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    checker: vf.AgentConfig = vf.AgentConfig()


class Two(vf.Env[TwoConfig]):
    async def run(self, task, agents):
        await agents.solver.run(task)
        await agents.checker.run(task)
''',
}


@pytest.fixture
def variants(tmp_path, monkeypatch):
    """Each variant a taskset module, as ``verifiers:<name>``."""
    (tmp_path / "v1_common.py").write_text(textwrap.dedent(_COMMON))
    for name, body in VARIANTS.items():
        exported = ["S", "Two"] if "class Two" in body else ["S"]
        (tmp_path / f"{name}.py").write_text(f"from v1_common import *  # noqa\n{textwrap.dedent(body)}\n"
                                             f"__all__ = {exported!r}\n")
        sys.modules.pop(name, None)
    monkeypatch.syspath_prepend(str(tmp_path))
    return lambda name: f"verifiers:{name}"


def test_the_example_passes_check_env():
    check_env(SUMS)
    check_env(SUMS, split="test", num_eval=5)
    assert stoa.envs.provider(SUMS).distribution == "verifiers"


def test_right_and_wrong_answers_are_scored_by_the_task():
    env = stoa.envs.make(SUMS, few_shot=True)
    prompt, info = env.reset(options={"index": 0})
    assert prompt == ("Work out the sum. Write the result as <answer>number</answer>.\n\nUser: What is 2 + 3?"
                      "\n\nAssistant: <answer>5</answer>\n\nWhat is 24 + 48?")
    assert info["gold_answers"] == ["72"] and env.unwrapped.replayable and env.unwrapped.stop_strings == ()
    assert env.step("It is <answer>72</answer>") == ("", 1.0, True, False,
                                                     {"metrics": {"correct": 1.0, "formatted": 1.0}})
    with pytest.raises(RuntimeError):
        env.step("again")
    env.reset(options={"index": 0})
    assert env.step("<answer>71</answer>")[1:] == (0.0, True, False, {"metrics": {"correct": 0.0, "formatted": 1.0}})
    env.reset(options={"index": 0})
    assert env.step("72")[1:] == (0.0, True, False, {"metrics": {"correct": 0.0, "formatted": 0.0}})
    prompt, _ = stoa.envs.make(SUMS).reset(options={"index": 0})  # a text prompt: system, then the question
    assert prompt == "Work out the sum. Write the result as <answer>number</answer>.\n\nWhat is 24 + 48?"


def test_splits_reach_the_taskset_config_and_typos_are_refused():
    train = stoa.envs.make(SUMS, num_train=7, num_eval=3)
    test = stoa.envs.make(SUMS, num_train=7, num_eval=3, split="test")
    assert (len(train.unwrapped), len(test.unwrapped)) == (7, 3)
    with pytest.raises(ValueError, match="could not load the taskset.*num_trian"):
        stoa.envs.make(SUMS, num_trian=7)


def test_episodes_of_a_real_engine_replay_exactly(tiny_model):
    pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine
    from stoa.fleet.trust.replay import Replayer

    make_env = lambda: stoa.envs.make(SUMS)  # noqa: E731
    engine = make_engine(tiny_model, "mlx", config=EngineConfig(max_batch=8))
    caps = dict(max_turn_tokens=16, max_episode_tokens=400)
    eps = engine.rollout(make_env, [RolloutRequest(i, f"g{i}", 2) for i in range(3)], SamplingConfig(**caps, seed=4))
    assert len(eps) == 6 and all({"correct", "formatted"} <= set(e.metrics) for e in eps), eps[0].metrics
    replayer = Replayer(make_env, engine.codec, **caps)
    assert replayer.check_all(eps) == []
    forged = copy.deepcopy(eps)
    forged[0].reward += 1.0
    forged[1].metrics["formatted"] = 1.0 - forged[1].metrics["formatted"]
    assert [i for i, _ in replayer.check_all(forged)] == [0, 1]


@pytest.mark.parametrize("name, kwargs, reason, replayable_on_request", [
    ("v1_judge", {}, "an LLM judge (a JudgeConfig at task.judge)", True),
    ("v1_judge", {}, "an LLM judge ('correct' uses Correct)", True),
    ("v1_raises", {"task": {"judges": [{"id": "reference"}]}}, "an LLM judge (judges: reference)", True),
    ("v1_timed", {}, "time-limited scoring (timeout.scoring = 5 s)", True),
    ("v1_timed", {}, "'correct' calls verify_boxed_math_answer", True),
    ("v1_runtime", {}, "'correct' needs a runtime", False),
    ("v1_tools", {}, "tools (toolsets)", False),
    ("v1_sync", {}, "'correct' is not async", False),
    ("v1_two_agents", {}, "its Env is Two, not SingleAgentEnv", False),
])
def test_a_refused_taskset_names_its_reason(variants, name, kwargs, reason, replayable_on_request):
    with pytest.raises(ValueError, match="is refused") as e:
        stoa.envs.make(variants(name), **kwargs)
    assert reason in str(e.value)
    if replayable_on_request:  # unreplayable: accepted on request, and then not replayed
        assert "accept_unreplayable" in str(e.value)
        env = stoa.envs.make(variants(name), accept_unreplayable=True, **kwargs)
        assert env.unwrapped.replayable is False
    else:  # unsupported: refused either way
        with pytest.raises(ValueError, match="is refused"):
            stoa.envs.make(variants(name), accept_unreplayable=True, **kwargs)


def test_a_reward_that_raises_is_an_error(variants):
    env = stoa.envs.make(variants("v1_raises"))
    env.reset(options={"index": 0})
    with pytest.raises(RewardError, match="reward function 'broken' raised KeyError"):
        env.step("<answer>1</answer>")


def test_train_check_refuses_a_judge_before_anything_starts(variants):
    from stoa.fleet.config import ConfigError, RunConfig, check_runnable

    def cfg(name):
        return RunConfig.from_dict({"name": "vf", "env": {"id": variants(name)}})

    with pytest.raises(ConfigError, match="LLM judge"):
        check_runnable(cfg("v1_judge"))
    check_runnable(cfg("v1_raises"))


@pytest.mark.skipif(version() < (0, 4), reason="verifiers 0.3 also plays classic environments")
def test_a_classic_environment_is_refused_under_0_4(tmp_path, monkeypatch):
    (tmp_path / "classic_env.py").write_text("def load_environment(**kwargs):\n    raise AssertionError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="a classic environment .load_environment.*verifiers<0.4"):
        stoa.envs.make("verifiers:classic_env")


_FLEET = """
name = "vf1"
seed = 1

[model.tiny]
vocab_size = 400
hidden_size = 64
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 128

[env]
id = "verifiers:stoa_vf_v1_example"
kwargs = { num_train = 40, num_eval = 8, max_operand = 9 }

[rollout]
group_size = 4
groups_per_cohort = 2
max_turn_tokens = 16
max_episode_tokens = 128
max_batch = 8

[trainer]
steps = 3
groups_per_step = 2
threads = 1
skip_zero_variance_groups = false

[eval]
every = 100
num_questions = 4
samples = 1

[trust]
reward_range = [0.0, 1.0]

[fleet]
workers = 1
"""


def _has_0_4() -> bool:
    return (V04 / "verifiers" / "v1").is_dir()


@pytest.mark.slow
def test_stoa_train_runs_the_example_through_the_fleet_with_replay(tmp_path):
    """`stoa train` on the example taskset: a tiny model built from the task's texts, one worker,
    every episode replayed by the trainer through the adapter, none refused (~40 s)."""
    if version() < (0, 4) and _has_0_4():
        pytest.skip("runs under verifiers 0.4, in test_the_same_tests_pass_under_verifiers_0_4")
    from helpers import train_with_package

    train = train_with_package(tmp_path, "vf1", _FLEET, EXAMPLE)
    assert len(train) == 3
    last = train[-1]
    assert {"rollout/correct", "rollout/formatted"} <= set(last)
    assert last["trust/episodes_replayed"] >= 24 and last["trust/rejected_batches"] == 0


@pytest.mark.skipif(version() >= (0, 4), reason="this process runs verifiers 0.4 already")
def test_the_same_tests_pass_under_verifiers_0_4(request):
    """This file again, under the verifiers 0.4 install beside the venv (~1 min; with the fleet
    test when this run includes slow tests)."""
    if not _has_0_4():
        pytest.skip(f"no verifiers 0.4 install at {V04}: scripts/setup.sh makes it (pip install --target; "
                    "STOA_SKIP_VERIFIERS=1 skips it), or set STOA_VERIFIERS_0_4 to such a folder")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(V04), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    marks = request.config.getoption("markexpr")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist", __file__,
           *(["-m", marks] if marks else [])]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, out
    assert "PASSED tests/test_envs_verifiers_v1.py::test_a_classic_environment_is_refused_under_0_4" in out, out
