"""Several trainers, one run: DiLoCo-style outer steps through the store (``docs/outer.md``).

Its room, one module per thing:

* :mod:`~stoa.fleet.outer.section`: ``[outer]``, a leaf (reading a config loads nothing else here);
* :mod:`~stoa.fleet.outer.codec`: an outer update as bytes (int8 or top-k sparse codes, error
  feedback), pure;
* :mod:`~stoa.fleet.outer.nesterov`: the Nesterov outer optimizer, pure;
* :mod:`~stoa.fleet.outer.exchange`: the ``<run>/outer/`` objects, signed or MAC'd, checked on read;
* :mod:`~stoa.fleet.outer.coordinator`: rank 0 (the run's key): deals the intake's steps, merges,
  and hands the trainer one merged step to publish;
* :mod:`~stoa.fleet.outer.inner`: ranks 1..N-1 (``stoa trainer --outer-rank i``): train what they
  are dealt, send the difference, apply the merge.

Nothing is imported here, so ``stoa.fleet.config`` reads ``[outer]`` without loading a process.
"""
