"""What a pipeline stage fetches to follow the signed weight chain for its layers only.

Publishes a model's int8 state as an anchor and a few deltas (optimizer-step-like code changes)
into a LocalStore, then syncs every stage of 2, 4 and 8 stages with a ShareSubscriber (range
reads of the anchor, whole deltas) and a whole-model WeightSubscriber beside them. Prints the
bytes each fetched, the manifest with and without per-share hashes, and the publisher's hashing
time with and without shares.

    python benchmarks/stage_sync.py [--model PATH]     # default: SmolLM2-135M-Instruct if built
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from stoa.transport import pulse, shares
from stoa.transport.chain import ShareSubscriber, WeightPublisher, WeightSubscriber
from stoa.transport.manifest import Layout
from stoa.transport.signing import generate_private_key
from stoa.transport.store import LocalStore


def split(layers: int, stages: int) -> list[tuple[int, int]]:
    q, r = divmod(layers, stages)
    b = [0]
    for i in range(stages):
        b.append(b[-1] + q + (i < r))
    return list(zip(b[:-1], b[1:]))


def step(state: dict[str, np.ndarray], rng: np.random.Generator, rate: float) -> dict[str, np.ndarray]:
    new = {k: v.copy() for k, v in state.items()}
    for a in new.values():
        if a.dtype == np.uint8:
            flat = a.reshape(-1)
            at = rng.choice(flat.size, int(rate * flat.size), replace=False)
            flat[at] = (flat[at].astype(np.int16) + 1).clip(0, 255).astype(np.uint8)
    return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a HF model folder (default: the built SmolLM2-135M-Instruct)")
    ap.add_argument("--deltas", type=int, default=2)
    ap.add_argument("--rate", type=float, default=0.002, help="fraction of int8 codes a step changes")
    args = ap.parse_args()
    from stoa.backends.torch.engine import pretrained_state
    from stoa.testing import realmodel

    path = Path(args.model) if args.model else realmodel.cached()
    if path is None:
        raise SystemExit("no model: pass --model PATH or run `python -m stoa.testing.realmodel`")
    import json

    cfg = json.loads((path / "config.json").read_text())
    layers, tied = int(cfg["num_hidden_layers"]), bool(cfg.get("tie_word_embeddings", False))
    state = pretrained_state(path)
    t0 = time.process_time()
    pulse.state_hash(state)
    t1 = time.process_time()
    pulse.state_hashes(state, shares.share_of)
    t2 = time.process_time()
    print(f"{path.name}: {layers} layers, tied={tied}, {len(state)} tensors, "
          f"{sum(a.nbytes for a in state.values()) / 1e6:.1f} MB; state hash {t1 - t0:.2f} CPU-s, "
          f"with per-share hashes {t2 - t1:.2f} CPU-s")
    key, rng = generate_private_key(), np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {}
        for flag in (False, True):
            store = LocalStore(Path(tmp) / str(flag))
            pub = WeightPublisher(store, "run", key, shares=flag)
            pub.publish(1, state)
            sizes[flag] = store.size(Layout("run").manifest(1))
        print(f"manifest: {sizes[False]} B without shares, {sizes[True]} B with {layers + 2} shares "
              f"(+{sizes[True] - sizes[False]} B)")
        s = state
        for v in range(2, 2 + args.deltas):
            s = step(s, rng, args.rate)
            r = pub.publish(v, s)
            print(f"version {v}: delta {r.delta_bytes} B")
        anchor = store.size(Layout("run").payload(1, "anchor"))
        t = time.process_time()
        whole = WeightSubscriber(store, "run", key.public_key()).sync(None)
        print(f"anchor {anchor} B; a whole-model worker joining reads {whole.bytes_read} B "
              f"({time.process_time() - t:.2f} CPU-s)")
        print("| stages | stage | layers | bytes read | of the whole join | share bytes | CPU-s |")
        print("|---:|---:|---|---:|---:|---:|---:|")
        for stages in (2, 4, 8):
            for i, part in enumerate(split(layers, stages)):
                t = time.process_time()
                r = ShareSubscriber(store, "run", key.public_key(), part, layers, tied).sync(None)
                dt = time.process_time() - t
                want = shares.stage_names(s, part, layers, tied)
                assert sorted(r.state) == want and all(r.state[n].tobytes() == s[n].tobytes() for n in want)
                mine = sum(a.nbytes for a in r.state.values())
                print(f"| {stages} | {i} | {part[0]}-{part[1] - 1} | {r.bytes_read:,} | "
                      f"{r.bytes_read / whole.bytes_read:.2f} | {mine:,} | {dt:.2f} |")


if __name__ == "__main__":
    main()
