"""``<run_dir>/ledger.jsonl``: the fate of every group the trainer was offered.

One JSON object a line, each stamped with the trainer's ``rl_step`` and ``version`` when it was
written: ``trained`` (the scoped group ids of one optimizer step and their policy versions),
``dropped`` (groups dropped as stale, reused or malformed), ``rejected`` (a quarantined batch and
why), ``banned`` (a worker key and why) and ``checkpoint`` (a marker per checkpoint). On resume
the file is cut back to the checkpoint's marker, so it always describes exactly the training the
current weights contain. Lines are fsynced: a crash loses at most the line being written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["Ledger"]


class Ledger:
    """Appends to and cuts one ledger file; ``position()`` gives the stamp of each line."""

    def __init__(self, path: Path, position: Callable[[], dict[str, int]]):
        self.path, self.position = Path(path), position

    def write(self, **entry: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({**self.position(), **entry}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def cut(self, checkpoint: str | None) -> None:
        """Forget the lines written after ``checkpoint``'s marker (all of them for None): that training was lost."""
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        keep = 0
        if checkpoint is not None:
            keep = len(lines)
            for i, line in enumerate(lines):
                try:
                    if json.loads(line).get("checkpoint") == checkpoint:
                        keep = i + 1
                except json.JSONDecodeError:
                    break
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(lines[:keep]))
        tmp.replace(self.path)
