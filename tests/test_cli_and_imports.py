"""`import stoa` stays light, and the CLI answers --help everywhere."""

import subprocess
import sys


BLOCK_HEAVY = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'mlx', 'mlx_lm', 'torch', 'megatron', 'transformers'}:
            raise ImportError(f'{name} is blocked in this test')
sys.meta_path.insert(0, Block())
"""


def run_py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_HEAVY + code], capture_output=True, text=True, timeout=120)


def test_import_stoa_without_heavy_frameworks():
    r = run_py("import stoa, stoa.types, stoa.models.tiny, stoa.cli; print(stoa.__version__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == __import__("stoa").__version__


def test_blocker_really_blocks():
    r = run_py("import torch")
    assert r.returncode != 0 and "blocked" in r.stderr


def test_cli_help_and_version_without_heavy_frameworks():
    r = run_py("import sys; sys.argv=['stoa','--help']; from stoa.cli import app; app(prog_name='stoa')")
    assert r.returncode == 0, r.stderr
    assert "init-tiny" in r.stdout
    r = run_py("import sys; sys.argv=['stoa','--version']; from stoa.cli import app; app(prog_name='stoa')")
    assert r.returncode == 0 and r.stdout.startswith("stoa ")


def _commands(app):
    import typer.main

    group = typer.main.get_command(app)
    out = []

    def walk(cmd, path):
        sub = getattr(cmd, "commands", None)
        if sub:
            for name, c in sub.items():
                walk(c, path + [name])
        out.append(path)

    walk(group, [])
    return out


def test_every_command_has_help():
    from typer.testing import CliRunner

    from stoa.cli import app

    runner = CliRunner()
    cmds = _commands(app)
    assert ["init-tiny"] in cmds
    for path in cmds:
        r = runner.invoke(app, [*path, "--help"])
        assert r.exit_code == 0, (path, r.output)
        assert "Usage" in r.output


def test_init_tiny_cli(tmp_path):
    from typer.testing import CliRunner

    from stoa.cli import app

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"Protein Kavorin{i % 40} inhibits the kinase Mertil{i % 17} in hepatocytes ." for i in range(800)))
    r = CliRunner().invoke(app, ["init-tiny", str(tmp_path / "m"), "--text", str(text), "--vocab-size", "400",
                                 "--hidden-size", "64", "--num-layers", "1", "--num-heads", "2",
                                 "--num-kv-heads", "1", "--intermediate-size", "128"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "m" / "model.safetensors").exists() and "wrote" in r.output
    r = CliRunner().invoke(app, ["init-tiny", str(tmp_path / "bad"), "--text", str(text), "--hidden-size", "100"])
    assert r.exit_code != 0


def test_openblas_is_loaded_for_mlx_before_mlx_itself():
    code = ("import sys; import stoa.backends.mlx; from stoa import blas; "
            "print(blas.openblas_path() is None or blas._loaded == blas.openblas_path())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
    r = subprocess.run([sys.executable, "-c", "import mlx.core; from stoa import blas; import warnings; "
                        "warnings.simplefilter('error'); blas.load_openblas()"], capture_output=True, text=True,
                       timeout=120)
    if __import__("stoa.blas", fromlist=["x"]).openblas_path():
        assert r.returncode != 0 and "reference BLAS" in r.stderr  # too late: said clearly, not silently


def test_no_module_imports_or_reaches_into_anothers_private_names():
    """An AST scan of stoa/: no ``from stoa.x import _y`` and no ``m._y`` on a stoa module bound by
    an import (a second file that needs a private name merges with the first or gets a public one)."""
    import ast
    from pathlib import Path

    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    found = []
    for path in sorted((Path(__file__).resolve().parents[1] / "stoa").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stoa"):
                found += [f"{path.name}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                          if private(a.name)]
                modules.update({a.asname or a.name: node.module for a in node.names})
            elif isinstance(node, ast.Import):
                modules.update({(a.asname or a.name).split(".")[0]: a.name for a in node.names
                                if a.name.startswith("stoa")})
        found += [f"{path.name}:{node.lineno} {node.value.id}.{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                  and node.value.id in modules]
    assert not found, found
