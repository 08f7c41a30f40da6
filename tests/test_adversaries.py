"""The test doubles of stoa.testing.adversaries keep the worker's interface."""

from __future__ import annotations


def test_every_adversary_keeps_the_workers_method_signatures():
    # The worker loop calls its hooks with their own arguments (``_sync(version)`` since the forced
    # lag); an adversary overriding one with an older signature crashed, under load, before it
    # uploaded anything, and the fleet test then found no record of it.
    import inspect

    from stoa.fleet.worker import Worker
    from stoa.testing.adversaries import KINDS

    for kind, cls in KINDS.items():
        for name, fn in vars(cls).items():
            base = getattr(Worker, name, None)
            if callable(fn) and callable(base) and not name.startswith("__"):
                params = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
                assert params(fn) == params(base), (kind, name)
