"""The operator's tools: what a person runs beside the trainer and the workers.

* :mod:`~stoa.fleet.operator.section`: the ``[fleet]`` section (the local launcher), a leaf;
* :mod:`~stoa.fleet.operator.launcher`: ``stoa train CONFIG``, a whole fleet on one machine with a live view;
* :mod:`~stoa.fleet.operator.report`: ``stoa report``, the plots and ``summary.md`` of a run folder;
* :mod:`~stoa.fleet.operator.status`: ``stoa status``, a run's state read from its store;
* :mod:`~stoa.fleet.operator.dashboard`: ``stoa dashboard``, the same and the run's curves on a live page;
* :mod:`~stoa.fleet.operator.sweep`: ``stoa sweep``, a grid of runs and its report.
"""
