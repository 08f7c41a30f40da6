"""How torch's OpenMP threads wait: a lone process spins briefly, a launcher's children sleep at once,
and whatever the user set is kept (stoa.backends.openmp)."""

import os
import subprocess
import sys

import pytest

from stoa.backends import openmp


@pytest.fixture
def clean_env(monkeypatch):
    for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(openmp, "_ours", set())


def test_a_lone_process_spins_briefly_and_its_children_that_share_cores_sleep(clean_env):
    openmp.dedicated()
    assert os.environ["GOMP_SPINCOUNT"] == openmp.SPIN and "OMP_WAIT_POLICY" not in os.environ
    child = openmp.shared_env(dict(os.environ))  # a launcher's copy of its own environment
    assert child["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in child


@pytest.mark.parametrize("var,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("OMP_WAIT_POLICY", "PASSIVE"),
                                       ("GOMP_SPINCOUNT", "50000")])
def test_the_users_choice_is_kept(clean_env, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    openmp.dedicated()
    child = openmp.shared_env(dict(os.environ))
    for env in (os.environ, child):
        assert env[var] == value
        assert {k for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in env} == {var}


def test_importing_the_torch_backend_sets_the_spin_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import os, sys; import stoa.backends.torch; assert 'torch' not in sys.modules; "
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [openmp.SPIN, "None"]
