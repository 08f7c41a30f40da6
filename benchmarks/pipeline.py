"""Pipeline-parallel generation across processes: what the activation channel costs.

A model is cut into S stages (``stoa.backends.torch.pipeline``); stage 0 runs in this process
(the *driver*: embeddings, the rows' tokens), stages 1..S-1 each in their own process, each
reading only its share of one anchor file by byte ranges. Frames travel a ring: driver -> stage 1
-> ... -> stage S-1 -> driver. Every frame but the last carries the residual stream of a
micro-batch (float32, exact); the last stage samples (the seeded Gumbel-max rule on float32
logits, ``stoa.backends.sampling.HostSampler``) and sends back only tokens and log-probs.

The workload: B rows, a prompt of P random tokens each, N generated tokens per row (EOS does not
end a row, so the batch holds). The rows are split into M micro-batches that circle the ring
independently: while one waits on a link, the others keep the stages busy. The baseline is the
whole model in one process (one stage, the full batch at once), measured in the same run; every
row's tokens are compared with it.

Two channels for the frames between stages:

* ``tcp``: one TCP connection per boundary, each through its own emulated link
  (``stoa.testing.links``, in its own process: one-way latency added to every chunk, a rate cap
  each way); frames are an 8-byte length and the bytes.
* ``store``: one object per frame in a real S3 server (SeaweedFS on loopback, every process
  through its own emulated link): the sender PUTs ``act/<boundary>/<seq>``, the receiver GETs
  it, polling every 2 ms until it exists.

Reported per (channel, stages, micro-batches, one-way latency): generated tokens/s, the ratio
to the baseline, bytes per generated token per boundary, whether the tokens equal the baseline's,
and each stage's idle share: 1 - busy / wall, where busy is the seconds the stage spent in its
forward passes and sampling during the timed generation and wall is that generation's time. A
marker frame circles the ring before the timed generation (each stage starts counting there);
each stage sends its busy seconds back to the driver over the control queue when it stops.

    python benchmarks/pipeline.py [--quick] [--json out.json] [--model PATH] [--stages 2,4]
        [--latency-ms 0,20,50] [--micro 1,4] [--batch 32] [--tokens 32] [--channels tcp,store]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEED = 1234
_POLL_S = 0.002


# -- frames and channels ----------------------------------------------------------------------------

def pack(meta: dict, arr: np.ndarray | None = None) -> bytes:
    if arr is not None:
        meta = {**meta, "dtype": arr.dtype.str, "shape": list(arr.shape)}
    head = json.dumps(meta).encode()
    body = b"" if arr is None else np.ascontiguousarray(arr).tobytes()
    return struct.pack("<I", len(head)) + head + body


def unpack(buf: bytes) -> tuple[dict, np.ndarray | None]:
    (n,) = struct.unpack_from("<I", buf)
    meta = json.loads(buf[4:4 + n])
    if "dtype" not in meta:
        return meta, None
    return meta, np.frombuffer(buf, np.dtype(meta["dtype"]), offset=4 + n).reshape(meta["shape"])


class TcpOut:
    def __init__(self, port: int) -> None:
        for _ in range(200):
            try:
                self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"cannot reach 127.0.0.1:{port}")
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sent = 0

    def send(self, frame: bytes) -> None:
        self.sock.sendall(struct.pack("<Q", len(frame)) + frame)
        self.sent += 8 + len(frame)


class TcpIn:
    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.sock: socket.socket | None = None

    def _exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(min(n - len(out), 1 << 20))
            if not chunk:
                raise ConnectionError("peer closed")
            out += chunk
        return bytes(out)

    def recv(self) -> bytes:
        if self.sock is None:
            self.sock, _ = self.listener.accept()
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        (n,) = struct.unpack("<Q", self._exact(8))
        return self._exact(n)


def _store(endpoint: str, bucket: str):
    from stoa.testing.seaweed import ACCESS_KEY, SECRET_KEY
    from stoa.transport.s3 import S3Store

    return S3Store(bucket, "act", endpoint_url=endpoint, credentials=(ACCESS_KEY, SECRET_KEY))


class StoreOut:
    def __init__(self, endpoint: str, bucket: str, boundary: int, run: str) -> None:
        self.store, self.prefix, self.seq, self.sent = _store(endpoint, bucket), f"{run}/{boundary}", 0, 0

    def send(self, frame: bytes) -> None:
        self.store.put(f"{self.prefix}/{self.seq:09d}", frame)
        self.seq += 1
        self.sent += len(frame)


class StoreIn:
    def __init__(self, endpoint: str, bucket: str, boundary: int, run: str) -> None:
        self.store, self.prefix, self.seq = _store(endpoint, bucket), f"{run}/{boundary}", 0
        self.polls = 0

    def recv(self) -> bytes:
        from stoa.transport.store import KeyNotFound

        key = f"{self.prefix}/{self.seq:09d}"
        deadline = time.monotonic() + 120
        while True:
            try:
                data = self.store.get(key)
                self.seq += 1
                return data
            except KeyNotFound:
                self.polls += 1
                if time.monotonic() > deadline:
                    raise TimeoutError(key) from None
                time.sleep(_POLL_S)


def listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


# -- stages -------------------------------------------------------------------------------------------

def load_stage(model: Path, anchor: Path, part: tuple[int, int]):
    from stoa.backends.torch import pipeline as P
    from stoa.backends.torch.families import read_spec

    spec = read_spec(model, "torch", RuntimeError)
    with open(anchor, "rb") as fh:
        def read(a: int, b: int) -> bytes:
            fh.seek(a)
            return fh.read(b - a)

        share, _, got = P.read_share(read, anchor.stat().st_size, part, spec.num_hidden_layers,
                                     spec.tie_word_embeddings)
    return P.Stage(model, part, share, device="cpu"), got


def seeds_of(rows: np.ndarray, pos: int) -> np.ndarray:
    return ((rows.astype(np.uint64) + np.uint64(SEED)) * np.uint64(1_000_003) + np.uint64(pos)).astype(np.uint64)


class Runner:
    """One stage's compute on per-micro-batch caches (rows of micro-batch g: its own cache).

    ``busy`` sums the seconds spent in :meth:`forward` and :meth:`sample`; the caller zeroes it."""

    def __init__(self, stage) -> None:
        import torch

        self.torch, self.stage, self.caches, self.busy = torch, stage, {}, 0.0
        from stoa.backends.sampling import HostSampler

        self.sampler = HostSampler()

    def forward(self, g: int, x: np.ndarray, start: np.ndarray, longest: int):
        from stoa.backends.torch.decoder import KVCache

        torch, st = self.torch, self.stage
        if g not in self.caches:
            s = st.decoder.spec
            self.caches[g] = KVCache(len(st.decoder.layers), x.shape[0], s.num_key_value_heads, s.head_dim,
                                     st.decoder.dtype, st.device)
        cache = self.caches[g]
        t0 = time.perf_counter()
        cache.ensure(longest)
        with torch.no_grad():
            h = st.decoder.forward(torch.from_numpy(np.array(x)), torch.from_numpy(start), longest, cache)
        self.busy += time.perf_counter() - t0
        return h

    def sample(self, hidden, rows: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        with self.torch.no_grad():
            logits = self.stage.decoder.logits(hidden[:, -1])
        out = self.sampler(logits.float().numpy(), seeds_of(rows, pos), 1.0, 0, 1.0)
        self.busy += time.perf_counter() - t0
        return out


def stage_main(model: str, anchor: str, part: tuple[int, int], last: bool, inbox: dict, ready, control,
               threads: int) -> None:
    """A stage process: load its share, report, learn where to send, then serve frames until a stop.

    A ``mark`` frame starts the count of busy seconds (and CPU seconds); at the ``stop`` the stage
    puts ``{"part", "busy_s", "cpu_s"}`` on ``ready`` before passing the stop on."""
    import torch

    torch.set_num_threads(threads)
    stage, got = load_stage(Path(model), Path(anchor), part)
    runner = Runner(stage)
    lis = listener() if inbox["kind"] == "tcp" else None
    ready.put({"part": part, "port": lis.getsockname()[1] if lis else None, "bytes_read": got,
               "memory": asdict(stage.memory())})
    dst = make_out(control.get(timeout=300))
    src = TcpIn(lis) if lis else StoreIn(**inbox["args"])
    cpu0 = time.process_time()
    while True:
        meta, x = unpack(src.recv())
        if meta.get("mark"):
            runner.busy, cpu0 = 0.0, time.process_time()
            dst.send(pack(meta))
            continue
        if meta.get("stop"):
            ready.put({"part": part, "busy_s": runner.busy, "cpu_s": time.process_time() - cpu0})
            dst.send(pack(meta))
            return
        h = runner.forward(meta["g"], x, np.asarray(meta["start"], np.int64), meta["longest"])
        if last:
            toks, lps = runner.sample(h, np.asarray(meta["rows"]), meta["longest"])
            dst.send(pack({"g": meta["g"]}, np.stack([toks.astype(np.float64), lps.astype(np.float64)])))
        else:
            meta.pop("dtype", None)
            meta.pop("shape", None)
            dst.send(pack(meta, h.numpy()))


def make_out(spec: dict):
    return TcpOut(spec["port"]) if spec["kind"] == "tcp" else StoreOut(**spec["args"])


# -- the driver -----------------------------------------------------------------------------------------

def generate(runner, src, dst, prompts: np.ndarray, n_tokens: int, micro: int, last_local: bool) -> np.ndarray:
    """Generate ``n_tokens`` per row; ``runner`` holds stage 0 (and, with ``last_local``, every layer)."""
    b = prompts.shape[0]
    groups = np.array_split(np.arange(b), micro)
    out = np.zeros((b, n_tokens), np.int64)
    done = [0] * micro

    def step(g: int):
        rows = groups[g]
        if done[g] == 0:
            ids = prompts[rows]
            start = np.zeros(len(rows), np.int64)
        else:
            ids = out[rows, done[g] - 1][:, None]
            start = np.full(len(rows), prompts.shape[1] + done[g] - 1, np.int64)
        longest = int(start.max()) + ids.shape[1]
        h = runner.forward(g, ids, start, longest)
        if last_local:
            toks, _ = runner.sample(h, rows, longest)
            return toks
        dst.send(pack({"g": g, "start": start.tolist(), "longest": longest, "rows": rows.tolist()}, h.numpy()))
        return None

    if last_local:
        for _ in range(n_tokens):
            for g in range(micro):
                out[groups[g], done[g]] = step(g)
                done[g] += 1
        return out
    for g in range(micro):
        step(g)
    left = micro
    while left:
        meta, arr = unpack(src.recv())
        g = meta["g"]
        out[groups[g], done[g]] = arr[0].astype(np.int64)
        done[g] += 1
        if done[g] < n_tokens:
            step(g)
        else:
            left -= 1
    return out


class Links:
    """``stoa.testing.links`` in its own process, fronting one upstream port."""

    def __init__(self, upstream: int, profiles: list, tmp: Path, tag: str) -> None:
        spec, self.ready, self.stats = tmp / f"{tag}.json", tmp / f"{tag}.ready", tmp / f"{tag}.stats"
        spec.write_text(json.dumps([asdict(p) for p in profiles]))
        self.proc = subprocess.Popen([sys.executable, "-m", "stoa.testing.links", "--upstream", f"127.0.0.1:{upstream}",
                                      "--links", str(spec), "--ready", str(self.ready), "--stats", str(self.stats)],
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        for _ in range(300):
            if self.ready.exists():
                break
            time.sleep(0.1)
        self.ports = json.loads(self.ready.read_text())["ports"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def run_pipeline(args, model: Path, anchor: Path, parts, micro: int, one_way_ms: float, channel: str,
                 prompts: np.ndarray, s3, tmp: Path, tag: str) -> dict:
    """Stage 0 here, stages 1.. in their own processes, frames over ``channel`` through links of
    ``one_way_ms``; returns the tokens, the time and what crossed the boundaries."""
    from stoa.testing.links import LinkProfile

    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    n = len(parts)
    profile = LinkProfile(f"lat{one_way_ms:g}", args.mbit, args.mbit, rtt_ms=2 * one_way_ms)
    links: list[Links] = []
    procs, controls = [], []
    run = f"{tag}-{time.time_ns()}"
    stage0, _ = load_stage(model, anchor, parts[0])
    driver = Runner(stage0)
    ends: list[str] = []
    if channel == "store":  # every process reaches the S3 server through its own link
        links.append(Links(s3.port, [profile] * n, tmp, f"{tag}-s3"))
        ends = [f"http://127.0.0.1:{p}" for p in links[0].ports]

    def box(boundary: int, who: int) -> dict:
        if channel == "tcp":
            return {"kind": "tcp"}
        return {"kind": "store", "args": {"endpoint": ends[who], "bucket": args.bucket, "boundary": boundary,
                                          "run": run}}

    try:
        for k in range(1, n):
            control = ctx.Queue()
            p = ctx.Process(target=stage_main, args=(str(model), str(anchor), parts[k], k == n - 1, box(k - 1, k),
                                                      ready, control, 1), daemon=True)
            p.start()
            procs.append(p)
            controls.append(control)
        infos = sorted([ready.get(timeout=600) for _ in procs], key=lambda i: tuple(i["part"]))
        if channel == "tcp":
            drv_lis = listener()
            ports = [i["port"] for i in infos] + [drv_lis.getsockname()[1]]  # boundary k's receiver
            links = [Links(port, [profile], tmp, f"{tag}-l{k}") for k, port in enumerate(ports)]
            for k, control in enumerate(controls, start=1):
                control.put({"kind": "tcp", "port": links[k].ports[0]})
            src, dst = TcpIn(drv_lis), TcpOut(links[0].ports[0])
        else:
            for k, control in enumerate(controls, start=1):
                control.put(box(k % n, k))
            src, dst = StoreIn(**box(n - 1, 0)["args"]), StoreOut(**box(0, 0)["args"])
        generate(driver, src, dst, prompts[:, :4], 2, micro, last_local=False)  # warm-up: connections, caches
        driver.caches.clear()
        dst.send(pack({"mark": True}))  # every stage starts counting its busy seconds; back here, all are idle
        if not unpack(src.recv())[0].get("mark"):
            raise RuntimeError("the ring returned a frame other than the marker")
        sent0, driver.busy, cpu0 = dst.sent, 0.0, time.process_time()
        t0 = time.perf_counter()
        toks = generate(driver, src, dst, prompts, args.tokens, micro, last_local=False)
        dt = time.perf_counter() - t0
        busy = [{"part": parts[0], "busy_s": driver.busy, "cpu_s": time.process_time() - cpu0}]
        sent = dst.sent - sent0
        dst.send(pack({"stop": True}))
        src.recv()
        busy += sorted([ready.get(timeout=60) for _ in procs], key=lambda i: tuple(i["part"]))
        return {"tokens": toks, "seconds": dt, "boundary_bytes": sent, "stages": infos, "busy": busy}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
        for lk in links:
            lk.close()


# -- the run -------------------------------------------------------------------------------------------

def build_model(args, tmp: Path) -> Path:
    if args.model:
        return args.model
    if not args.quick:
        from stoa.testing import realmodel

        path = realmodel.cached()
        if path is not None:
            return path
    from stoa.envs.synthetic import SyntheticConfig, generate as corpus, tokenizer_texts
    from stoa.models.tiny import TinyConfig, build_tiny

    texts = list(tokenizer_texts(corpus(SyntheticConfig(seed=0, num_entities=40, num_test_facts=10))))
    return build_tiny(tmp / "tiny", texts, TinyConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4,
                                                     num_kv_heads=2, intermediate_size=512, seed=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, few settings (a minute on a quiet machine)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--model", type=Path, help="a Hugging Face folder (default: the real model when built)")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--latency-ms", default="0,20,50", help="one-way latency of every link")
    ap.add_argument("--micro", default="1,4", help="micro-batch counts")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32, help="generated per row")
    ap.add_argument("--mbit", type=float, default=100.0, help="link rate each way (Mbit/s)")
    ap.add_argument("--channels", default="tcp,store")
    ap.add_argument("--store-settings", default="2:4", help="STAGES:MICRO pairs run on the store channel")
    ap.add_argument("--store-latency-ms", default="0,20", help="one-way latencies run on the store channel")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the baseline and of every stage")
    ap.add_argument("--bucket", default="stoa-pipeline")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.latency_ms, args.micro, args.batch, args.prompt, args.tokens = "2", "0,20", "1,4", 16, 8, 12
        args.store_settings, args.store_latency_ms = "2:4", "0"
    import torch

    from stoa.backends.torch import pipeline as P
    from stoa.backends.torch.engine import pretrained_state
    from stoa.backends.torch.families import read_spec
    from stoa.transport import pulse

    torch.set_num_threads(args.threads)
    results: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="stoa-pipeline-") as td:
        tmp = Path(td)
        model = build_model(args, tmp)
        spec = read_spec(model, "torch", RuntimeError)
        anchor = tmp / "anchor.safetensors"
        anchor.write_bytes(pulse.encode_state(pretrained_state(model)))
        rng = np.random.default_rng(0)
        prompts = rng.integers(3, spec.vocab_size, size=(args.batch, args.prompt)).astype(np.int64)
        whole, _ = load_stage(model, anchor, (0, spec.num_hidden_layers))
        base = Runner(whole)
        generate(base, None, None, prompts[:, :4], 2, 1, last_local=True)
        base.caches.clear()
        base.busy = 0.0
        t0 = time.perf_counter()
        want = generate(base, None, None, prompts, args.tokens, 1, last_local=True)
        base_s = time.perf_counter() - t0
        base_busy = base.busy
        base_tps = args.batch * args.tokens / base_s
        del whole, base
        results["model"] = {"path": model.name, "layers": spec.num_hidden_layers, "hidden": spec.hidden_size,
                            "vocab": spec.vocab_size, "anchor_bytes": anchor.stat().st_size}
        results["baseline"] = {"tokens_per_s": base_tps, "seconds": base_s, "busy_s": base_busy}
        print(f"model {model.name}: {spec.num_hidden_layers} layers, hidden {spec.hidden_size}; batch {args.batch}, "
              f"prompt {args.prompt}, {args.tokens} generated per row; links {args.mbit:g} Mbit/s each way")
        print(f"whole model, one process: {base_tps:.1f} tok/s")
        s3 = None
        channels = args.channels.split(",")
        store_pairs = {tuple(int(x) for x in p.split(":")) for p in args.store_settings.split(",") if p}
        if "store" in channels:
            from stoa.testing.seaweed import SeaweedFS

            s3 = SeaweedFS.start()
            s3.make_bucket(args.bucket)
        try:
            print(f"{'channel':8} {'stages':>6} {'micro':>5} {'one-way ms':>10} {'tok/s':>8} {'ratio':>6} "
                  f"{'B/tok/boundary':>14} {'same tokens':>11}  idle share per stage")
            for channel in channels:
                for n in [int(x) for x in args.stages.split(",")]:
                    parts = P.split_layers(spec.num_hidden_layers, n)
                    for micro in [int(x) for x in args.micro.split(",")]:
                        if channel == "store" and (n, micro) not in store_pairs:
                            continue
                        lats = args.store_latency_ms if channel == "store" else args.latency_ms
                        for lat in [float(x) for x in lats.split(",")]:
                            got = run_pipeline(args, model, anchor, parts, micro, lat, channel, prompts, s3, tmp,
                                               f"{channel}{n}m{micro}l{lat:g}")
                            tps = args.batch * args.tokens / got["seconds"]
                            same = int((got["tokens"] == want).all(axis=1).sum())
                            per_tok = got["boundary_bytes"] / (args.batch * args.tokens)
                            idle = [1 - b["busy_s"] / got["seconds"] for b in got["busy"]]
                            row = {"channel": channel, "stages": n, "micro": micro, "one_way_ms": lat,
                                   "tokens_per_s": tps, "ratio": tps / base_tps, "seconds": got["seconds"],
                                   "bytes_per_token_boundary": per_tok, "rows_same_as_baseline": same,
                                   "rows": args.batch,
                                   "stage_bytes_read": [i["bytes_read"] for i in got["stages"]],
                                   "stage_memory": [i["memory"] for i in got["stages"]],
                                   "stage_busy_s": [b["busy_s"] for b in got["busy"]],
                                   "stage_cpu_s": [b["cpu_s"] for b in got["busy"]],
                                   "idle_share": idle}
                            results["runs"].append(row)
                            print(f"{channel:8} {n:>6} {micro:>5} {lat:>10g} {tps:>8.1f} {tps / base_tps:>6.2f} "
                                  f"{per_tok:>14.0f} {same:>5}/{args.batch:<5}  "
                                  f"{' / '.join(f'{x:.2f}' for x in idle)}", flush=True)
                            if args.json:
                                args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        finally:
            if s3 is not None:
                s3.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
