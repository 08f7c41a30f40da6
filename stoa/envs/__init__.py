"""Text environments, made by id through gymnasium's registry.

Built-in ids (registered when ``stoa.envs`` is imported):

- ``stoa/PaperSearchQA-v0``: PaperSearchQA questions, PubMed retrieval, Search-R1 protocol
  (:class:`stoa.envs.papersearch.PaperSearchQAEnv`).
- ``stoa/SyntheticSearch-v0``: the same protocol over a seeded synthetic corpus
  (:class:`stoa.envs.synthetic.SyntheticSearchEnv`).
- ``stoa/SyntheticSearchHard-v0``: a harder synthetic corpus: paraphrased questions, distractors about
  similarly named entities, two-hop questions (:class:`stoa.envs.synthetic_hard.SyntheticSearchHardEnv`).

Families of ids made on demand (:data:`ID_PREFIXES`): ``reasoning_gym:<dataset>`` makes any
`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ dataset a task
(:class:`stoa.envs.rgym.ReasoningGymEnv`; ``pip install 'stoa[reasoning-gym]'``), and
``verifiers:<module>`` plays an installed verifiers environment: a classic module's
``load_environment()`` under verifiers 0.3 (:class:`stoa.envs.vf.VerifiersEnv`;
``pip install 'stoa[verifiers]'``), or a single-turn taskset scored by ``Task.score`` under 0.4
(:mod:`stoa.envs.vf_v1`).

A new task is a :class:`TextEnv` subclass registered with one call, from any package::

    stoa.envs.register("mylab/Arithmetic-v0", entry_point="mylab.envs:ArithmeticEnv")
    env = stoa.envs.make("mylab/Arithmetic-v0", split="test")
    stoa.envs.check_env(env)

or declared by an installed package in the entry-point group ``stoa.envs`` (registered here on
import; see :mod:`stoa.plugins`), which is how a fleet's workers all load the same code.

See ``docs/environments.md`` and ``examples/custom_env.py``.
"""

from __future__ import annotations

import gymnasium

from stoa.envs.base import TextEnv, TextSpace
from stoa.envs.check import EnvCheckError, check_env
from stoa.envs.registry import ID_PREFIXES, IdFamily, family, make, provider, register, resolve

__all__ = ["TextEnv", "TextSpace", "make", "register", "resolve", "provider", "family", "check_env", "EnvCheckError",
           "BUILTIN_IDS", "ID_PREFIXES", "IdFamily"]

BUILTIN_IDS = {
    "stoa/PaperSearchQA-v0": "stoa.envs.papersearch:PaperSearchQAEnv",
    "stoa/SyntheticSearch-v0": "stoa.envs.synthetic:SyntheticSearchEnv",
    "stoa/SyntheticSearchHard-v0": "stoa.envs.synthetic_hard:SyntheticSearchHardEnv",
}

for _id, _entry in BUILTIN_IDS.items():
    if _id not in gymnasium.registry:
        register(_id, _entry)


def _register_installed() -> None:
    # Ids of installed env packages (entry-point group "stoa.envs"); their code loads at make().
    from stoa.plugins import installed_envs

    for env_id, found in installed_envs().items():
        if env_id not in gymnasium.registry:
            register(env_id, found.entry_point)


_register_installed()
