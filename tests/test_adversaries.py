"""The test doubles of stoa.testing.adversaries plug into the worker through its one seam."""

from __future__ import annotations

import inspect

from stoa.backends.engine import EngineWrapper, RolloutEngine


def test_every_adversary_keeps_the_engines_method_signatures():
    # The worker calls its engine with the protocol's own arguments; an adversary overriding one with
    # another signature crashed, under load, before it uploaded anything, and the fleet test then
    # found no record of it.
    from stoa.testing.adversaries import KINDS

    for kind, cls in KINDS.items():
        assert issubclass(cls, EngineWrapper), kind
        for klass in cls.__mro__[:cls.__mro__.index(EngineWrapper)]:
            for name, fn in vars(klass).items():
                base = getattr(RolloutEngine, name, None)
                if callable(fn) and callable(base) and not name.startswith("__"):
                    params = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
                    assert params(fn) == params(base), (kind, name)


def test_an_adversary_is_a_plain_worker_with_a_wrapped_engine():
    # The product class carries no hook that only a test double needs: an adversary is the Worker
    # itself, built with wrap_engine, and nothing in the adversaries subclasses or patches it.
    from stoa.fleet.worker import Worker
    from stoa.testing import adversaries
    from stoa.transport.signing import generate_private_key

    w = adversaries.make_adversary("flip-rewards", object(), "run", generate_private_key().public_key(), "w0",
                                   "/nonexistent", private_key=generate_private_key())
    assert type(w) is Worker and w.wrap_engine is adversaries.KINDS["flip-rewards"]
    assert not [c for c in vars(adversaries).values() if isinstance(c, type) and issubclass(c, Worker) and c is not Worker]
    for hook in ("make_engine", "finish_cohort", "sampling", "assigned", "_sync"):
        assert not hasattr(Worker, hook), hook
