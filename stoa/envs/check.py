"""``check_env``: does an environment honour the :mod:`stoa.envs.base` contract?"""

from __future__ import annotations

import math
import warnings
from typing import Any

import gymnasium
import numpy as np

__all__ = ["check_env", "EnvCheckError", "MALFORMED_TURNS"]

MALFORMED_TURNS = (
    "",
    "I am not sure.",
    "<search> unclosed query",
    "closing only </answer>",
    "<search>   </search>",
    "<answer></answer>",
    "<answer> a </answer> <search> b </search>",
    "<search> a <answer> b </answer> </search>",
    "</search> backwards <search>",
    "<search> x </answer>",
    "<search> " + "very long query " * 2000 + "</search>",
    "\x00\ufffd<|im_end|>\u202e",
)
"""Turns every environment must survive (any outcome but an exception is acceptable)."""

_MAX_STEPS = 10_000


class EnvCheckError(AssertionError):
    """The environment broke the contract; the message says where."""


def _fail(msg: str) -> None:
    raise EnvCheckError(msg)


def _check_metrics(m: Any, where: str) -> None:
    if not isinstance(m, dict):
        _fail(f"{where}: info['metrics'] must be a dict, got {type(m).__name__}")
    for k, v in m.items():
        if not isinstance(k, str):
            _fail(f"{where}: metric key {k!r} is not a str")
        if v is not None and not isinstance(v, (bool, int, float, str)):
            _fail(f"{where}: metric {k!r} has type {type(v).__name__} (allowed: bool, int, float, str, None)")
        if isinstance(v, float) and not math.isfinite(v):
            _fail(f"{where}: metric {k!r} is not finite")
        if isinstance(v, str) and len(v) > 4096:
            _fail(f"{where}: metric {k!r} is a string over 4096 characters")


