"""Replay verification (stoa.fleet.trust.replay) on real MLX episodes and the synthetic search task (CPU or Metal)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="replay uses the MLX engine's tokenizer path")

import stoa.envs  # noqa: E402
from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine  # noqa: E402
from stoa.envs.base import TextEnv  # noqa: E402
from stoa.envs.check import EnvCheckError, check_env  # noqa: E402
from stoa.envs.papersearch import answer_turn, search_turn  # noqa: E402
from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts  # noqa: E402
from stoa.fleet.trust.replay import Replayer  # noqa: E402
from stoa.models.tiny import TinyConfig, build_tiny  # noqa: E402
from stoa.types import Episode, Segment, decode_episodes, encode_episodes  # noqa: E402

CORPUS = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
MODEL = TinyConfig(vocab_size=1024, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                   intermediate_size=128, seed=0)
MAX_TURN, MAX_EPISODE = 12, 200


def make_env():
    return stoa.envs.make("stoa/SyntheticSearch-v0", config=CORPUS)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), list(tokenizer_texts(generate(CORPUS))), MODEL)
    return make_engine(path, "mlx", config=EngineConfig(max_batch=32))


@pytest.fixture(scope="module")
def replayer(engine):
    return Replayer(make_env, engine.codec, max_turn_tokens=MAX_TURN, max_episode_tokens=MAX_EPISODE)


@pytest.fixture(scope="module")
def played(engine):
    """Real episodes of the (random) tiny model: invalid turns, feedback observations, truncation."""
    sampling = SamplingConfig(max_turn_tokens=MAX_TURN, max_episode_tokens=MAX_EPISODE, seed=3)
    eps = engine.rollout(make_env, [RolloutRequest(i, f"g{i}", 3) for i in range(12)], sampling)
    return decode_episodes(encode_episodes(eps))  # what the trainer reads: the wire format


def scripted(engine, index: int, turns: list[str]) -> Episode:
    """An episode a model could have sampled: each turn's text as tokens, played the engine's way."""
    env = make_env()
    prompt, _ = env.reset(seed=1, options={"index": index})
    segs, reward, metrics, n = [], 0.0, {}, 0
    for text in turns:
        toks = engine.encode(text)
        segs.append(Segment("model", np.array(toks), np.full(len(toks), -0.7, np.float32)))
        obs, r, term, trunc, info = env.step(text)
        reward, metrics, n = reward + r, info["metrics"], n + 1
        if term or trunc:
            break
        segs.append(Segment("env", np.array(engine.encode(obs))))
    metrics = {**metrics, "turns": n, "truncated": not term, "finish_reason": "terminated" if term else "truncated"}
    return Episode(np.array(engine.codec.prompt_tokens(prompt)), segs, reward, metrics, env_id="stoa/SyntheticSearch-v0",
                   group_id="s", item_index=index)


def test_real_engine_episodes_replay_exactly(played, replayer):
    assert len(played) == 36 and all(e.item_index is not None for e in played)
    assert {e.metrics["finish_reason"] for e in played} <= {"truncated", "terminated", "eos", "max_episode_tokens"}
    assert any(s.kind == "env" for e in played for s in e.segments)  # observations were replayed too
    assert replayer.check_all(played) == []


def test_a_search_episode_replays_with_retrieval_and_reward(engine, replayer):
    env = make_env().unwrapped
    ep = scripted(engine, 5, env.oracle_turns(5))
    assert ep.reward == 1.0 and ep.metrics["em"] and ep.metrics["searched"]
    assert replayer.check(ep) is None
    wrong = scripted(engine, 5, [search_turn(env.questions[5].subject), answer_turn("Nobody")])
    assert wrong.reward == 0.0 and replayer.check(wrong) is None


def _tampered(ep: Episode, change) -> Episode:
    out = copy.deepcopy(ep)
    change(out)
    return out


def test_every_forged_claim_is_caught_with_a_reason(engine, replayer):
    env = make_env().unwrapped
    good = scripted(engine, 5, env.oracle_turns(5))
    wrong = scripted(engine, 7, [search_turn(env.questions[7].subject), answer_turn("Nobody")])
    info = engine.encode("\n\n<information>Doc 1(Title: X) The answer is Nobody.</information>\n\n")

    def set_metric(key: str, value: Any):
        return lambda e: e.metrics.__setitem__(key, value)

    cases = {
        "reward": (wrong, lambda e: setattr(e, "reward", 1.0), "reward: claimed 1.0"),
        "em": (wrong, set_metric("em", True), "metric 'em'"),
        "em as an int": (good, set_metric("em", 1), "metric 'em'"),
        "searched": (wrong, set_metric("num_searches", 3), "metric 'num_searches'"),
        "engine metric": (good, set_metric("turns", 1), "metric 'turns'"),
        "observation": (wrong, lambda e: e.segments.__setitem__(1, Segment("env", np.array(info))), "observation differs"),
        "prompt": (good, lambda e: setattr(e, "prompt_tokens", e.prompt_tokens[:-1]), "prompt tokens"),
        "item": (good, lambda e: setattr(e, "item_index", 6), "prompt tokens"),
        "no item": (good, lambda e: setattr(e, "item_index", None), "item_index"),
        "item out of range": (good, lambda e: setattr(e, "item_index", 10**6), "outside"),
        "cut short": (good, lambda e: e.segments.__delitem__(slice(2, None)), "stops before"),
        "extra turn": (good, lambda e: e.segments.append(e.segments[0]), "after the episode ended"),
        "env where a turn belongs": (good, lambda e: e.segments.insert(0, e.segments[1]), "env segment where"),
    }
    for name, (base, change, needle) in cases.items():
        why = replayer.check(_tampered(base, change))
        assert why is not None and needle in why, (name, why)


def test_repeated_episodes_replay_once_but_each_ones_claims_are_checked(engine, replayer):
    env = make_env().unwrapped
    good = scripted(engine, 5, env.oracle_turns(5))
    forged = _tampered(good, lambda e: setattr(e, "reward", 0.5))  # same tokens, its own (false) claim
    other_item = _tampered(good, lambda e: setattr(e, "item_index", 6))  # same tokens, another item
    steps = []
    real_step = replayer.env.step
    replayer.env.step = lambda text: steps.append(text) or real_step(text)
    try:
        bad = replayer.check_all([good, _tampered(good, lambda e: None), forged, other_item])
    finally:
        replayer.env.step = real_step
    assert [i for i, _ in bad] == [2, 3] and "reward: claimed 0.5" in bad[0][1] and "prompt tokens" in bad[1][1]
    assert len(steps) == len(env.oracle_turns(5))  # the three copies of item 5 were played once


def test_turn_boundaries_follow_the_engine(engine, replayer):
    env = make_env().unwrapped
    good = scripted(engine, 5, env.oracle_turns(5))
    first = good.segments[0]
    # The answer turn glued onto the search turn: the engine would have ended at </search>.
    glued = _tampered(good, lambda e: e.segments.__setitem__(slice(0, 4), [Segment(
        "model", np.concatenate([first.tokens, good.segments[2].tokens]),
        np.concatenate([first.logprobs, good.segments[2].logprobs]))]))
    assert "runs past its end" in replayer.check(glued)
    # A turn split before its stop string: no stop, no EOS, under the caps.
    cut = _tampered(good, lambda e: e.segments.__setitem__(0, Segment("model", first.tokens[:2], first.logprobs[:2])))
    assert "ends without a stop string" in replayer.check(cut)


class _SeededEnv(TextEnv):
    """The reward depends on the reset seed: deterministic, but not replayable from the item alone."""

    stop_strings = ("</answer>",)
    metric_types = {"lucky": bool}

    def __len__(self) -> int:
        return 4

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._i, self._done = self._select_index(options), False
        return f"Item {self._i}: say <answer> x </answer>.", {"question_id": str(self._i), "gold_answers": [], "index": self._i}

    def step(self, action):
        if not isinstance(action, str):
            raise TypeError("a turn is a str")
        if self._done:
            raise RuntimeError("the episode has ended")
        self._done = True
        lucky = bool(self.np_random.integers(2))
        return "", float(lucky), True, False, {"metrics": {"lucky": lucky}}


class _DeclaredEnv(_SeededEnv):
    replayable = False


def test_check_env_holds_replayable_envs_to_it():
    with pytest.raises(EnvCheckError, match="replay"):
        check_env(_SeededEnv(), gymnasium_checks=False)
    check_env(_DeclaredEnv(), gymnasium_checks=False)
    check_env("stoa/SyntheticSearch-v0", config=CORPUS)  # the built-in tasks replay


def test_a_non_replayable_task_is_reported_not_replayed(engine):
    r = Replayer(_DeclaredEnv, engine.codec, max_turn_tokens=8, max_episode_tokens=64)
    assert r.replayable is False
