"""Arithmetic, single turn: a verifiers 0.4 taskset written the way any verifiers user writes one.

Stoa trains on it as ``env.id = "verifiers:stoa_vf_v1_example"``; nothing here knows Stoa. verifiers
finds the taskset through ``__all__`` (one ``Taskset`` subclass), as ``vf-eval stoa_vf_v1_example`` does.
"""

from stoa_vf_v1_example.taskset import SumConfig, SumData, SumTask, SumTaskset

__all__ = ["SumConfig", "SumData", "SumTask", "SumTaskset"]
