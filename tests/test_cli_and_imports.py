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


def _import_graph() -> dict[str, set[str]]:
    """Module -> the stoa modules it imports, from an AST scan of stoa/ (every import counts: at
    module top, inside a function, under ``TYPE_CHECKING``). ``from p import m`` names module ``m``
    when it is one, else ``p``; a module's own package is not an arrow (Python's package faces)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = {}
    for path in (root / "stoa").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base) for a in node.names]
            else:
                continue
            graph[module] |= {t for t in targets if t and t != module}
    return graph


ALLOWED_CIRCLES: dict[frozenset[str], str] = {}
"""Import circles kept on purpose, each with its one-line reason (none today)."""


def test_no_import_circle_in_stoa():
    """An AST scan of stoa/: no import circle, lazy and type-only imports included (a module that
    needs another's name either sits below it or the name moves to a leaf both import)."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 and frozenset(comp) not in ALLOWED_CIRCLES:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_scan_sees_a_circle_when_there_is_one():
    graph = _import_graph()
    assert "stoa.fleet.config" in graph["stoa.fleet.trainer.trainer"]  # the runtime imports the assembly
    assert not any(m.startswith("stoa.fleet.trainer") for m in graph["stoa.fleet.config"]
                   if m != "stoa.fleet.trainer.section")  # never the reverse
    assert "stoa.backends.megatron.checkpoint" in graph["stoa.backends.megatron.learner"]  # relative imports count


def test_reading_a_config_imports_no_process():
    """``stoa.fleet.config`` (what a volunteer's machine reads first) loads the sections and leaf
    types only: no torch, no trainer or worker process, nothing of trust/ but its section."""
    code = ("import sys; import stoa.fleet.config\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('stoa.fleet'))))")
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    faces = {"stoa.fleet", "stoa.fleet.trainer", "stoa.fleet.worker", "stoa.fleet.trust", "stoa.fleet.operator",
             "stoa.fleet.outer"}
    leaves = {"stoa.fleet.config", "stoa.fleet.sections", "stoa.fleet.task", "stoa.fleet.trainer.section",
              "stoa.fleet.worker.section", "stoa.fleet.trust.section", "stoa.fleet.operator.section",
              "stoa.fleet.outer.section"}
    assert loaded <= faces | leaves, sorted(loaded - faces - leaves)
    r = run_py("import sys, stoa.fleet.config; print('torch' in sys.modules, 'stoa.fleet.trust.gate' in sys.modules)")
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stderr


def test_sections_are_leaves():
    """A room's section.py imports only fleet/sections.py and leaf types (never a process)."""
    graph = _import_graph()
    leaf_types = {"stoa.fleet.sections", "stoa.models.tiny", "stoa.backends.engine"}
    for module in [m for m in graph if m.endswith(".section")] + ["stoa.fleet.task"]:
        extra = {m for m in graph[module] if m not in leaf_types and not m.startswith("stoa.plugins")
                 and not m.startswith("stoa.envs")}
        assert not extra, (module, extra)


def test_the_package_faces_stay_importable():
    """``stoa.fleet.trainer``, ``stoa.fleet.worker`` and ``stoa.fleet.config`` keep the names
    examples and users' scripts import."""
    from stoa.fleet.config import RolloutConfig, RunConfig, TrainerConfig, TrustConfig, load_config  # noqa: F401
    from stoa.fleet.trainer import EvalConfig, ModelConfig, StartRefused, Trainer  # noqa: F401
    from stoa.fleet.worker import EXIT_BANNED, Worker, WorkerExit  # noqa: F401
    from stoa.fleet.worker import RolloutConfig as R

    assert R is RolloutConfig and Trainer.__module__ == "stoa.fleet.trainer.trainer"


def test_adversaries_are_reached_only_from_the_testing_package():
    """Nothing of the product imports ``stoa.testing``, but the ``--adversary`` option of
    ``stoa worker`` (a test tool of the CLI: imported inside that command, only when given)."""
    graph = _import_graph()
    reach = sorted(m for m, deps in graph.items() if not m.startswith("stoa.testing")
                   and any(d.startswith("stoa.testing") for d in deps))
    assert reach == ["stoa.cli.run"], reach
    assert "stoa.testing.adversaries" not in run_py("import sys, stoa.cli; print(sorted(sys.modules))").stdout


def test_the_fleet_reaches_backends_by_name():
    """Engines, learners and int8 scorers are chosen by name through their registries
    (``stoa.backends.engine``, ``.learner``, ``.scorer``): no fleet module imports a backend's
    own package (the Megatron learner's options, a config leaf, excepted)."""
    graph = _import_graph()
    backends = ("stoa.backends.mlx", "stoa.backends.torch", "stoa.backends.megatron")
    reach = sorted((m, d) for m, deps in graph.items() if m.startswith("stoa.fleet") for d in deps
                   if d.startswith(backends) and d != "stoa.backends.megatron.options")
    assert not reach, reach


def test_an_int8_scorer_is_chosen_by_name():
    import pytest

    from stoa.backends.scorer import SCORERS, make_scorer

    assert SCORERS == {"torch": "stoa.backends.torch.int8"}
    with pytest.raises(ValueError, match="unknown int8 scorer 'nope'; known: \\['torch'\\]"):
        make_scorer("nope", "/nowhere")


def test_the_worker_id_rule_is_written_once():
    """Every writer and reader of a worker id (the exchange, the sequence floors, the roster and
    bans, the invite) checks ``stoa.transport.layout.WORKER_ID``; the pattern is written once."""
    from pathlib import Path

    from stoa.transport.layout import WORKER_ID

    root = Path(__file__).resolve().parents[1] / "stoa"
    holders = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if WORKER_ID.pattern in p.read_text()]
    assert holders == ["transport/layout.py"], holders
    assert WORKER_ID.fullmatch("worker-0") and not WORKER_ID.fullmatch(".hidden") and not WORKER_ID.fullmatch("a/b")


def test_the_hex_id_rules_are_written_once():
    """A key id, a 32-hex hash or salt and a 64-hex key or sha256 are checked with
    ``stoa.transport.layout``'s ``KEY_ID``, ``HEX32`` and ``HEX64``; each pattern is written once."""
    from pathlib import Path

    from stoa.transport.layout import HEX32, HEX64, KEY_ID

    root = Path(__file__).resolve().parents[1] / "stoa"
    for rule in (KEY_ID, HEX32, HEX64):
        holders = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if rule.pattern in p.read_text()]
        assert holders == ["transport/layout.py"], (rule.pattern, holders)
    assert KEY_ID.fullmatch("0123456789abcdef") and not KEY_ID.fullmatch("0123456789ABCDEF")
