"""Test-only: make megatron-core's model code run on this CPU-only machine (see FACTS.md).

``apply()`` installs the two shims ``tests/test_megatron.py`` uses in its fixture: a
``torch.cuda.current_device`` that answers "cpu" and megatron's inference RNG tracker. The
library never patches megatron; only processes the tests start import this.
"""

from __future__ import annotations


def apply() -> None:
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core warns at import about apex / Transformer Engine
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
