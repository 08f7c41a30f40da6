"""verifiers environments as Stoa tasks: ``stoa.envs.make("verifiers:<module>", **kwargs)``.

`verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ (``pip install 'stoa[verifiers]'``) is
a library of RL environments; each is a Python package whose module has
``load_environment(**kwargs)``. ``verifiers:<module>`` imports ``<module>`` (installed, e.g. from
the Environments Hub or ``pip install -e``), calls ``load_environment(**env.kwargs)`` and plays the
environment it returns turn by turn with Stoa's own sampler, the same code on the worker and in
the trainer's replay, so that replay stays exact.

This module plays the classic API (``verifiers.legacy``, which 0.3 also serves at the top level:
``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``), with a ``Rubric`` of reward functions (sync or async;
weights; weight 0 = a logged metric), a parser, ``system_prompt`` and ``few_shot``. A taskset
package (``verifiers.v1``: verifiers 0.4's only API, a preview in 0.3) is played by
:mod:`stoa.envs.vf_v1`; :func:`make_env` picks the adapter by the installed version and the module.

- **Prompt**: the item's messages (``system_prompt``, ``few_shot``, the question) as one text,
  since a Stoa prompt is the text of one user message (``stoa.backends.prompting`` applies the
  chat template): the system prompt, then each few-shot message as ``User: ...`` /
  ``Assistant: ...``, then the question, separated by blank lines.
- **Turns**: a turn ends at one of :attr:`VerifiersEnv.stop_strings` (``env.kwargs.stop_strings``,
  else the environment object's own ``stop_strings`` attribute, else none: the turn ends at EOS,
  which also ends the episode; so a multi-turn environment must name its stop strings). After a
  turn the environment's stop conditions run (``is_completed``); if none fires, its
  ``env_response`` messages, as text between newlines, are the observation appended to the
  model's message.
- **Reward**: the rubric's reward functions on the conversation, weighted and summed, as verifiers
  scores a finished rollout; they run after every turn, each step's reward is the change in that
  sum, so the episode's return is the rubric's score of the conversation wherever it ended (by the
  environment, a turn limit, or an EOS or token cap in the engine). Each function's value is a
  metric under its name, with ``stop_condition``. A reward function that raises is an error
  (:class:`RewardError`), not verifiers' silent 0.

Refused (the reason in the error): anything but a ``MultiTurnEnv``, ``EnvGroup``, tools
(``tool_defs``: a Stoa turn is text, not a structured tool call), group-level reward functions and
rubric-given advantages (a reward that depends on the other samples of a group cannot be computed
for one episode). Refused unless ``accept_unreplayable = true`` (then ``replayable`` is False and
the trainer checks the task's episodes only statistically): LLM judges (``JudgeRubric``), sandboxes
and code servers (``SandboxEnv``, ``PythonEnv``), time-limited scoring (``MathRubric``) and
time-limited rollouts (``timeout_seconds``): their rewards depend on a server or the clock, so a
replay cannot reproduce them.

Keyword arguments: this adapter's own (``split``, ``accept_unreplayable``, ``stop_strings``,
``max_turns``: the turn limit when the environment sets none, default 10); every other key is
passed to ``load_environment``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import math
import re
import signal
import threading
from collections.abc import Iterator
from typing import Any

from stoa.envs.base import TextEnv
from stoa.envs.vf_shared import (
    DISTRIBUTION,
    PREFIX,
    Loop,
    RewardError,
    admit,
    message_text,
    neutralize,
    render_prompt,
)

__all__ = ["DISTRIBUTION", "PREFIX", "RewardError", "VerifiersEnv", "load", "make_env", "problems", "register_id",
           "version"]

_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_DEFAULT_MAX_TURNS = 10


def register_id(env_id: str) -> None:
    """Register ``verifiers:<module>`` with gymnasium (the id-prefix handler of ``stoa.envs``).

    Raises:
        ValueError: verifiers is not installed, or ``<module>`` is not an installed module.
    """
    import stoa.envs

    module = env_id[len(PREFIX):]
    if not _MODULE.fullmatch(module):
        raise ValueError(f"{env_id!r}: {module!r} is not a module name (verifiers:<module>, e.g. verifiers:my_env)")
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(f"{env_id!r} needs verifiers: pip install 'stoa[verifiers]'")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ValueError(f"{env_id!r}: no installed module {module!r}; install the package that provides it "
                         "(e.g. pip install -e path/to/env)")
    stoa.envs.register(env_id, "stoa.envs.vf:make_env", kwargs={"module": module})


def version() -> tuple[int, int]:
    """The installed verifiers' ``(major, minor)``."""
    from importlib.metadata import version as installed

    found = re.match(r"(\d+)\.(\d+)", installed(DISTRIBUTION))
    return (int(found[1]), int(found[2])) if found else (0, 0)


