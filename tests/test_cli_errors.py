"""Expected failures are one line naming the fix, a non-zero exit, no traceback (`--verbose` shows
it): missing key file, missing S3 credentials, a mistyped or unknown store URL, an unknown env id,
a missing env module or model folder at `--check`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stoa.transport.store import StoreURLError, open_store

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "arithmetic_tiny.toml")


def stoa(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stoa", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)


def one_line_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: ")
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.mark.parametrize("url, fix", [
    ("r2://bucket/run", "s3://BUCKET/PREFIX?endpoint=https://ACCOUNT_ID.r2.cloudflarestorage.com&region=auto"),
    ("s3a://bucket/run", "write s3://"),
    ("fiel:///tmp/x", "did you mean file://?"),
    ("gs://bucket", "storage.googleapis.com"),
    ("ftp://host/x", "use a path, file:///PATH or s3://BUCKET/PREFIX"),
    ("s3://", "needs a bucket name"),
    ("s3://b/p?endpont=http://x", "unknown query parameters"),
])
def test_store_urls_that_name_no_store_say_what_to_write(url, fix):
    with pytest.raises(StoreURLError, match="") as e:
        open_store(url)
    assert fix in str(e.value)


def test_a_reader_does_not_create_a_store_that_is_not_there(tmp_path):
    with pytest.raises(StoreURLError, match="no store at"):
        open_store(tmp_path / "nope", create=False)
    assert not (tmp_path / "nope").exists()
    open_store(tmp_path / "new")  # a writer still makes it
    assert (tmp_path / "new").is_dir()


def test_cli_store_url_and_missing_key_file(tmp_path):
    one_line_error(stoa("status", "--store", "r2://bucket/x", "--run", "r"), 2, "r2.cloudflarestorage.com")
    r = stoa("trainer", EXAMPLE, "--store", str(tmp_path / "store"), "--key", str(tmp_path / "run.key"))
    one_line_error(r, 2, "no key file", "stoa keygen")
    assert not (tmp_path / "store").exists()  # refused before anything was written
    verbose = stoa("--verbose", "status", "--store", "r2://bucket/x", "--run", "r")
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr


def test_cli_missing_s3_credentials_names_the_variables(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    r = stoa("status", "--store", "s3://bucket/x?endpoint=http://127.0.0.1:9", "--run", "r", env=env)
    one_line_error(r, 1, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "s3://KEY:SECRET@")


@pytest.mark.parametrize("setting, needles", [
    (["env.id=stoa/SyntheticSerch-v0", "env.module="], ["not registered", "did you mean 'stoa/SyntheticSearch-v0'"]),
    (["env.module=nowhere.py"], ["no such file"]),
    (["env.module=no_such_pkg.envs"], ["no module named 'no_such_pkg'"]),
    (["model.path=/no/such/model"], ["model.path", "no config.json"]),
])
def test_check_names_what_cannot_run(setting, needles):
    args = [a for s in setting for a in ("--set", s)]
    one_line_error(stoa("train", EXAMPLE, "--check", *args), 2, *needles)


def test_env_module_is_read_beside_the_config_from_any_working_directory(tmp_path):
    r = stoa("train", EXAMPLE, "--check", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f'"module": "{ROOT / "examples" / "custom_env.py"}"' in r.stdout


def test_expected_failures_are_told_by_type_not_by_name():
    """``explain`` picks one-line errors by their base class (stoa.errors.ExpectedFailure), never by
    a class's name: a subclass, or a class renamed tomorrow, stays one line; a bug stays a traceback."""
    import inspect

    from stoa.backends.export import ExportError
    from stoa.backends.learner import LearnerError
    from stoa.cli import explain
    from stoa.envs.retrieval import RetrieverError
    from stoa.errors import ExpectedFailure
    from stoa.fleet.operator.status import RunNotFound
    from stoa.fleet.operator.sweep import SweepError
    from stoa.fleet.sections import ConfigError
    from stoa.fleet.trainer.distributed import RankFailed
    from stoa.fleet.trainer.trainer import StartRefused
    from stoa.transport.identity import SealError
    from stoa.transport.signing import SignatureError
    from stoa.transport.store import KeyNotFound, StoreError
    from stoa.transport.subscriber import PointerError

    for cls, code in ((ConfigError, 2), (StoreURLError, 2), (ExportError, 2), (SweepError, 2), (StoreError, 1),
                      (KeyNotFound, 1), (RunNotFound, 1), (SignatureError, 1), (PointerError, 1), (SealError, 1),
                      (RankFailed, 1), (LearnerError, 1), (RetrieverError, 1), (StartRefused, 1)):
        assert issubclass(cls, ExpectedFailure) and cls.exit_code == code, cls
        renamed = type("Renamed" + cls.__name__, (cls,), {})
        assert explain(renamed("what failed; the fix")) == ("what failed; the fix", code), cls
    assert explain(RuntimeError("a bug")) is None and explain(ValueError("a bug")) is None
    source = inspect.getsource(explain)
    assert not any(f'"{name}"' in source for name in ("ConfigError", "StoreError", "StartRefused", "RankFailed"))


def test_a_trust_section_out_of_bounds_is_a_config_error():
    from stoa.fleet.sections import ConfigError
    from stoa.fleet.trust.section import AuditConfig, TrustConfig

    with pytest.raises(ConfigError, match="trust.ban_after must be >= 0"):
        TrustConfig(ban_after=-1)
    with pytest.raises(ConfigError, match="trust.audit.sampling_band"):
        AuditConfig(sampling_band=0.0)


def test_a_stage_with_a_bad_advertised_address_refuses_to_start(tmp_path):
    from stoa.transport.signing import generate_private_key, save_keypair

    _, pub = save_keypair(generate_private_key(), tmp_path / "keys", "run")
    r = stoa("stage", "--stage", "1/2", "--store", str(tmp_path / "store"), "--run", "r", "--public-key", str(pub),
             "--cache", str(tmp_path / "c"), "--advertise", "10.0.0.7:99999")
    one_line_error(r, 2, "cannot start the stage", "--advertise", "1 to 65535")
    assert not (tmp_path / "c").exists()  # refused before anything was written
