"""Several reasoning-gym datasets as one task: ``reasoning_gym:<a>.<b>...`` (names joined by dots).

A curriculum of reasoning-gym datasets is one Stoa task (reasoning-gym's own ``composite`` is
refused: its weights and configs would be a second config language). Each dataset is a
:class:`~stoa.envs.rgym.ReasoningGymEnv` with the mixture's ``seed``, split sizes, system prompt
and scoring limits, plus its own config keys from ``configs``::

    [env]
    id = "reasoning_gym:chain_sum.leg_counting.spell_backward"

    [env.kwargs]
    seed = 0
    train_size = 2000
    test_size = 400
    configs = { chain_sum = { min_terms = 2, max_terms = 2 }, leg_counting = { max_animals = 2 } }

Items alternate between the datasets (item ``i`` is dataset ``i mod k``'s item ``i // k`` while
every dataset still has items; then the longer ones continue in turn), so any prefix of the test
split (``eval.num_questions``) holds the datasets in equal parts. Prompts, stop string, rewards and
scoring are each dataset's own. Metrics: those of :class:`~stoa.envs.rgym.ReasoningGymEnv`, plus
``correct_<dataset>`` on that dataset's items only, so evaluation reports each dataset's pass@1
(``eval/correct_<dataset>``) beside the mixture's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stoa.envs.base import TextEnv
from stoa.envs.rgym import PREFIX, ReasoningGymEnv
from stoa.envs.sandbox import INDETERMINATE

__all__ = ["ReasoningGymMix", "interleave"]


def interleave(sizes: list[int]) -> list[tuple[int, int]]:
    """``(dataset, index)`` of each mixture item for datasets of ``sizes`` items (the module docstring)."""
    out = []
    for j in range(max(sizes, default=0)):
        out += [(d, j) for d, n in enumerate(sizes) if j < n]
    return out


class ReasoningGymMix(TextEnv):
    """See the module docstring.

    Args:
        datasets: the reasoning-gym dataset names (the id's parts), at least two, each once.
        split: ``"train"`` or ``"test"``.
        configs: dataset name -> that dataset's own config keys.
        **shared: ``seed`` (required), ``train_size``, ``test_size``, ``system_prompt``,
            ``max_answer_chars`` and the scoring limits, the same for every dataset.
    """

    stop_strings = ("</answer>",)
    success_metric = "correct"
    indeterminate_metrics = {"score_error": INDETERMINATE}

    def __init__(self, datasets: tuple[str, ...], split: str = "train", configs: dict[str, Any] | None = None,
                 **shared: Any) -> None:
        where = PREFIX + ".".join(datasets)
        configs = dict(configs or {})
        unknown = sorted(set(configs) - set(datasets))
        if unknown:
            raise ValueError(f"{where}: configs names {unknown}, which are not among its datasets {list(datasets)}")
        for name, cfg in configs.items():
            if not isinstance(cfg, dict):
                raise ValueError(f"{where}: configs.{name} must be a table of that dataset's config keys")
        self.datasets = tuple(datasets)
        self.parts = [ReasoningGymEnv(name, split=split, **shared, **configs.get(name, {})) for name in datasets]
        for part in self.parts:
            if part.stop_strings != self.stop_strings:
                raise ValueError(f"{where}: every dataset must end its turn at {self.stop_strings}")
        self.metric_types = {**ReasoningGymEnv.metric_types, **{f"correct_{n}": bool for n in datasets}}
        self.headline_metrics = ("formatted", *(f"correct_{n}" for n in datasets))
        self._order = interleave([len(p) for p in self.parts])
        self._current: int | None = None

    def __len__(self) -> int:
        return len(self._order)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        i = self._select_index(options)
        part, j = self._order[i]
        prompt, info = self.parts[part].reset(options={"index": j})
        self._current = part
        return prompt, {**info, "index": i, "dataset": self.datasets[part]}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._current is None:
            raise RuntimeError("call reset() first; the episode has ended")
        part = self._current
        obs, reward, terminated, truncated, info = self.parts[part].step(action)  # a non-str action raises here
        self._current = None
        info["metrics"][f"correct_{self.datasets[part]}"] = info["metrics"]["correct"]
        return obs, reward, terminated, truncated, info

    def oracle_turns(self, index: int) -> list[str] | None:
        part, j = self._order[index]
        return self.parts[part].oracle_turns(j)

    def tokenizer_texts(self) -> Iterator[str]:
        for part in self.parts:
            yield from part.tokenizer_texts()

    def practice_kwargs(self, k: int) -> dict[str, Any]:
        return self.parts[0].practice_kwargs(k)  # one seed for all: past every dataset's items