def make_env(module: str, **kwargs: Any) -> TextEnv:
    """The Stoa task of ``<module>`` (the entry point of every ``verifiers:<module>`` id): a
    taskset package (``verifiers.v1``; always under verifiers 0.4) is played by
    :class:`stoa.envs.vf_v1.TasksetEnv`, a classic ``load_environment`` module by
    :class:`VerifiersEnv`.

    Raises:
        ValueError: the module is neither, or verifiers 0.4 has no classic API for it.
    """
    from stoa.envs import vf_v1

    where = f"{PREFIX}{module}"
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{where}: importing {module!r} failed: {e}") from None
    classic = callable(getattr(mod, "load_environment", None))
    if version() >= (0, 4):
        if vf_v1.is_taskset(mod):
            return vf_v1.TasksetEnv(module, **kwargs)
        what = "a classic environment (load_environment)" if classic else "not a taskset package"
        raise ValueError(f"{where} is refused: {what}; verifiers {'.'.join(map(str, version()))} plays only "
                         "tasksets (a module exporting a vf.Taskset subclass in __all__); classic environments "
                         "need verifiers<0.4 (pip install 'stoa[verifiers]')")
    if not classic and vf_v1.is_taskset(mod):
        return vf_v1.TasksetEnv(module, **kwargs)
    return VerifiersEnv(module, **kwargs)


# -- loading ----------------------------------------------------------------------------------------
_LOADED: dict[tuple[str, str], Any] = {}
_LOAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """verifiers' ``Environment`` installs SIGINT and SIGTERM handlers as it is made (and
    ``signal.signal`` fails outside the main thread): Stoa's processes keep their own."""
    real = signal.signal
    signal.signal = lambda sig, handler: signal.getsignal(sig)  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = real


def load(module: str, kwargs: dict[str, Any]) -> Any:
    """``<module>.load_environment(**kwargs)``, made once per process for each module and kwargs
    (environments of one task share it; the adapter keeps each episode's state itself).

    Raises:
        ValueError: the module has no ``load_environment``, or it refused ``kwargs``.
    """
    key = (module, json.dumps(kwargs, sort_keys=True, default=repr))
    with _LOAD_LOCK:
        env = _LOADED.get(key)
        if env is None:
            mod = importlib.import_module(module)
            fn = getattr(mod, "load_environment", None)
            if not callable(fn):
                raise ValueError(f"verifiers:{module}: the module has no load_environment()")
            with _own_signal_handlers():
                try:
                    env = fn(**kwargs)
                except TypeError as e:
                    raise ValueError(f"verifiers:{module}: load_environment({', '.join(kwargs)}) failed: {e}") from None
            _LOADED[key] = env
        return env


def _classic() -> Any:
    """verifiers' classic API: ``verifiers.legacy`` (0.3), else the package itself (older)."""
    try:
        return importlib.import_module("verifiers.legacy")
    except ImportError:
        return importlib.import_module("verifiers")


def _names(obj: Any) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def _rubrics(rubric: Any) -> Iterator[Any]:
    """``rubric`` and, for a ``RubricGroup``, every rubric inside it."""
    yield rubric
    for r in getattr(rubric, "rubrics", None) or ():
        yield from _rubrics(r)


