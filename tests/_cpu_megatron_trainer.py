"""Test-only launcher: the ``stoa`` command line with the CPU megatron shims applied first.

``python -m torch.distributed.run --nproc-per-node 2 tests/_cpu_megatron_trainer.py trainer CONFIG ...``
runs the real ``stoa trainer`` on CPU ranks over gloo. With ``STOA_TEST_PID_DIR`` set, each rank
writes its pid to ``rank<RANK>.pid`` there (so a test can kill -9 one rank).
"""

import os
from pathlib import Path

import _cpu_megatron

_cpu_megatron.apply()
if os.environ.get("STOA_TEST_PID_DIR"):
    pid_dir = Path(os.environ["STOA_TEST_PID_DIR"])
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))

from stoa.cli import main  # noqa: E402

main()
