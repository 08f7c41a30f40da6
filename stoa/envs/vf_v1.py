"""verifiers tasksets (``verifiers.v1``, the API of verifiers 0.4) as Stoa tasks.

``verifiers:<module>`` comes here when ``<module>`` is a taskset package (it exports one
``vf.Taskset`` subclass in ``__all__``, as ``vf-eval <module>`` finds it): always under verifiers
0.4, which has no other API, and under 0.3 for a module without ``load_environment`` (0.3 ships
``verifiers.v1`` as a preview; :mod:`stoa.envs.vf` plays its classic environments).

The environment is verifiers' own: ``vf.load_environment(config)`` with ``env.taskset.id =
<module>`` and ``env.kwargs`` as the taskset's config (typos are refused by it). Stoa then plays
one task as one turn with its own sampler, on the worker and in the trainer's replay alike:

- **Prompt**: the task's ``system_prompt``, then its ``prompt`` (a text, or messages: few-shot
  ones as ``User: ...`` / ``Assistant: ...``), separated by blank lines, rendered as
  :func:`stoa.envs.vf.render_prompt` renders a classic environment's.
- **Reward**: ``Task.score(trace)`` on a ``vf.Trace`` whose branch is the prompt's messages and
  the model's text as the sampled assistant message (``trace.last_reply``), with no runtime, as a
  trainer scores a recorded trace; the reward is ``trace.reward`` (the weighted sum of the
  ``@vf.reward`` hooks and plugged rewards). Each reward's score and each ``@vf.metric`` value is a
  metric under its name. A hook that raises is an error (:class:`stoa.envs.vf.RewardError`).

Refused, the reason in the error (``stoa train --check`` makes the env first): an ``Env`` other
than ``SingleAgentEnv`` (several agents, a user simulator, cross-agent ``finalize``); a harness the
taskset ships (its own agent loop); tools (``toolsets``); ``@vf.intercept`` hooks; anything that
needs a runtime (a reward or metric with a ``runtime`` parameter, ``setup``/``finalize`` hooks,
containers); tasks without a prompt; infinite tasksets. Refused unless ``accept_unreplayable =
true`` (then ``replayable`` is False): LLM judges (plugged ``judges``, a ``JudgeConfig`` in the
config, a hook that uses a ``vf.Judge``) and time-limited scoring (``timeout.scoring``,
``verify_boxed_math_answer``): their rewards depend on a server or the clock.

Keyword arguments: this adapter's own (``split``: passed to the taskset config when it declares a
``split`` field, else both splits are the same tasks; ``accept_unreplayable``; ``stop_strings``,
default none: the turn ends at EOS); every other key goes to the taskset's config.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

from stoa.envs.base import TextEnv
from stoa.envs.vf_shared import PREFIX, Loop, RewardError, admit, render_prompt

__all__ = ["TasksetEnv", "is_taskset", "load", "problems"]

_TIMED_SCORERS = {"verify_boxed_math_answer"}
"""verifiers helpers that score under a wall-clock limit (math-verify's parse/verify timeouts)."""


def _vf() -> Any:
    return importlib.import_module("verifiers.v1")


def is_taskset(mod: Any) -> bool:
    """Whether module ``mod`` exports a ``verifiers.v1`` ``Taskset`` subclass in ``__all__``."""
    try:
        base = _vf().Taskset
    except ImportError:
        return False
    found = (getattr(mod, name, None) for name in getattr(mod, "__all__", ()))
    return any(isinstance(c, type) and issubclass(c, base) and c is not base for c in found)


# -- loading ----------------------------------------------------------------------------------------
_LOADED: dict[tuple[str, str], tuple[Any, list[Any]]] = {}
_LOAD_LOCK = threading.Lock()


def load(module: str, config: dict[str, Any]) -> tuple[Any, list[Any]]:
    """``(env, tasks)``: ``vf.load_environment`` for taskset ``module`` with ``config`` as its
    taskset config, and the taskset's tasks; made once per process for each module and config.

    Raises:
        ValueError: the module exports no taskset, or its config refused ``config``.
    """
    key = (module, json.dumps(config, sort_keys=True, default=repr))
    with _LOAD_LOCK:
        found = _LOADED.get(key)
        if found is None:
            vf = _vf()
            try:
                cfg = vf.resolve_env_config({"taskset": {**config, "id": module}})
                env = vf.load_environment(cfg)
            except (TypeError, ValueError, AttributeError, ImportError) as e:
                raise ValueError(f"{PREFIX}{module}: verifiers could not load the taskset: {_why(e)}") from None
            if getattr(env.taskset, "INFINITE", False) and not getattr(env.taskset, "bounded", False):
                found = (env, [])
            else:
                found = (env, list(env.taskset))
            _LOADED[key] = found
        return found


def _why(e: Exception) -> str:
    """One line: a pydantic error's fields and messages (``taskset.num_trian: Extra inputs are not
    permitted``), else the exception."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in errors())[:600]
        except (TypeError, KeyError):
            pass
    return f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"


# -- what cannot be played or replayed ----------------------------------------------------------------
def _requires_runtime(fn: Callable[..., Any]) -> bool:
    """As ``Task.score`` decides: a ``runtime`` parameter without a default."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _code_names(fn: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    """The global names ``fn``'s code (nested functions included) refers to, with their values."""
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    code = getattr(fn, "__code__", None)
    scope = getattr(fn, "__globals__", {})
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        for name in c.co_names:
            yield name, scope.get(name)
        stack.extend(k for k in c.co_consts if inspect.iscode(k))


def _judge_fields(config: Any, where: str, skip: str = "") -> Iterator[str]:
    """Fields of a pydantic config (one level of nesting; not ``skip``) that hold a ``JudgeConfig``."""
    judge_config = _vf().JudgeConfig
    for name, value in config if config is not None else ():
        if name == skip:
            continue
        if isinstance(value, judge_config):
            yield f"{where}.{name}"
        elif hasattr(value, "model_fields") and not isinstance(value, type):
            yield from (f"{where}.{name}.{n}" for n, v in value if isinstance(v, judge_config))


def problems(env: Any, tasks: list[Any]) -> tuple[list[str], list[str]]:
    """``(unsupported, unreplayable)``: why Stoa cannot play ``env``'s tasks at all, and why a
    replay could not reproduce their rewards (each reason one phrase)."""
    vf = _vf()
    from verifiers.v1.utils.decorators import discover_decorated
    from verifiers.v1.utils.loaders import default_harness_id

    unsupported: list[str] = []
    unreplayable: list[str] = []
    taskset = env.taskset
    module = taskset.config.id
    if type(env) is not vf.SingleAgentEnv:
        unsupported.append(f"its Env is {type(env).__name__}, not SingleAgentEnv: an env's run() and finalize() "
                           "drive several agents (or a user) and judge across them, which Stoa cannot play one "
                           "episode at a time")
    if default_harness_id(module) == module:
        unsupported.append("the taskset ships its own harness (an agent program with its own loop): Stoa's "
                           "sampler writes the one turn itself")
    if not tasks:
        unsupported.append("the taskset yields no tasks (an infinite taskset is not indexable: bound it in its "
                           "config)")
        return unsupported, unreplayable
    task_cls = type(tasks[0])
    if type(taskset).toolsets(taskset.config) or task_cls.toolsets(taskset.config.task):
        unsupported.append("tools (toolsets): a Stoa turn is text, not the chat API's structured tool calls")
    if getattr(task_cls, "NEEDS_CONTAINER", False) or any(t.data.image for t in tasks):
        unsupported.append("the task runs in a container (NEEDS_CONTAINER or an image): Stoa plays tasks "
                           "without a runtime")
    for hook in ("setup", "finalize", "stage_verifier"):
        mine, base = getattr(task_cls, hook, None), getattr(vf.Task, hook, None)
        if mine is not None and mine is not base:
            unsupported.append(f"{task_cls.__name__}.{hook}() prepares or reads a runtime: Stoa plays tasks "
                               "without one")
    task = tasks[0]
    hooks = task.hooks("reward") + task.hooks("metric")
    for fn in hooks:
        if _requires_runtime(fn):
            unsupported.append(f"{fn.__name__!r} needs a runtime (a sandbox or container the agent ran in): Stoa "
                               "scores the text alone")
        if not inspect.iscoroutinefunction(inspect.unwrap(fn)):
            unsupported.append(f"{fn.__name__!r} is not async (async def): verifiers awaits every reward and metric")
    if discover_decorated(task, "intercept"):
        unsupported.append("@vf.intercept hooks rewrite model requests or responses: Stoa's sampler has no "
                           "interception layer")
    if any(t.data.prompt is None for t in tasks):
        unsupported.append("a task without a prompt (the user opens the conversation): Stoa's turn answers a prompt")

    judges = [j.id for j in getattr(task.config, "judges", ())]
    if judges:
        unreplayable.append(f"an LLM judge (judges: {', '.join(judges)}): its reward is a model server's answer")
    fields = [*_judge_fields(task.config, "task"), *_judge_fields(taskset.config, "taskset", skip="task")]
    if fields:
        unreplayable.append(f"an LLM judge (a JudgeConfig at {', '.join(fields)}): its reward is a model "
                            "server's answer")
    for fn in hooks:
        names = dict(_code_names(fn))
        used = sorted(n for n, v in names.items() if isinstance(v, type) and issubclass(v, vf.Judge))
        if used:
            unreplayable.append(f"an LLM judge ({fn.__name__!r} uses {', '.join(used)}): its reward is a model "
                                "server's answer")
        timed = sorted(_TIMED_SCORERS & names.keys())
        if timed:
            unreplayable.append(f"time-limited scoring ({fn.__name__!r} calls {', '.join(timed)}: math-verify under "
                                "a timeout, which scores 0 when the machine is slow)")
    limits = sorted({t.data.timeout.scoring for t in tasks if t.data.timeout.scoring is not None})
    if limits:
        unreplayable.append(f"time-limited scoring (timeout.scoring = {limits[0]:g} s): whether it finishes in "
                            "time depends on the machine")
    return unsupported, unreplayable


def _messages(data: Any) -> list[Any]:
    """A task's prompt as messages: the system prompt, then the prompt (a text is one user message)."""
    vf = _vf()
    out = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    prompt = data.prompt
    return out + ([vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt))


def _trace(task: Any, prompt: list[Any], text: str) -> Any:
    """The trace a single-turn chat over ``prompt`` leaves when the model answers ``text``."""
    vf = _vf()
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, TraceTask

    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     state=state_cls(type(task))(), agent=AgentInfo(config=vf.AgentConfig()))
    turns = [*prompt, vf.AssistantMessage(content=text)]
    trace.nodes = [MessageNode(parent=k - 1 if k else None, message=m, sampled=k == len(turns) - 1)
                   for k, m in enumerate(turns)]
    trace.stop("agent_completed")
    return trace