def problems(env: Any) -> tuple[list[str], list[str]]:
    """``(unsupported, unreplayable)``: why the adapter cannot play ``env`` at all, and why a
    replay could not reproduce its rewards (each reason one phrase)."""
    vf = _classic()
    unsupported: list[str] = []
    unreplayable: list[str] = []
    if not isinstance(env, getattr(vf, "MultiTurnEnv", ())):
        where = type(env).__module__
        api = ("a verifiers.v1 environment: export its Taskset subclass in the module's __all__ instead, and "
               "Stoa plays the taskset (stoa.envs.vf_v1)"
               if where.startswith("verifiers.v1") else "not a verifiers MultiTurnEnv (SingleTurnEnv is one)")
        return [f"load_environment returned {type(env).__name__} ({where}): {api}"], []
    names = _names(env)
    if "EnvGroup" in names:
        unsupported.append("an EnvGroup mixes several environments: make one Stoa env per environment")
    if getattr(env, "tool_defs", None) or names & {"ToolEnv", "StatefulToolEnv"}:
        unsupported.append("tools (tool_defs): a Stoa turn is text, not the chat API's structured tool calls")
    if names & {"SandboxEnv", "PythonEnv", "CliAgentEnv"}:
        unreplayable.append(f"a sandbox or code server ({type(env).__name__}) computes its outcomes")
    if getattr(env, "timeout_seconds", None):
        unreplayable.append(f"a time-limited rollout (timeout_seconds={env.timeout_seconds}): whether it ends "
                            "in time depends on the machine")
    for r in _rubrics(env.rubric):
        rn = _names(r)
        if "JudgeRubric" in rn:
            unreplayable.append(f"an LLM judge ({type(r).__name__}): its reward is a model server's answer")
        if "MathRubric" in rn:
            unreplayable.append(f"time-limited scoring ({type(r).__name__}: math-verify under a timeout, which "
                                "scores 0 when the machine is slow)")
        if getattr(r, "has_advantages", False) and not getattr(r, "rubrics", None):
            unsupported.append(f"{type(r).__name__} gives advantages itself: Stoa computes them from rewards")
        is_group = getattr(r, "_is_group_func", None)
        for f in getattr(r, "funcs", None) or ():
            if callable(is_group) and is_group(f):
                unsupported.append(f"a group-level reward function {getattr(f, '__name__', f)!r}: it scores a group's "
                                   "samples together, so one episode's reward cannot be computed or replayed alone")
    return unsupported, unreplayable


class _StoaTurns:
    """The "model client" of a verifiers state: Stoa's sampler writes the turns, so nothing may call it."""

    @classmethod
    def make(cls, vf: Any) -> Any:
        async def unused(*_: Any, **__: Any) -> Any:
            raise RuntimeError("the model's turns come from Stoa's sampler, not a verifiers client")

        methods = {name: unused for name in ("to_native_tool", "to_native_prompt", "get_native_response",
                                              "raise_from_native_response", "from_native_response", "close")}
        return type("StoaTurns", (vf.Client,), {**methods, "setup_client": lambda self, config: None})(None)


