"""User code named by a run config: objectives as `path/to/file.py:fn` (the CISPO example, with
hand-computed gradients), paths read beside the config file, and environments installed as
packages (entry-point group `stoa.envs`) whose name and version the run config records."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stoa.fleet.config import ConfigError, EnvConfig, import_env_module, load_config
from stoa.plugins import import_module_or_file

ROOT = Path(__file__).resolve().parents[1]
CISPO = ROOT / "examples" / "cispo_objective.py"


def _inputs(torch):
    from stoa.algos import ObjectiveInputs

    lp = torch.tensor([[-1.0, -0.5, -2.0, -1.0]], requires_grad=True)
    blp = torch.tensor([[-1.5, -0.5, -1.0, -9.0]])  # r = e^0.5, 1, e^-1, (masked)
    adv = torch.tensor([[2.0, 2.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    return lp, ObjectiveInputs(lp, blp, adv, mask)


def test_cispo_clips_the_weight_not_the_gradient():
    torch = pytest.importorskip("torch")
    cispo = import_module_or_file(str(CISPO))
    lp, inputs = _inputs(torch)
    loss, metrics = cispo.loss(inputs, cispo.Config(eps_low=0.5, eps_high=0.28))
    loss.backward()
    # token_mean over 3 counted tokens; weights clip(r, 0.5, 1.28): 1.28, 1.0, 0.5 (e^-1 = 0.37 < 0.5).
    want = torch.tensor([[-2.0 * 1.28, -2.0 * 1.0, 1.0 * 0.5, 0.0]]) / 3
    assert torch.allclose(lp.grad, want, atol=1e-6)
    assert abs(loss.item() - float(-(2 * 1.28 * -1.0 + 2 * 1.0 * -0.5 - 1 * 0.5 * -2.0) / 3)) < 1e-6
    assert metrics["ratio/clipped_high_frac"] == pytest.approx(1 / 3)
    assert metrics["ratio/clipped_low_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="eps_high"):
        cispo.Config(eps_high=0.0)


def test_cispo_without_a_lower_clip_is_tis():
    torch = pytest.importorskip("torch")
    from stoa.algos import tis

    cispo = import_module_or_file(str(CISPO))
    lp_a, a = _inputs(torch)
    lp_b, b = _inputs(torch)
    la, _ = cispo.loss(a, cispo.Config(eps_low=1.0, eps_high=0.3))
    lb, _ = tis.loss(b, tis.Config(cap=1.3))
    la.backward()
    lb.backward()
    assert torch.allclose(la, lb) and torch.allclose(lp_a.grad, lp_b.grad)


def test_paths_in_a_config_are_read_beside_it(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.toml").write_text(textwrap.dedent("""
        [env]
        module = "my_env.py"
        [objective]
        kind = "my_objective.py:loss"
    """))
    monkeypatch.chdir(tmp_path)
    from stoa.fleet import config as config_module

    monkeypatch.setattr(config_module, "_resolve_objective", lambda table: config_module.UnresolvedObjective(
        table["kind"], {}))  # resolving would import the file; here only the path is checked
    cfg = load_config(tmp_path / "cfg" / "run.toml")
    assert cfg.env.module == str(tmp_path / "cfg" / "my_env.py")
    assert cfg.objective.kind == f"{tmp_path / 'cfg' / 'my_objective.py'}:loss"
    cfg = load_config(tmp_path / "cfg" / "run.toml", {"objective.kind": "here.py:loss", "env.module": "e.py"})
    assert cfg.objective.kind == f"{tmp_path / 'here.py'}:loss" and cfg.env.module == str(tmp_path / "e.py")


def _registry_reads_files() -> bool:
    from stoa.algos import resolve_objective

    try:
        resolve_objective(f"{CISPO}:loss")
    except ValueError:
        return False
    return True


def test_a_run_config_names_an_objective_by_file(tmp_path):
    if not _registry_reads_files():
        pytest.skip("stoa.algos.registry._lookup imports modules only by name; it needs "
                    "stoa.plugins.import_module_or_file for 'path/to/file.py:fn' kinds")
    text = (ROOT / "examples" / "arithmetic_tiny.toml").read_text()
    (tmp_path / "run.toml").write_text(text.replace('module = "custom_env.py"', f'module = "{ROOT / "examples" / "custom_env.py"}"')
                                       .replace('kind = "dppo"', 'kind = "cispo.py:loss"\neps_high = 0.2'))
    (tmp_path / "cispo.py").write_text(CISPO.read_text())
    cfg = load_config(tmp_path / "run.toml")
    assert cfg.objective.name == f"{tmp_path / 'cispo.py'}:loss" and cfg.objective.config.eps_high == 0.2
    sweep = ROOT / "examples" / "sweeps" / "cispo_vs_dppo.toml"
    r = subprocess.run([sys.executable, "-m", "stoa", "sweep", str(sweep), "--dry-run"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.count("cispo-lag") == 4, r.stderr


ENV_PACKAGE = '''
from stoa.plugins import import_module_or_file
ArithmeticEnv = import_module_or_file({path!r}).ArithmeticEnv
'''


def _install_fake_package(site: Path, version: str) -> None:
    """What pip leaves for a package declaring an env id: its code and a dist-info with entry points."""
    (site / "mylab_envs").mkdir(parents=True)
    (site / "mylab_envs" / "__init__.py").write_text(ENV_PACKAGE.format(path=str(ROOT / "examples" / "custom_env.py")))
    info = site / f"mylab_envs-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mylab-envs\nVersion: {version}\n")
    (info / "entry_points.txt").write_text('[stoa.envs]\nmylab/Arithmetic-v0 = mylab_envs:ArithmeticEnv\n')


def test_an_installed_env_package_is_found_by_id_and_its_version_recorded(tmp_path):
    site = tmp_path / "site"
    _install_fake_package(site, "0.3.1")
    (tmp_path / "run.toml").write_text('[env]\nid = "mylab/Arithmetic-v0"\nkwargs = { size = 50 }\n')
    env = {**__import__("os").environ, "PYTHONPATH": f"{ROOT}:{site}"}
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(tmp_path / "run.toml"), "--check"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["env"]["package"] == "mylab-envs==0.3.1"
    probe = ("import stoa.envs; e = stoa.envs.make('mylab/Arithmetic-v0', size=50); "
             "stoa.envs.check_env(e); print(type(e.unwrapped).__name__)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ArithmeticEnv", r.stderr
    (tmp_path / "pinned.toml").write_text('[env]\nid = "mylab/Arithmetic-v0"\npackage = "mylab-envs==0.2.0"\n')
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(tmp_path / "pinned.toml"), "--check"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "pip install 'mylab-envs==0.2.0'" in r.stderr and "Traceback" not in r.stderr


def test_a_machine_with_another_version_refuses_the_run():
    # No such package here: what a worker without the run's package sees (and one with another version).
    with pytest.raises(ConfigError, match="pip install 'mylab-envs==0.3.1'"):
        import_env_module(EnvConfig(id="mylab/Arithmetic-v0", package="mylab-envs==0.3.1"))
