"""The fleet runtime, one folder per process: :mod:`~stoa.fleet.trainer`, :mod:`~stoa.fleet.worker`,
the trainer's :mod:`~stoa.fleet.intake` and :mod:`~stoa.fleet.trust` checks, and the
:mod:`~stoa.fleet.operator`'s tools. :mod:`~stoa.fleet.config` assembles each room's config
section; ``docs/architecture.md`` draws the map."""
