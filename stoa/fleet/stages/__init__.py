"""Pipeline stages inside the fleet: a model's layers served by several machines.

The activation channel's wire format is :mod:`stoa.transport.frames` (below both this room and
the torch backend that speaks it).

* :mod:`~stoa.fleet.stages.discovery`: stages announce their address under the run, drivers read it;
* :mod:`~stoa.fleet.stages.server`: ``stoa stage``, one stage process (layers ``[a, b)``) that
  follows the chain for its share and serves a driver;
* :mod:`~stoa.fleet.stages.driver`: ``stoa worker --stages N``, the fleet worker holding stage 0
  and playing cohorts through the remote stages;
* :mod:`~stoa.fleet.stages.transcript`: the steps each stage signs, and blame by recomputation;
* :mod:`~stoa.fleet.stages.spotcheck`: the driver's recomputation of stages before an upload;
* :mod:`~stoa.fleet.stages.memory`: the memory cap held while a stage or a driver runs.

docs/pipeline.md says how they fit together and what is not built.
"""
