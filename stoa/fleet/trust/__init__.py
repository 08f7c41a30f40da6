"""The trainer's checks of what strangers upload, in the order a batch meets them.

* :mod:`~stoa.fleet.trust.section`: the ``[trust]`` and ``[trust.audit]`` sections, leaves;
* :mod:`~stoa.fleet.trust.admission`: the run's own bounds (sampling settings, reward range,
  metric types, task id), before anything is scored;
* :mod:`~stoa.fleet.trust.assign`: the work each key's n-th batch owes (salted per key; probation
  work before the key's salt is published);
* :mod:`~stoa.fleet.trust.binding`: the version and beacon the trainer binds to a key's number
  when the worker tickets it (tickets, the signed bindings document);
* :mod:`~stoa.fleet.trust.bounds`: a batch's version (future, stale, its key's version floor), its
  number's binding and its assigned work, before review; the typed ``Judgement``;
* :mod:`~stoa.fleet.trust.gate`: the :class:`~stoa.fleet.trust.gate.TrustGate`, the one object the
  intake asks (a few verbs with typed results), over three kinds of state: :mod:`~stoa.fleet.trust.roster` (who may upload, bans, assignment salts),
  :mod:`~stoa.fleet.trust.records` (per-key accounting, bans, the signed ``TrustReport``) and
  :mod:`~stoa.fleet.trust.review` (replay, audit, spot-checks, the sampling check, as typed
  :class:`~stoa.types.Verdict` values);
* :mod:`~stoa.fleet.trust.replay`: episodes re-played through the trainer's own environment;
* :mod:`~stoa.fleet.trust.audit`: behaviour log-probs against the learner's and the int8 policy's;
* :mod:`~stoa.fleet.trust.ledger`: the record of every group's fate;
* :mod:`~stoa.fleet.trust.planted`: numbers planted under a worker's id are not its gaps.

Each module is imported by its own name (this package's face imports nothing, so reading a run
config loads none of the checks). :class:`stoa.fleet.intake.Intake` strings them together between
the store and the training pool (the route is described once, in ``docs/architecture.md``);
``docs/trust.md`` says what each defends against.
"""