def _culprit(error: BaseException, hooks: list[Callable[..., Any]]) -> str | None:
    """The name of the hook in whose code ``error`` (a ``TaskError``'s cause) was raised."""
    codes = {}
    for fn in hooks:
        for f in (fn, inspect.unwrap(fn)):
            code = getattr(getattr(f, "__func__", f), "__code__", None)
            if code is not None:
                codes.setdefault(code, fn.__name__)
    cause = error.__cause__ or error
    tb, name = cause.__traceback__, None
    while tb is not None:
        name = codes.get(tb.tb_frame.f_code, name)
        tb = tb.tb_next
    return name


class TasksetEnv(TextEnv):
    """One verifiers taskset, each task one turn (see the module docstring).

    Args:
        module: the taskset package (the id's suffix).
        split: ``"train"`` or ``"test"``; given to the taskset config when it declares ``split``.
        accept_unreplayable: play a taskset whose rewards a replay cannot reproduce (its episodes
            are then not replayed).
        stop_strings: strings that end the turn (default none: the turn ends at EOS).
        **kwargs: the taskset's config.

    Metrics: each reward's score and each metric's value (floats, under their names).
    """

    def __init__(self, module: str, split: str = "train", accept_unreplayable: bool = False,
                 stop_strings: list[str] | tuple[str, ...] | None = None, **kwargs: Any) -> None:
        where = f"{PREFIX}{module}"
        if split not in ("train", "test"):
            raise ValueError(f"{where}: split must be 'train' or 'test', got {split!r}")
        vf = _vf()
        config = dict(kwargs)
        try:
            declared = vf.taskset_config_type(module).model_fields
        except (ImportError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"{where}: verifiers could not load the taskset: {_why(e)}") from None
        if "split" in declared:
            config["split"] = split
        self.env, self._tasks = load(module, config)
        unsupported, unreplayable = problems(self.env, self._tasks)
        self.unreplayable = admit(where, unsupported, unreplayable, accept_unreplayable)
        self.replayable = not self.unreplayable  # instance attribute: the trainer reads env.unwrapped.replayable
        stops = tuple(stop_strings or ())
        if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"{where}: stop_strings must be a list of non-empty strings")
        self.stop_strings = stops
        self.module, self.split, self._where = module, split, where
        self._hooks = self._tasks[0].hooks("reward") + self._tasks[0].hooks("metric")
        self.metric_types = {fn.__name__: float for fn in self._hooks}
        self._loop = Loop()
        self._task: Any = None
        self._prompt: list[Any] = []

    def __len__(self) -> int:
        return len(self._tasks)

    def close(self) -> None:
        self._loop.close()
        super().close()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        i = self._select_index(options)
        self._task = self._tasks[i]
        self._prompt = _messages(self._task.data)
        data = self._task.data
        answer = getattr(data, "answer", None)
        info = {"question_id": f"{self.module}/{self.split}/{getattr(data, 'id', None) or i}",
                "gold_answers": [str(answer)] if isinstance(answer, (str, int, float)) and answer != "" else [],
                "index": i}
        return render_prompt(self._prompt), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"an action is the text of one model turn, not {type(action).__name__}")
        if self._task is None:
            raise RuntimeError("call reset() first; the episode has ended")
        task, self._task = self._task, None
        trace = _trace(task, self._prompt, action)
        reward, metrics = self._loop.run(self._score(task, trace))
        return "", reward, True, False, {"metrics": metrics}

    async def _score(self, task: Any, trace: Any) -> tuple[float, dict[str, float]]:
        """``Task.score`` on ``trace``: the weighted reward and each signal's value."""
        from verifiers.v1.errors import TaskError

        limit = task.data.timeout.scoring if not self.replayable else None
        try:
            async with asyncio.timeout(limit):
                await task.score(trace)
        except TaskError as e:
            name = _culprit(e, self._hooks)
            what = f"reward function {name!r}" if name else "scoring"
            cause = e.__cause__ or e
            hint = " (@vf.reward and @vf.metric hooks must be async)" if "awaitable" in str(cause) else ""
            raise RewardError(f"{self._where}: {what} raised {type(cause).__name__}: {str(cause)[:200]}{hint}") from e
        except TimeoutError:
            pass  # accepted time-limited scoring: what finished counts, as verifiers scores a timed-out trace
        if self.replayable and (trace.info.get("judge_calls") or trace.extra_usage):
            raise RewardError(f"{self._where}: scoring called a model (an LLM judge), which a replay cannot "
                              "reproduce; set env.kwargs.accept_unreplayable = true to train on it anyway")
        metrics: dict[str, float] = {}
        for name, r in trace.rewards.items():
            if r is not None:
                metrics[name] = r.score
        for name, v in trace.metrics.items():
            if v is not None:
                metrics[name] = float(v)
        for name, v in metrics.items():
            if not math.isfinite(v):
                raise RewardError(f"{self._where}: reward function {name!r} returned {v}")
        return float(trace.reward), metrics

    def tokenizer_texts(self) -> Iterator[str]:
        for task in self._tasks:
            yield render_prompt(_messages(task.data))
            answer = getattr(task.data, "answer", None)
            if isinstance(answer, (str, int, float)) and answer != "":
                yield str(answer)
