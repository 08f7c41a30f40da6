"""reasoning-gym datasets through ``reasoning_gym:<dataset>``, and scoring strangers' answers safely."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install 'stoa[reasoning-gym]')")

import stoa.envs  # noqa: E402
from stoa.envs import rgym, rgym_mix  # noqa: E402
from stoa.envs.sandbox import Sandbox, SandboxLimits  # noqa: E402

SMALL = {"seed": 0, "train_size": 6, "test_size": 4}
HOSTILE_LIMITS = {"score_cpu_seconds": 1.0, "score_wall_seconds": 4.0, "max_answer_chars": 2_000_000}


def make(name: str, **kw):
    return stoa.envs.make(f"reasoning_gym:{name}", **{**SMALL, **kw}).unwrapped


def play(env, index: int, turn: str) -> tuple[float, dict]:
    env.reset(options={"index": index})
    _, reward, terminated, _, info = env.step(turn)
    assert terminated
    return reward, info


def gold_turn(env, index: int = 0) -> str:
    (turn,) = env.oracle_turns(index)
    return turn


@pytest.mark.parametrize("name", ["basic_arithmetic", "gcd", "countdown", "string_insertion", "spiral_matrix",
                                  "simple_integration", "graph_color"])
def test_check_env_passes_through_the_adapter(name):
    stoa.envs.check_env(stoa.envs.make(f"reasoning_gym:{name}", **SMALL))


def test_made_by_id_with_reasoning_gyms_prompt_one_turn_and_the_datasets_score():
    env = make("basic_arithmetic")
    prompt, info = env.reset(options={"index": 2})
    assert prompt.startswith("Given a problem, your task is to answer") and "<answer>answer here</answer>" in prompt
    assert env.stop_strings == ("</answer>",) and info["question_id"] == "basic_arithmetic/0/2"
    gold = info["gold_answers"][0]
    obs, reward, terminated, truncated, step_info = env.step(f"<think> easy </think>\n<answer> {gold} </answer>")
    assert (obs, reward, terminated, truncated) == ("", 1.0, True, False)
    assert step_info["metrics"] == {"correct": True, "formatted": True, "score": 1.0, "score_error": ""}
    reward, info = play(env, 2, "no tags at all")
    assert reward == 0.0 and info["metrics"]["formatted"] is False
    with pytest.raises(RuntimeError):
        env.step("<answer> 1 </answer>")


def test_the_seed_is_required_and_bad_names_and_keys_are_refused_clearly():
    with pytest.raises(ValueError, match="needs an int seed"):
        stoa.envs.make("reasoning_gym:basic_arithmetic", train_size=6, test_size=4)
    with pytest.raises(ValueError, match="did you mean reasoning_gym:basic_arithmetic"):
        stoa.envs.make("reasoning_gym:basic_arithmetc", **SMALL)
    with pytest.raises(ValueError, match="refused: a weighted mix"):
        stoa.envs.make("reasoning_gym:composite", **SMALL)
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['max_term'\].*'max_terms'"):
        make("basic_arithmetic", max_term=3)


def test_train_and_test_are_disjoint_ranges_of_one_seeded_sequence():
    config = {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 6}  # few distinct questions
    train = make("gcd", train_size=30, test_size=30, **config)
    test = make("gcd", split="test", train_size=30, test_size=30, **config)
    train_q = {train.reset(options={"index": i})[0] for i in range(len(train))}
    test_q = [test.reset(options={"index": i})[0] for i in range(len(test))]
    assert len(train) == 30 and 1 <= len(test) < 30  # repeats of train questions dropped
    assert not train_q & set(test_q)
    ids = {test.reset(options={"index": i})[1]["question_id"] for i in range(len(test))}
    assert all(int(q.rsplit("/", 1)[1]) >= 30 for q in ids)
    # Why two seeds are not two splits: item i of seed s+1 is item i+1 of seed s.
    shifted = make("basic_arithmetic", seed=1)
    base = make("basic_arithmetic", seed=0)
    assert shifted.reset(options={"index": 0})[0] == base.reset(options={"index": 1})[0]
    assert make("basic_arithmetic").practice_kwargs(1) == {"seed": 10}


def test_pass_at_1_counts_fully_right_answers_only_not_partial_credit():
    env = make("gcd")
    _, info = env.reset(options={"index": 0})
    gold = info["gold_answers"][0]
    reward, info = play(env, 0, f"<answer>{gold} is the gcd</answer>")  # the default scorer's partial credit
    assert 0 < reward < 1 and info["metrics"]["correct"] is False
    # A valid solution other than the gold string is right: score 1.0, not string equality.
    env = make("countdown")
    gold = gold_turn(env)[len("<answer>"):-len("</answer>")]
    reward, info = play(env, 0, f"<answer>({gold})</answer>")
    assert reward == 1.0 and info["metrics"]["correct"] is True
    reward, info = play(env, 0, "<answer>1 + 1</answer>")
    assert reward == 0.05 and info["metrics"]["correct"] is False


def test_oracle_demonstrations_show_the_answer_format():
    env = make("leg_counting")
    assert env.demo_styles == ("oracle",)
    for i in range(len(env)):
        (turn,) = env.demonstration_turns(i, "oracle", np.random.default_rng(0))
        assert turn.startswith("<answer>") and turn.endswith("</answer>")
        assert play(env, i, turn)[1]["metrics"]["correct"] is True
    assert make("graph_color").oracle_turns(0) is None  # no single gold answer: no demonstration


def test_a_run_config_names_a_dataset_and_records_the_package(tmp_path):
    from importlib.metadata import version

    from stoa.fleet.config import ConfigError, check_runnable, load_config

    path = tmp_path / "run.toml"
    path.write_text('[env]\nid = "reasoning_gym:leg_counting"\nkwargs = {seed = 3, train_size = 8, test_size = 4, '
                    'max_animals = 3}\n')
    cfg = load_config(path)
    assert check_runnable(cfg).startswith("prompt format:")
    assert cfg.env.package == f"reasoning-gym=={version('reasoning-gym')}"
    assert cfg.env.make("test").unwrapped.reset(options={"index": 0})[1]["question_id"].startswith("leg_counting/3/")
    path.write_text('[env]\nid = "reasoning_gym:leg_countin"\nkwargs = {seed = 3}\n')
    with pytest.raises(ConfigError, match="did you mean reasoning_gym:leg_counting"):
        check_runnable(load_config(path))


def test_the_answer_is_extracted_in_linear_time_as_reasoning_gym_does():
    from reasoning_gym.utils import extract_answer

    for turn in ["<answer> 4 </answer>", "a<answer>1</answer>b<answer>2</answer>", "<answer>x", "",
                 "<answer><answer>5</answer></answer>", "<answer>\n 7\n</answer>"]:
        assert rgym.extract_answer(turn) == extract_answer(turn), turn
    t = time.perf_counter()
    assert rgym.extract_answer("<answer>" * 200_000) is None  # the library's regex is quadratic here
    assert time.perf_counter() - t < 1.0


# -- hostile answers ----------------------------------------------------------------------------------
def test_no_answer_text_reaches_code_evaluation():
    from stoa.envs.rgym import _literal, _plain_expression

    for ok in ["x**2/2 + C", "sin(x) + 3*exp(2*x)", "(25 - 1) * 4 / 4", "0.5*x**2"]:
        assert _plain_expression(ok, {"x": 0, "C": 0}) == ok
    for bad in ["__import__('os')", "chr(95)+chr(95)", "eval(x)", "x.func", "(1).real", "lambda: 1", "[1]",
                "open(x)", "exec(x)", "1 if x else 2", "x; y"]:
        with pytest.raises(ValueError):
            _plain_expression(bad, {"x": 0})
    assert _literal("['a', 'b']") == ["a", "b"]
    with pytest.raises(ValueError):
        _literal("__import__('os').system('true')")


@pytest.mark.parametrize("name", ["string_insertion", "n_queens", "countdown", "simple_integration",
                                  "polynomial_multiplication"])
def test_code_injection_runs_nothing(name, tmp_path):
    env = make(name, **HOSTILE_LIMITS)
    target = tmp_path / "pwned"
    for payload in [f"__import__('os').system('touch {target}')", f"open('{target}', 'w').write('x')",
                    f"[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0]('touch {target}', shell=True)",
                    f"eval(chr(111)+chr(112)+chr(101)+chr(110)+'(\"{target}\",\"w\")')"]:
        reward, info = play(env, 0, f"<answer>{payload}</answer>")
        assert reward < 1.0 and not info["metrics"]["correct"]
    assert not target.exists()
    assert play(env, 0, gold_turn(env))[0] == 1.0  # still healthy


@pytest.mark.parametrize(("name", "answer"), [
    ("countdown", "9**9**9"),
    ("polynomial_multiplication", "9**9**9*x"),
    ("string_insertion", "9**9**9"),
    ("countdown", "(" * 100_000 + "1" + ")" * 100_000),
    ("simple_integration", "(" * 100_000 + "x" + ")" * 100_000),
    ("n_queens", "[" * 100_000 + "]" * 100_000),
    ("basic_arithmetic", "1" * 1_000_000),
    ("puzzle24", "1" * 1_000_000),
])
def test_huge_numbers_deep_nesting_and_long_strings_neither_hang_nor_break_the_scorer(name, answer):
    env = make(name, **HOSTILE_LIMITS)
    play(env, 0, gold_turn(env))  # the scorer is built before the clock starts
    t = time.perf_counter()
    reward, info = play(env, 0, f"<answer>{answer}</answer>")
    assert time.perf_counter() - t < 6.0
    assert reward == 0.0 or (0 < reward < 1 and not info["metrics"]["score_error"])
    if info["metrics"]["score_error"]:
        assert info["score_error"] == info["metrics"]["score_error"] and reward == 0.0
    assert play(env, 0, gold_turn(env))[0] == 1.0  # restarted or untouched, still right


def test_a_too_long_answer_scores_zero_without_reaching_the_scorer():
    env = make("basic_arithmetic")
    reward, info = play(env, 0, "<answer>" + "1" * 9000 + "</answer>")
    assert reward == 0.0 and info["refused"] == "answer longer than 8192 characters"
    assert info["metrics"]["score_error"] == ""


def test_the_sandbox_contains_code_that_does_run(tmp_path):
    """The second wall: a scorer that evals its input (``functools.partial(eval)``) runs code in the
    child, which can neither write a file nor start a process, and a timeout restarts it."""
    box = Sandbox((), SandboxLimits(cpu_seconds=1.0, wall_seconds=3.0, memory_mb=256))
    try:
        target = tmp_path / "pwned"
        evil = "functools:partial", (eval,)
        assert box.call(*evil, "6 * 7", {}) == (42.0, "")
        assert "audit hook" in box.hardening
        for code in [f"open('{target}', 'w')", f"__import__('os').system('touch {target}')",
                     f"__import__('subprocess').run(['touch', '{target}'])", f"__import__('os').mkdir('{target}')",
                     "__import__('socket').socket()", "__import__('ctypes').CDLL(None)"]:
            score, error = box.call(*evil, code, {})
            assert error.startswith("error:"), (code, error)
        assert not target.exists()
        assert box.call(*evil, "bytearray(1 << 30)", {}) == (0.0, "memory")
        t = time.perf_counter()
        assert box.call(*evil, "sum(i for i in iter(int, 1))", {}) == (0.0, "timeout")
        assert time.perf_counter() - t < 4.0
        assert box.call(*evil, "__import__('os').kill(__import__('os').getpid(), 9)", {})[1] == "error:PermissionError"
        assert box.call(*evil, "print('{\"value\": 1.0}') or 0.5", {}) == (0.5, "")  # stdout is not the channel
        assert box.call(*evil, "1 + 1", {}) == (2.0, "") and box.restarts >= 1
    finally:
        box.close()


def test_stoa_envs_list_shows_passing_and_refused_datasets_with_the_reason():
    from typer.testing import CliRunner

    from stoa.cli import app

    r = CliRunner().invoke(app, ["envs", "list", "--dataset", "leg_counting", "--dataset", "composite",
                                 "--dataset", "intermediate_integration"])
    assert r.exit_code == 0, r.output
    assert "stoa/SyntheticSearch-v0" in r.output
    assert "passing check_env (1 of 3): leg_counting" in r.output and "refused (2):" in r.output
    assert "reasoning_gym:composite: a weighted mix" in r.output


def test_the_scoring_child_ends_when_its_parent_is_killed():
    """The sandbox child reads its work from the parent's pipe: a parent SIGKILLed mid-run leaves
    no scorer process behind (it sees end-of-file and exits)."""
    import os
    import signal
    import subprocess
    import sys

    if not os.path.isdir("/proc"):
        pytest.skip("reads child processes from /proc (Linux)")
    code = ("import stoa.envs, time\n"
            "env = stoa.envs.make('reasoning_gym:basic_arithmetic', seed=0, train_size=4, test_size=4)\n"
            "env.reset(options={'index': 0}); env.step('<answer>1</answer>')\n"
            "print('scored', flush=True); time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "scored"
        kids = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout.split()
        assert kids, "the score ran in no child process"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()

    def alive(pid: str) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 10
    while any(alive(k) for k in kids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(k) for k in kids), kids


def test_several_datasets_make_one_task_that_reports_each_datasets_pass_at_1():
    from types import SimpleNamespace

    from stoa.fleet.trust.admission import episode_metric_means

    kw = {"seed": 0, "train_size": 7, "test_size": 5, "configs": {"chain_sum": {"min_terms": 2, "max_terms": 2}}}
    env = stoa.envs.make("reasoning_gym:chain_sum.leg_counting.spell_backward", **kw)
    u = env.unwrapped
    assert len(u) == 21 and u.success_metric == "correct" and u.stop_strings == ("</answer>",)
    assert rgym_mix.interleave([2, 3, 1]) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (1, 2)]
    names, rows = [], []
    for i in range(len(u)):
        info = env.reset(options={"index": i})[1]
        names.append(info["dataset"])
        (turn,) = u.oracle_turns(i)
        good = env.step(turn if i % 2 else "<answer>wrong</answer>")[4]["metrics"]
        assert set(good) == {"correct", "formatted", "score", "score_error", f"correct_{info['dataset']}"}
        rows.append(SimpleNamespace(metrics=good, reward=float(good["score"]), group_id=f"eval-{i}"))
    assert names[:6] == ["chain_sum", "leg_counting", "spell_backward"] * 2  # any prefix is a fair mix
    assert u.reset(options={"index": 0})[0] == stoa.envs.make("reasoning_gym:chain_sum", seed=0, train_size=7,
                                                              test_size=5, min_terms=2, max_terms=2).reset(
                                                                  options={"index": 0})[0]
    means = episode_metric_means(rows, u.metric_types, "eval")  # what evaluation reports, per dataset
    from stoa.fleet.trainer.trainer import eval_metrics

    ev = eval_metrics(rows, 1, "correct", u.metric_types)  # and how many episodes each mean is over
    assert ev["eval/correct_chain_sum.n"] == names.count("chain_sum") == 7 and "eval/correct.n" not in ev
    for name in ("chain_sum", "leg_counting", "spell_backward"):
        mine = [i for i in range(len(u)) if names[i] == name]
        assert means[f"eval/correct_{name}"] == pytest.approx(sum(i % 2 for i in mine) / len(mine))
    stoa.envs.check_env(stoa.envs.make("reasoning_gym:chain_sum.leg_counting", seed=0, train_size=6, test_size=4))
    test = stoa.envs.make("reasoning_gym:chain_sum.leg_counting", split="test", seed=0, train_size=6, test_size=4)
    train_q = {stoa.envs.make("reasoning_gym:chain_sum.leg_counting", seed=0, train_size=6, test_size=4).reset(
        options={"index": i})[0] for i in range(12)}
    assert all(test.reset(options={"index": i})[0] not in train_q for i in range(len(test.unwrapped)))


def test_a_mixture_refuses_what_it_cannot_make_clearly():
    with pytest.raises(ValueError, match="names a dataset twice"):
        stoa.envs.make("reasoning_gym:leg_counting.leg_counting", seed=0)
    with pytest.raises(ValueError, match="composite is refused"):
        stoa.envs.make("reasoning_gym:leg_counting.composite", seed=0)
    with pytest.raises(ValueError, match="did you mean reasoning_gym:chain_sum"):
        stoa.envs.make("reasoning_gym:leg_counting.chain_summ", seed=0)
    with pytest.raises(ValueError, match="not among its datasets"):
        stoa.envs.make("reasoning_gym:leg_counting.chain_sum", seed=0, configs={"gcd": {}})
    with pytest.raises(ValueError, match="needs an int seed"):
        stoa.envs.make("reasoning_gym:leg_counting.chain_sum")
