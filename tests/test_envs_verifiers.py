"""verifiers environments by name (``verifiers:<module>``, stoa.envs.vf): the example package in
examples/verifiers_env (arithmetic, single turn; a guessing game, multi-turn) through check_env,
played by a real tiny-model engine and replayed exactly by the trainer's Replayer; what is refused
and why; a reward function that raises is an error. Skipped without verifiers 0.3
(``pip install 'stoa[verifiers]'``)."""

from __future__ import annotations

import copy
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="needs verifiers: pip install 'stoa[verifiers]'")

import stoa.envs  # noqa: E402
from stoa.envs import check_env  # noqa: E402
from stoa.envs.vf import RewardError, version  # noqa: E402

if version() >= (0, 4):
    pytest.skip("verifiers 0.4 has no classic API (its tasksets: tests/test_envs_verifiers_v1.py)",
                allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verifiers_env"
if importlib.util.find_spec("stoa_vf_example") is None:  # not pip-installed: the checkout's copy
    sys.path.insert(0, str(EXAMPLE))

ARITH, GUESS = "verifiers:stoa_vf_example", "verifiers:stoa_vf_example.guess"

VARIANTS = '''
import verifiers as vf
from datasets import Dataset

ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]


def load_environment(kind="plain"):
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct(completion, answer, parser) -> float:
        return float(parser.parse_answer(completion) == answer)

    async def later(completion, answer, parser) -> float:  # an async reward function
        return 0.5 * float(parser.parse_answer(completion) == answer)

    def broken(completion) -> float:
        raise KeyError("no such field")

    def ranked(completions) -> list[float]:  # a group-level reward function
        return [float(i) for i, _ in enumerate(completions)]

    funcs = {"plain": [correct, later], "raises": [correct, broken], "group": [correct, ranked]}.get(kind, [correct])
    rubric = vf.Rubric(funcs=funcs, parser=parser)
    extra = {}
    if kind == "math":
        rubric = vf.MathRubric()
    if kind == "judge":
        from openai import AsyncOpenAI

        rubric = vf.JudgeRubric(judge_client=AsyncOpenAI(api_key="unused", base_url="http://127.0.0.1:9"))
    if kind == "tools":
        def add(a: int, b: int) -> int:
            """Add two numbers."""
            return a + b

        return vf.ToolEnv(dataset=Dataset.from_list(ROWS), tools=[add], rubric=rubric)
    if kind == "other":
        return vf.MultiTurnEnv.__subclasses__  # not an environment at all
    return vf.SingleTurnEnv(dataset=Dataset.from_list(ROWS), parser=parser, rubric=rubric, **extra)
'''


@pytest.fixture
def variants(tmp_path, monkeypatch):
    (tmp_path / "vf_variants.py").write_text(textwrap.dedent(VARIANTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("vf_variants", None)
    return "verifiers:vf_variants"


def test_both_example_environments_pass_check_env():
    check_env(ARITH)
    check_env(GUESS)
    check_env(ARITH, split="test")
    assert stoa.envs.provider(ARITH).distribution == "verifiers"


def test_arithmetic_prompt_and_reward():
    env = stoa.envs.make(ARITH)
    prompt, info = env.reset(options={"index": 0})
    assert prompt.startswith("Work out the sum.") and prompt.endswith("What is 24 + 48?")
    assert info["gold_answers"] == ["72"] and env.unwrapped.replayable and env.unwrapped.stop_strings == ()
    obs, reward, term, trunc, info = env.step("It is <answer>72</answer>")
    assert (obs, reward, term, trunc) == ("", 1.0, True, False)
    assert info["metrics"]["correct"] == 1.0 and info["metrics"]["stop_condition"] == "max_turns_reached"
    with pytest.raises(RuntimeError):
        env.step("again")


def test_the_guessing_game_plays_turn_by_turn_to_the_end():
    env = stoa.envs.make(GUESS)
    prompt, info = env.reset(options={"index": 0})
    secret = int(info["gold_answers"][0])
    assert "Guess it" in prompt and env.unwrapped.stop_strings == ("</guess>",)
    lo, hi, turns = 1, 20, 0
    while True:
        guess = (lo + hi) // 2
        obs, reward, term, trunc, info = env.step(f"<guess>{guess}</guess>")
        turns += 1
        if term or trunc:
            break
        assert obs in ("\nHigher.\n", "\nLower.\n") and reward == 0.0
        assert info["metrics"] == {"found": 0.0, "num_turns": float(turns), "stop_condition": ""}
        lo, hi = (guess + 1, hi) if obs == "\nHigher.\n" else (lo, guess - 1)
    assert term and not trunc and obs == "" and guess == secret
    assert reward == pytest.approx(1.0 - 0.1 * (turns - 1))
    assert info["metrics"]["stop_condition"] == "has_final_env_response"
    env.reset(options={"index": 0})
    for _ in range(5):
        out = env.step("<guess>0</guess>" if secret != 0 else "<guess>21</guess>")
    assert out[3] and out[1] == 0.0 and out[4]["metrics"]["stop_condition"] == "max_turns_reached"


@pytest.mark.parametrize("env_id", [ARITH, GUESS])
def test_episodes_of_a_real_engine_replay_exactly(tiny_model, env_id):
    pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine
    from stoa.fleet.trust.replay import Replayer

    make_env = lambda: stoa.envs.make(env_id)  # noqa: E731
    engine = make_engine(tiny_model, "mlx", config=EngineConfig(max_batch=8))
    caps = dict(max_turn_tokens=16, max_episode_tokens=400)
    eps = engine.rollout(make_env, [RolloutRequest(i, f"g{i}", 2) for i in range(3)], SamplingConfig(**caps, seed=4))
    assert len(eps) == 6 and all("stop_condition" in e.metrics for e in eps)
    if env_id == GUESS:
        assert max(e.metrics.get("num_turns", 0) for e in eps) > 1  # the game went on past one turn
    replayer = Replayer(make_env, engine.codec, **caps)
    assert replayer.check_all(eps) == []
    forged = copy.deepcopy(eps)
    forged[0].reward += 1.0
    assert [i for i, _ in replayer.check_all(forged)] == [0]


@pytest.mark.parametrize("kind, reason", [
    ("group", "group-level reward function 'ranked'"),
    ("tools", "tools (tool_defs)"),
    ("other", "not a verifiers MultiTurnEnv"),
    ("math", "time-limited scoring (MathRubric"),
    ("judge", "an LLM judge (JudgeRubric)"),
])
def test_a_refused_environment_names_its_reason(variants, kind, reason):
    with pytest.raises(ValueError, match="is refused") as e:
        stoa.envs.make(variants, kind=kind)
    assert reason in str(e.value)
    if kind in ("math", "judge"):  # unreplayable: accepted on request, and then not replayed
        assert "accept_unreplayable" in str(e.value)
        env = stoa.envs.make(variants, kind=kind, accept_unreplayable=True)
        assert env.unwrapped.replayable is False
    else:  # unsupported: refused either way
        with pytest.raises(ValueError, match="is refused"):
            stoa.envs.make(variants, kind=kind, accept_unreplayable=True)


def test_train_check_refuses_before_anything_starts(variants):
    from stoa.fleet.config import ConfigError, RunConfig, check_runnable

    def cfg(**kwargs):
        return RunConfig.from_dict({"name": "vf", "env": {"id": variants, "kwargs": kwargs}})

    with pytest.raises(ConfigError, match="LLM judge"):
        check_runnable(cfg(kind="judge"))
    check_runnable(cfg(kind="plain"))
    with pytest.raises(ConfigError, match="no installed module"):
        check_runnable(RunConfig.from_dict({"name": "vf", "env": {"id": "verifiers:no_such_env_module"}}))


def test_reward_functions_async_and_raising(variants):
    env = stoa.envs.make(variants, kind="plain")
    env.reset(options={"index": 2})
    _, reward, *_, info = env.step("<answer>3</answer>")
    assert reward == 1.5 and info["metrics"]["later"] == 0.5  # sync 1.0 + async 0.5, both weight 1
    env = stoa.envs.make(variants, kind="raises")
    env.reset(options={"index": 0})
    with pytest.raises(RewardError, match="reward function 'broken' raised KeyError"):
        env.step("<answer>1</answer>")


def test_a_multi_turn_environment_needs_stop_strings(variants):
    with pytest.raises(ValueError, match="needs stop strings"):
        stoa.envs.make(GUESS, stop_strings=[])
    assert stoa.envs.make(GUESS, stop_strings=["</guess>", "\n"]).unwrapped.stop_strings == ("</guess>", "\n")


_FLEET = """
name = "vf"
seed = 1

[model.tiny]
vocab_size = 400
hidden_size = 64
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 128

[env]
id = "verifiers:stoa_vf_example"
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


@pytest.mark.slow
def test_stoa_train_runs_the_example_through_the_fleet_with_replay(tmp_path):
    """`stoa train` on the arithmetic example: a tiny model built from the task's texts, one worker,
    every episode replayed by the trainer through the adapter, none refused (~40 s)."""
    from helpers import train_with_package

    train = train_with_package(tmp_path, "vf", _FLEET, EXAMPLE)
    assert len(train) == 3
    last = train[-1]
    assert {"rollout/correct", "rollout/format_reward_func"} <= set(last)
    assert last["trust/episodes_replayed"] >= 24 and last["trust/rejected_batches"] == 0
