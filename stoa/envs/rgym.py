"""reasoning-gym datasets as Stoa tasks: ``stoa.envs.make("reasoning_gym:<dataset>", seed=..., ...)``.

Several datasets joined by dots (``reasoning_gym:chain_sum.leg_counting``) make one mixed task
(:mod:`stoa.envs.rgym_mix`).

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (``pip install 'stoa[reasoning-gym]'``)
generates ~100 procedural reasoning datasets, each with its own ``score_answer``. Any of them is a
single-turn :class:`ReasoningGymEnv`:

- **Prompt**: reasoning-gym's system prompt (``SYSTEM_PROMPTS[system_prompt]``, ``"default"``:
  think, then ``<answer>answer here</answer>``), a newline, and the item's question.
- **One turn**, ending at ``</answer>``. The answer is the text of the last ``<answer>...</answer>``
  pair, stripped (reasoning-gym's ``extract_answer``, done in linear time); ``None`` without tags.
- **Reward**: the dataset's own ``score_answer(answer, entry)`` in [0, 1], partial credit included,
  computed in a sandboxed process (:mod:`stoa.envs.sandbox`).
- **Success** (``correct``, pass@1): the score is 1.0. reasoning-gym's scorers give 1.0 only to an
  answer they judge fully right (the default scorer: the exact gold string; puzzle scorers: any
  valid solution, e.g. another countdown expression) and less for partial credit (an answer that
  contains the gold one, a parseable but wrong one); an exact comparison with the gold string
  would fail every other valid solution of the puzzle datasets.

Keyword arguments: the dataset's own config keys (``min_terms=2``, ...), ``seed`` (required),
``train_size``, ``test_size``, ``system_prompt``, ``max_answer_chars`` and the scoring limits.

**Splits.** One dataset of ``train_size + test_size`` items is made with ``seed``: train is items
``[0, train_size)``, test the rest, less every test item whose question text is also a train
question. Two seeds are *not* two splits: reasoning-gym derives item ``i`` from ``seed + i``, so
``seed=s+1`` is ``seed=s`` shifted by one item and shares all but one of its items.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from typing import Any

from stoa.envs.base import TextEnv
from stoa.envs.sandbox import INDETERMINATE, SandboxLimits, shared_sandbox

__all__ = ["PREFIX", "REFUSED", "ReasoningGymEnv", "dataset_names", "extract_answer", "register_id", "survey"]

PREFIX = "reasoning_gym:"
DISTRIBUTION = "reasoning-gym"

REFUSED = {
    "composite": "a weighted mix of other datasets in one config; make one env per dataset instead",
    "intermediate_integration": "some gold answers restate the question as Integral(...) (no antiderivative "
                                "found), and its scorer gives 1.0 to any answer that restates the integral; Stoa's "
                                "answer screen refuses Integral, so those items would have no right answer",
}
"""Datasets the adapter refuses by name, with the reason."""

_SETUP = ("stoa.envs.rgym:_sandbox_setup",)
_SCORER = "stoa.envs.rgym:_scorer"
_OWN_KWARGS = ("split", "seed", "train_size", "test_size", "system_prompt", "max_answer_chars",
               "score_cpu_seconds", "score_wall_seconds", "score_memory_mb")


def dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers (refused ones included)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def register_id(env_id: str) -> None:
    """Register ``reasoning_gym:<dataset>`` with gymnasium (the id-prefix handler of ``stoa.envs``).

    Raises:
        ValueError: reasoning-gym is not installed, the dataset does not exist or is refused.
    """
    import stoa.envs

    parts = env_id[len(PREFIX):].split(".")
    try:
        names = dataset_names()
    except ImportError:
        raise ValueError(f"{env_id!r} needs reasoning-gym: pip install 'stoa[reasoning-gym]'") from None
    for name in parts:
        if name in REFUSED:
            raise ValueError(f"{PREFIX}{name} is refused: {REFUSED[name]}")
        if name not in names:
            import difflib

            close = difflib.get_close_matches(name, names, 1)
            raise ValueError(f"reasoning-gym has no dataset {name!r}" + (f": did you mean {PREFIX}{close[0]}?" if close
                                                                          else "") + " (`stoa envs list` shows them)")
    if len(parts) == 1:
        stoa.envs.register(env_id, "stoa.envs.rgym:ReasoningGymEnv", kwargs={"dataset": parts[0]})
    elif len(set(parts)) != len(parts):
        raise ValueError(f"{env_id!r} names a dataset twice")
    else:  # a mixture (stoa.envs.rgym_mix)
        stoa.envs.register(env_id, "stoa.envs.rgym_mix:ReasoningGymMix", kwargs={"datasets": tuple(parts)})


def extract_answer(turn: str) -> str | None:
    """The stripped text of the last ``<answer>...</answer>`` pair (pairs found left to right, as
    reasoning-gym's regex finds them), or ``None``. Linear in ``len(turn)``."""
    found, pos = None, 0
    while True:
        start = turn.find("<answer>", pos)
        if start < 0:
            return found
        end = turn.find("</answer>", start + 8)
        if end < 0:
            return found
        found, pos = turn[start + 8:end].strip(), end + 9


class _Items:
    """One seeded reasoning-gym dataset of ``train_size + test_size`` items, generated on demand."""

    def __init__(self, name: str, config: tuple, seed: int, train_size: int, test_size: int) -> None:
        import reasoning_gym

        try:
            self.dataset = reasoning_gym.create_dataset(name, seed=seed, size=train_size + test_size, **dict(config))
        except TypeError as e:
            raise ValueError(f"reasoning_gym:{name}: {e}; its config keys: {_config_keys(name)}") from None
        self.train_size, self._cache, self._test = train_size, {}, None

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self._cache.get(i)
        if item is None:
            item = self._cache[i] = self.dataset[i]
        return item

    def indices(self, split: str) -> list[int]:
        if split == "train":
            return list(range(self.train_size))
        if self._test is None:
            seen = {self[i]["question"] for i in range(self.train_size)}
            self._test = [i for i in range(self.train_size, self.dataset.size) if self[i]["question"] not in seen]
        return self._test


@functools.lru_cache(maxsize=32)
def _items(name: str, config: tuple, seed: int, train_size: int, test_size: int) -> _Items:
    return _Items(name, config, seed, train_size, test_size)


def _frozen(value: Any) -> Any:
    """Lists (a TOML array) as tuples, so that a config can key caches."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _config_keys(name: str) -> list[str]:
    import dataclasses

    from reasoning_gym.factory import DATASETS

    return [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("seed", "size")]


class ReasoningGymEnv(TextEnv):
    """One reasoning-gym dataset, single turn (see the module docstring).

    Args:
        dataset: the reasoning-gym dataset name (the id's suffix).
        split: ``"train"`` or ``"test"``.
        seed: the dataset's seed (required; the splits are index ranges of one seeded sequence).
        train_size, test_size: the split sizes before test items that repeat a train question
            are dropped.
        system_prompt: a key of reasoning-gym's ``SYSTEM_PROMPTS``, or ``""`` for the bare question.
        max_answer_chars: a longer answer scores 0 without reaching the scorer.
        score_cpu_seconds, score_wall_seconds, score_memory_mb: the scoring sandbox's limits.
        **config: the dataset's own config keys.

    Metrics: ``correct`` (the score is 1.0), ``formatted`` (the turn had ``<answer>`` tags),
    ``score`` (the reward) and ``score_error`` (``""``, or why the scorer gave no score:
    ``"timeout"``, ``"crashed"``, ``"memory"``, ``"recursion"``, ``"error:<Exception>"``; the
    reward is then 0 and ``info["score_error"]`` says the same). ``"timeout"`` and ``"crashed"``
    depend on the machine's load (:data:`~stoa.envs.sandbox.INDETERMINATE`): an episode that holds
    one, in the worker's claim or the trainer's replay, is unverifiable, not a forgery.
    """

    stop_strings = ("</answer>",)
    metric_types = {"correct": bool, "formatted": bool, "score": float, "score_error": str}
    success_metric = "correct"
    headline_metrics = ("formatted", "score")
    indeterminate_metrics = {"score_error": INDETERMINATE}

    def __init__(self, dataset: str, split: str = "train", seed: int | None = None, train_size: int = 1000,
                 test_size: int = 200, system_prompt: str = "default", max_answer_chars: int = 8192,
                 score_cpu_seconds: float = 5.0, score_wall_seconds: float = 10.0, score_memory_mb: int = 1024,
                 **config: Any) -> None:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        where = f"reasoning_gym:{dataset}"
        if dataset in REFUSED:
            raise ValueError(f"{where} is refused: {REFUSED[dataset]}")
        if seed is None or isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{where} needs an int seed in env.kwargs (seed = 0): the train and test splits are "
                             "index ranges of one seeded sequence, so an unseeded dataset would differ on every machine")
        if split not in ("train", "test"):
            raise ValueError(f"{where}: split must be 'train' or 'test', got {split!r}")
        if not (isinstance(train_size, int) and isinstance(test_size, int) and train_size >= 1 and test_size >= 1):
            raise ValueError(f"{where}: train_size and test_size must be ints >= 1")
        if system_prompt and system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(f"{where}: system_prompt {system_prompt!r} is not one of {sorted(SYSTEM_PROMPTS)} (or '')")
        bad = sorted(set(config) - set(_config_keys(dataset)))
        if bad:
            raise ValueError(f"{where}: unknown config key(s) {bad}; its config keys: {_config_keys(dataset)}")
        self.dataset, self.split, self.seed = dataset, split, seed
        self.train_size, self.test_size, self.max_answer_chars = train_size, test_size, max_answer_chars
        self.config = tuple(sorted((k, _frozen(v)) for k, v in config.items()))  # hashable, picklable
        self._items = _items(dataset, self.config, seed, train_size, test_size)
        self._indices = self._items.indices(split)
        if not self._indices:
            raise ValueError(f"{where}: every test item repeats a train question; raise test_size")
        self._header = SYSTEM_PROMPTS[system_prompt] + "\n" if system_prompt else ""
        self._sandbox = shared_sandbox(_SETUP, SandboxLimits(cpu_seconds=score_cpu_seconds,
                                                             wall_seconds=score_wall_seconds,
                                                             memory_mb=score_memory_mb))
        self._entry: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self._indices)

    def _item(self, index: int) -> dict[str, Any]:
        return self._items[self._indices[index]]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        i = self._select_index(options)
        self._entry = self._item(i)
        question = str(self._entry["question"]).replace("<|", "&lt;|")
        gold = self._entry.get("answer")
        info = {"question_id": f"{self.dataset}/{self.seed}/{self._indices[i]}",
                "gold_answers": [] if gold is None else [str(gold)], "index": i}
        return self._header + question, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"an action is the text of one model turn, not {type(action).__name__}")
        if self._entry is None:
            raise RuntimeError("call reset() first; the episode has ended")
        entry, self._entry = self._entry, None
        answer = extract_answer(action)
        info: dict[str, Any] = {}
        if answer is not None and len(answer) > self.max_answer_chars:
            score, error = 0.0, ""
            info["refused"] = f"answer longer than {self.max_answer_chars} characters"
        else:
            score, error = self.score(answer, entry)
        if error:
            info["score_error"] = error
        info["metrics"] = {"correct": score >= 1.0, "formatted": answer is not None, "score": score,
                           "score_error": error}
        return "", score, True, False, info

    def score(self, answer: str | None, entry: dict[str, Any]) -> tuple[float, str]:
        """``(score, error)`` of the dataset's ``score_answer(answer, entry)``, run in the sandbox;
        the score is clipped to [0, 1] and is 0 when ``error`` is set."""
        score, error = self._sandbox.call(_SCORER, (self.dataset, self.config, self.seed, self.train_size + self.test_size),
                                          answer, entry)
        return (0.0, error) if error else (min(max(score, 0.0), 1.0), "")

    def oracle_turns(self, index: int) -> list[str] | None:
        gold = self._item(index).get("answer")
        return None if gold is None else [f"<answer>{gold}</answer>"]

    def tokenizer_texts(self) -> Iterator[str]:
        for i in range(len(self)):
            item = self._item(i)
            yield self._header + str(item["question"])
            if item.get("answer") is not None:
                yield f"<answer>{item['answer']}</answer>"

    def practice_kwargs(self, k: int) -> dict[str, Any]:
        return {"seed": self.seed + k * (self.train_size + self.test_size)}  # past both splits' items


# -- the sandbox side ----------------------------------------------------------------------------------
_MATH_NAMES = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh", "tanh", "coth",
    "asinh", "acosh", "atanh", "exp", "log", "ln", "sqrt", "pi", "oo", "Abs", "sign", "floor", "ceiling",
})
_EXPR_CHARS = re.compile(r"[0-9A-Za-z+\-*/^()., \t\n]*")
_EXPR_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_ATTRIBUTE = re.compile(r"\.\s*[A-Za-z]")


def _plain_expression(text: Any, local_dict: dict | None) -> str:
    """``text`` if it is plain arithmetic: digits, operators, parentheses, commas, decimal points,
    single-letter symbols, the names of common math functions and ``local_dict``'s keys. Nothing
    else reaches sympy's ``parse_expr`` (which ``eval``s its input): no underscores, quotes,
    brackets, attribute access or builtins, so no text can call code."""
    if not isinstance(text, str) or not _EXPR_CHARS.fullmatch(text) or _ATTRIBUTE.search(text):
        raise ValueError("not a plain arithmetic expression")
    allowed = _MATH_NAMES | set(local_dict or ())
    for name in _EXPR_NAME.findall(text):
        if len(name) > 1 and name not in allowed:
            raise ValueError(f"name {name!r} is not allowed in an answer")
    return text


def _literal(text: Any, *_: Any) -> Any:
    """A Python literal (what the scorers that ``eval`` an answer expect: lists, strings, numbers)."""
    if not isinstance(text, str):
        raise TypeError("eval() arg must be a string")
    return ast.literal_eval(text)


def _sandbox_setup() -> None:
    """Import reasoning-gym in the sandbox and close its scorers' code-running paths at the source:
    ``eval`` becomes :func:`_literal` in the modules that ``eval`` answers, and ``parse_expr``
    refuses all but :func:`_plain_expression`."""
    import importlib

    import sympy
    from sympy.parsing import sympy_parser

    import reasoning_gym  # noqa: F401 - every dataset module, before the lockdown

    for mod in ("algorithmic.string_insertion", "algorithmic.spiral_matrix", "algorithmic.binary_matrix",
                "algorithmic.number_sorting", "games.n_queens"):
        importlib.import_module(f"reasoning_gym.{mod}").eval = _literal
    real = sympy_parser.parse_expr

    def parse_expr(s: Any, local_dict: dict | None = None, *args: Any, **kwargs: Any) -> Any:
        return real(_plain_expression(s, local_dict), local_dict, *args, **kwargs)

    sympy.parse_expr = sympy_parser.parse_expr = parse_expr
    for mod in ("games.countdown", "games.puzzle24"):
        importlib.import_module(f"reasoning_gym.{mod}").parse_expr = parse_expr
    x = sympy.Symbol("x")  # load sympy's lazily imported parts while files may still be read freely
    sympy.simplify(sympy.diff(parse_expr("x**2/2 + sin(x)", {"x": x}), x) - x)


def _scorer(name: str, config: tuple, seed: int, size: int) -> Any:
    """The dataset's ``score_answer`` (built in the sandbox, once per dataset)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **dict(config)).score_answer


# -- `stoa envs list` ----------------------------------------------------------------------------------
def survey(names: list[str] | None = None, *, train_size: int = 6, test_size: int = 4,
           progress: Any = None) -> tuple[list[str], dict[str, str]]:
    """Which datasets load and pass ``check_env`` through the adapter (with ``seed=0`` and small
    splits), and why the others are refused: ``(passing, {name: reason})``. The oracle (the gold
    answer) must also score 1.0 on the first and last items of both splits."""
    import contextlib
    import io

    passing, refused = [], {}
    for name in names if names is not None else dataset_names():
        if progress:
            progress(name)
        if name in REFUSED:
            refused[name] = REFUSED[name]
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # some generators print
                _check_one(name, train_size, test_size)
        except Exception as e:  # noqa: BLE001 - every failure is a reason to list
            refused[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        passing.append(name)
    return passing, refused


def _check_one(name: str, train_size: int, test_size: int) -> None:
    from stoa.envs import check_env, make

    kwargs = {"seed": 0, "train_size": train_size, "test_size": test_size}
    check_env(make(PREFIX + name, **kwargs))
    for split in ("train", "test"):
        env = make(PREFIX + name, split=split, **kwargs).unwrapped
        for i in sorted({0, len(env) - 1}):
            turns = env.oracle_turns(i)
            if turns is None:
                continue
            env.reset(options={"index": i})
            metrics = env.step(turns[0])[4]["metrics"]
            if not metrics["correct"]:
                raise AssertionError(f"its gold answer scores {metrics['score']} {metrics['score_error']}".strip())