def _check_step(out: Any, where: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    if not isinstance(out, tuple) or len(out) != 5:
        _fail(f"{where}: step() must return a 5-tuple")
    obs, reward, term, trunc, info = out
    if not isinstance(obs, str):
        _fail(f"{where}: observation must be a str, got {type(obs).__name__}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        _fail(f"{where}: reward must be a finite float, got {reward!r}")
    if not isinstance(term, bool) or not isinstance(trunc, bool):
        _fail(f"{where}: terminated and truncated must be bools")
    if not isinstance(info, dict):
        _fail(f"{where}: info must be a dict")
    if "metrics" in info:
        _check_metrics(info["metrics"], where)
    if term or trunc:
        if obs != "":
            _fail(f"{where}: the observation of the final step must be '' (got {obs[:60]!r})")
        if "metrics" not in info:
            _fail(f"{where}: the final step's info must carry 'metrics'")
    return obs, float(reward), term, trunc, info


def _check_reset(out: Any, where: str, n: int) -> tuple[str, dict[str, Any]]:
    if not isinstance(out, tuple) or len(out) != 2:
        _fail(f"{where}: reset() must return (prompt, info)")
    prompt, info = out
    if not isinstance(prompt, str) or not prompt:
        _fail(f"{where}: the prompt must be a non-empty str")
    if not isinstance(info, dict):
        _fail(f"{where}: reset info must be a dict")
    if not isinstance(info.get("question_id"), str) or not info["question_id"]:
        _fail(f"{where}: reset info needs a non-empty str 'question_id'")
    golds = info.get("gold_answers")
    if not isinstance(golds, list) or not all(isinstance(g, str) for g in golds):
        _fail(f"{where}: reset info needs 'gold_answers' as a list of str")
    i = info.get("index")
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
        _fail(f"{where}: reset info needs an int 'index' in [0, {n})")
    return prompt, info


def _play(env: gymnasium.Env, turns: list[str], n: int, where: str, **reset_kw: Any) -> list[Any]:
    """Reset, then step through ``turns`` (repeating the last) until the episode ends."""
    transcript: list[Any] = [_check_reset(env.reset(**reset_kw), where, n)]
    for t in range(_MAX_STEPS):
        try:
            out = env.step(turns[min(t, len(turns) - 1)])
        except Exception as e:
            _fail(f"{where}, turn {t}: step() raised {type(e).__name__}: {e} (a malformed turn must not raise)")
        step = _check_step(out, f"{where}, turn {t}")
        transcript.append(step)
        if step[2] or step[3]:
            return transcript
    _fail(f"{where}: the episode did not end within {_MAX_STEPS} turns (no turn limit?)")
    return transcript


def _outcome(transcript: list[Any]) -> list[Any]:
    """What replay compares: the prompt, then each step's observation, reward, end flags and metrics."""
    return [transcript[0][0]] + [(o, r, te, tr, i.get("metrics")) for o, r, te, tr, i in transcript[1:]]


def _raises(fn: Any, exc: type[BaseException] | tuple[type[BaseException], ...]) -> bool:
    try:
        fn()
    except exc:
        return True
    except Exception:
        return False
    return False


def check_env(env_or_id: gymnasium.Env | str, *, seed: int = 0, gymnasium_checks: bool = True, **kwargs: Any) -> None:
    """Verify an environment (or ``stoa.envs.make(id, **kwargs)``) against the text-environment contract.

    Checks: gymnasium's own ``check_env`` on the unwrapped env; ``stop_strings`` and ``len``;
    reset return types and the info keys the trainer needs (``question_id``, ``gold_answers``,
    ``index``); ``options={"index": i}`` selects item ``i`` and out-of-range indices raise
    ``ValueError``; seeding determinism of whole episodes; every turn in :data:`MALFORMED_TURNS`
    returns a well-typed step without raising; episodes end within a bounded number of turns with
    ``""`` and flat ``info["metrics"]``; stepping after the end raises ``RuntimeError``; a
    non-str action raises ``TypeError``; if the env provides ``oracle_turns``, that they end
    the episode with a positive reward; and, if it says it is ``replayable``, that replaying an
    episode's turns on the same item with another seed (what the trainer does to verify a
    worker's episode) gives the same observations, rewards and metrics.

    Raises:
        EnvCheckError: the first violation found.
    """
    if kwargs and not isinstance(env_or_id, str):
        raise TypeError("keyword arguments are only used with an environment id")
    if isinstance(env_or_id, str):
        from stoa.envs.registry import make

        env = make(env_or_id, **kwargs)
    else:
        env = env_or_id
    u = env.unwrapped
    name = getattr(env.spec, "id", None) or type(u).__name__

    stops = getattr(u, "stop_strings", None)
    if not isinstance(stops, tuple) or not all(isinstance(s, str) and s for s in stops):
        _fail(f"{name}: env.unwrapped.stop_strings must be a tuple of non-empty str")
    try:
        n = len(u)
    except TypeError:
        _fail(f"{name}: len(env.unwrapped) must give the number of dataset items")
    if not isinstance(n, int) or n < 1:
        _fail(f"{name}: len(env.unwrapped) must be >= 1")

    if gymnasium_checks:
        from gymnasium.utils.env_checker import check_env as gym_check

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                gym_check(u, skip_render_check=True)
            except Exception as e:
                _fail(f"{name}: gymnasium's check_env failed: {type(e).__name__}: {e}")

    # Seeding: the same seed draws the same item; explicit indices select that item.
    a = _check_reset(env.reset(seed=seed), f"{name} reset(seed={seed})", n)
    b = _check_reset(env.reset(seed=seed), f"{name} reset(seed={seed}) again", n)
    if a != b:
        _fail(f"{name}: reset(seed={seed}) twice gave different prompts or infos")
    for i in sorted({0, n // 2, n - 1}):
        p1, i1 = _check_reset(env.reset(options={"index": i}), f"{name} reset(index={i})", n)
        p2, i2 = _check_reset(env.reset(seed=seed + 1, options={"index": i}), f"{name} reset(index={i})", n)
        if i1["index"] != i or (p1, i1) != (p2, i2):
            _fail(f"{name}: options={{'index': {i}}} must select item {i} whatever the seed")
    for bad in (n, -1):
        if not _raises(lambda: env.reset(options={"index": bad}), (ValueError, IndexError)):
            _fail(f"{name}: reset(options={{'index': {bad}}}) must raise ValueError")

    # Malformed turns never raise; episodes end; the after-end step raises.
    for k, turn in enumerate(MALFORMED_TURNS):
        _play(env, [turn], n, f"{name} malformed turn {k} ({turn[:30]!r})", seed=seed + k)
        if not _raises(lambda: env.step("<answer> late </answer>"), RuntimeError):
            _fail(f"{name}: step() after the episode ended must raise RuntimeError")
    env.reset(seed=seed)
    if not _raises(lambda: env.step(None), TypeError):
        _fail(f"{name}: step(non-str) must raise TypeError")

    # Determinism of whole episodes, and the oracle path.
    oracle = getattr(u, "oracle_turns", None)
    for i in sorted({0, n - 1}):
        turns = (oracle(i) if oracle else None) or list(MALFORMED_TURNS[:3])
        t1 = _play(env, turns, n, f"{name} episode {i}", seed=seed, options={"index": i})
        t2 = _play(env, turns, n, f"{name} episode {i} replay", seed=seed, options={"index": i})
        if t1 != t2:
            _fail(f"{name}: the same seed, item and turns gave different episodes")
        if getattr(u, "replayable", True):
            t3 = _play(env, turns, n, f"{name} episode {i} replayed with another seed", seed=seed + 7919,
                       options={"index": i})
            if _outcome(t1) != _outcome(t3):
                _fail(f"{name}: replaying item {i}'s turns with another seed gave other observations, rewards or "
                      "metrics; declare replayable = False if the task depends on the seed")
        if oracle and oracle(i) is not None:
            _, reward, term, _, _ = t1[-1]
            if not term or sum(s[1] for s in t1[1:]) <= 0:
                _fail(f"{name}: oracle_turns({i}) did not end the episode with a positive reward")
    _check_hooks(env, u, name, n, seed)


def _check_hooks(env: Any, u: Any, name: str, n: int, seed: int) -> None:
    """The optional runtime hooks of :mod:`stoa.envs.base`: declared metric types hold on real
    episodes, every demonstration style plays, tokenizer texts are strings, practice kwargs a dict."""
    from stoa.envs.base import metric_problem

    types = getattr(u, "metric_types", {}) or {}
    if not isinstance(types, dict) or not all(isinstance(k, str) for k in types):
        _fail(f"{name}: metric_types must be a dict of metric name -> type")
    for k, t in types.items():
        kinds = t if isinstance(t, tuple) else (t,)
        if not all(k2 in (bool, int, float, str, type(None)) for k2 in kinds):
            _fail(f"{name}: metric_types[{k!r}] must be bool/int/float/str/NoneType or a tuple of them")
    if not isinstance(getattr(u, "replayable", True), bool):
        _fail(f"{name}: replayable must be a bool")
    success = getattr(u, "success_metric", None)
    if success is not None and types.get(success) is not bool:
        _fail(f"{name}: success_metric {success!r} must be declared as bool in metric_types")
    for h in getattr(u, "headline_metrics", ()):
        if h not in types:
            _fail(f"{name}: headline metric {h!r} is not in metric_types")
    rng = np.random.default_rng(seed)
    for style in getattr(u, "demo_styles", ()):
        for i in sorted({0, n - 1}):
            turns = u.demonstration_turns(i, style, rng)
            if turns is None:
                continue
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                _fail(f"{name}: demonstration_turns({i}, {style!r}) must return a list of str or None")
            steps = _play(env, turns, n, f"{name} demonstration {style!r} of item {i}", seed=seed, options={"index": i})
            why = metric_problem(steps[-1][4].get("metrics", {}), types)
            if why:
                _fail(f"{name}: {why} (demonstration {style!r} of item {i})")
    texts = u.tokenizer_texts()
    if texts is not None:
        for j, t in zip(range(64), texts):
            if not isinstance(t, str):
                _fail(f"{name}: tokenizer_texts() yielded a {type(t).__name__}, not a str")
    kw = u.practice_kwargs(1)
    if kw is not None and not (isinstance(kw, dict) and all(isinstance(k, str) for k in kw)):
        _fail(f"{name}: practice_kwargs(1) must return a dict of keyword arguments or None")