class VerifiersEnv(TextEnv):
    """One verifiers environment (see the module docstring).

    Args:
        module: the module whose ``load_environment`` makes it (the id's suffix).
        split: ``"train"`` (its ``dataset``) or ``"test"`` (its ``eval_dataset``; the train set
            when it has none, as verifiers does).
        accept_unreplayable: play an environment whose rewards a replay cannot reproduce (its
            episodes are then not replayed; see the module docstring).
        stop_strings: strings that end a model turn (default: the environment's ``stop_strings``
            attribute, else none).
        max_turns: turn limit when the environment sets none (``max_turns <= 0``).
        **kwargs: passed to ``load_environment``.

    Metrics: each reward function's value on the conversation so far (a float, under its name;
    weight 0 ones included) and ``stop_condition`` (the verifiers stop condition that ended the
    episode, ``"max_turns"`` for this adapter's limit, ``""`` before the end).
    """

    def __init__(self, module: str, split: str = "train", accept_unreplayable: bool = False,
                 stop_strings: list[str] | tuple[str, ...] | None = None, max_turns: int = _DEFAULT_MAX_TURNS,
                 **kwargs: Any) -> None:
        where = f"{PREFIX}{module}"
        if split not in ("train", "test"):
            raise ValueError(f"{where}: split must be 'train' or 'test', got {split!r}")
        self.vf = _classic()
        self.env = load(module, kwargs)
        unsupported, unreplayable = problems(self.env)
        self.unreplayable = admit(where, unsupported, unreplayable, accept_unreplayable)
        self.replayable = not self.unreplayable  # instance attribute: the trainer reads env.unwrapped.replayable
        stops = stop_strings if stop_strings is not None else getattr(self.env, "stop_strings", None) or ()
        if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"{where}: stop_strings must be a list of non-empty strings")
        self.stop_strings = tuple(stops)
        own = getattr(self.env, "max_turns", -1)
        self.max_turns = own if isinstance(own, int) and own > 0 else int(max_turns)
        if self.max_turns < 1:
            raise ValueError(f"{where}: max_turns must be >= 1")
        if self.max_turns > 1 and not self.stop_strings:
            raise ValueError(f"{where}: a multi-turn environment needs stop strings (env.kwargs.stop_strings, or a "
                             "stop_strings attribute on the environment): a turn that ends at EOS ends the episode")
        self.module, self.split = module, split
        self._rows = self.env.get_dataset() if split == "train" else self.env.get_eval_dataset()
        self._funcs = []
        seen: set[str] = set()
        for r in _rubrics(self.env.rubric):
            if getattr(r, "rubrics", None):
                continue  # a RubricGroup: its members are listed themselves
            for f, w in zip(r.funcs, r.weights):
                name = getattr(f, "__name__", type(f).__name__)
                name = name if name not in seen else f"{name}_{len(seen)}"
                seen.add(name)
                self._funcs.append((name, f, float(w), r))
        self.metric_types = {**{n: float for n, *_ in self._funcs}, "stop_condition": str}
        self._where = where
        self._client = _StoaTurns.make(self.vf)
        self._loop = Loop()
        self._state: Any = None
        self._prompt: list[Any] = []
        self._turns, self._paid = 0, 0.0

    def __len__(self) -> int:
        return len(self._rows)

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro)

    def close(self) -> None:
        self._loop.close()
        super().close()

    # -- episodes ---------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        i = self._select_index(options)
        row = dict(self._rows[i])
        self._state = None
        self._state = self._run(self._start(row))
        self._prompt, self._turns, self._paid = list(self._state["prompt"]), 0, 0.0
        answer = row.get("answer")
        info = {"question_id": f"{self.module}/{self.split}/{row.get('example_id', i)}",
                "gold_answers": [] if answer in (None, "") else [str(answer)], "index": i}
        return render_prompt(self._state["prompt"]), info

    async def _start(self, row: dict[str, Any]) -> Any:
        state = await self.env.init_state(row, self._client, "stoa")
        setup = await self.env.setup_state(state)
        return state if setup is None else setup

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"an action is the text of one model turn, not {type(action).__name__}")
        if self._state is None:
            raise RuntimeError("call reset() first; the episode has ended")
        state = self._state
        self._turns += 1
        obs, done = self._run(self._turn(state, action))
        total, metrics = self._run(self._score(state))
        reward, self._paid = total - self._paid, total
        stop = str(state.get("stop_condition") or "") if done else ""
        info = {"metrics": {**metrics, "stop_condition": stop}}
        if not done:
            return obs, reward, False, False, info
        self._state = None
        truncated = stop == "max_turns" or (stop == "max_turns_reached" and self.max_turns > 1)
        return "", reward, not truncated, truncated, info

    async def _turn(self, state: Any, text: str) -> tuple[str, bool]:
        """verifiers' rollout loop, one model turn at a time: add the turn, run the stop
        conditions, and if none fires, the environment's response; ``(observation, ended)``."""
        env, prompt = self.env, self._prompt
        completion = self._messages([{"role": "assistant", "content": text}])
        await env.add_trajectory_step(state, {
            "prompt": prompt, "completion": completion, "response": None, "tokens": None, "reward": None,
            "advantage": None, "is_truncated": False, "trajectory_id": state["trajectory_id"], "extras": {}})
        if await env.is_completed(state):
            return "", True
        if self._turns >= self.max_turns:
            state["is_completed"], state["is_truncated"], state["stop_condition"] = True, True, "max_turns"
            return "", True
        try:
            following = list(await env.get_prompt_messages(state))
        except self.vf.Error as e:  # verifiers' own errors end the rollout, as its loop does
            state["error"] = e
            following = []
        if await env.is_completed(state):  # an error, or a final_env_response
            return "", True
        self._prompt = following
        new = following[len(prompt) + len(completion):]
        return "\n" + neutralize("\n\n".join(message_text(m) for m in new)) + "\n", False

    def _messages(self, raw: list[dict[str, Any]]) -> Any:
        from importlib import import_module

        utils = import_module(self.vf.__name__ + ".utils.message_utils")
        return utils.normalize_messages(raw, field_name="completion")

    async def _score(self, state: Any) -> tuple[float, dict[str, float]]:
        """The rubric's weighted reward and each function's value; a function that raises is an error."""
        await self.env.render_completion(state)
        total, metrics = 0.0, {}
        for name, fn, weight, rubric in self._funcs:
            objects = rubric.score_objects(state)
            params = inspect.signature(fn).parameters
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                objects = {k: v for k, v in objects.items() if k in params}
            try:
                value = fn(**objects)
                if inspect.isawaitable(value):
                    value = await value
                value = float(value)
            except Exception as e:
                raise RewardError(f"{self._where}: reward function {name!r} raised {type(e).__name__}: "
                                  f"{str(e)[:200]}") from e
            if not math.isfinite(value):
                raise RewardError(f"{self._where}: reward function {name!r} returned {value}")
            metrics[name] = value
            total += weight * value
        return total, metrics

    def tokenizer_texts(self) -> Iterator[str]:
        for i in range(len(self)):
            row = self._rows[i]
            yield render_prompt(row["prompt"])
            if row.get("answer") not in (None, ""):
                yield str(row["answer"])
