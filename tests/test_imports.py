"""The package's modules do not import each other in a circle (``ssm_spec.hf.adapter``
and ``ssm_spec.hf.cache`` did, the cache through an import inside its constructor), and each
of the two imports on its own in a fresh interpreter.

The distribution installs one top-level package, ``ssm_spec``: the repository's ``graphs/``
folder installs as ``ssm_spec.graphs`` (it used to install as a top-level ``graphs``,
a name that collides in site-packages)."""

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    """The installed name of a source file (``graphs/`` installs as ``ssm_spec.graphs``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "graphs":
        parts.insert(0, "ssm_spec")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of ssm_spec it imports}``, from every import statement in its source,
    those inside functions too (an import deferred into a function is still a dependency; it
    only hides the cycle until the call). An import of a module's own parent package (``from .
    import x``) counts as an import of ``x`` alone."""
    modules = {_module_name(p): p for folder in ("ssm_spec", "graphs") for p in (ROOT / folder).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                candidates = [f"{target}.{alias.name}" for alias in node.names]
                if target not in ancestors:
                    candidates.append(target)
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            deps |= {c for c in candidates if c in modules and c != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_both_directions_of_an_import():
    graph = import_graph()
    assert "ssm_spec.hf.adapter" in graph["ssm_spec.hf.cache"]  # the cache finds the converted layers
    assert "ssm_spec.graphs.step" in graph["ssm_spec.graphs.runner"]  # graphs/ under its installed name
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", ["ssm_spec.hf.adapter", "ssm_spec.hf.cache"])
def test_module_imports_first_in_a_fresh_interpreter(module):
    """Imported first (the package's __init__ runs first, then this module), and usable: the
    adapter refuses a cache that is not a RecoverSSMCache, the cache knows the adapter class."""
    code = (f"import {module}\n"
            "from ssm_spec.hf.adapter import RecoverGDNAdapter\n"
            "from ssm_spec.hf.cache import RecoverSSMCache\n"
            "assert RecoverSSMCache.rolls_back_linear_attention\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def _fresh(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_graphs_imports_as_ssm_spec_graphs(tmp_path):
    """``ssm_spec.graphs`` is the installed package, found from outside the repository (the cwd
    is not on the path there), and no top-level ``graphs`` is installed next to it."""
    code = ("import importlib.util\n"
            "import ssm_spec.graphs as g\n"
            "from ssm_spec.graphs.stack import DecoderStack\n"
            "assert g.SpecDecodeGraphRunner.__module__ == 'ssm_spec.graphs.runner'\n"
            "assert callable(g.compile_step) and issubclass(g.CaptureError, Exception)\n"
            "assert importlib.util.find_spec('graphs') is None, importlib.util.find_spec('graphs')\n")
    proc = _fresh(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_graphs_is_not_importable_under_its_folder_name():
    """From the repository root the folder is on the path, but its modules import the library
    relatively, so ``import graphs`` fails instead of loading a second copy of every class (a
    ``CaptureError`` that ``except ssm_spec.graphs.CaptureError`` would not catch)."""
    proc = _fresh("import graphs", ROOT)
    assert proc.returncode != 0 and "ImportError" in proc.stderr, proc.stderr[-3000:]


def test_wheel_installs_only_ssm_spec(tmp_path):
    """A wheel built from pyproject.toml holds every source file of ``ssm_spec/`` and of
    ``graphs/`` (as ``ssm_spec/graphs/``) and nothing else at the top level: no ``graphs/``.
    The package list in pyproject.toml is explicit, so this also fails when a new subpackage is
    left out of it. Built from a copy of the tree, so nothing is written into the checkout."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("ssm_spec", "graphs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # the suite's venv has setuptools (the build backend): build with it, offline and quickly
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                           "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"ssm_spec"}, sorted(top)
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ssm_spec").rglob("*.py")}
    expected |= {"ssm_spec/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "graphs").rglob("*.py")}
    assert "ssm_spec/graphs/__init__.py" in expected
    assert sorted(expected - names) == [], "source files missing from the wheel"
    assert {n for n in names if n.endswith(".py")} == expected, "files in the wheel with no source"


def test_the_first_op_call_imports_nothing():
    """Every module the ops need is imported with them: the first ``ops.gdn_verify`` (a custom
    op's kernels run under torch's dynamo guard, which imported ``torch._dynamo`` on first use:
    1-1.5 s on an idle 2-core CPU, more on a busy one) and commit import no module."""
    code = ("import sys\n"
            "import torch\n"
            "from ssm_spec import ops\n"
            "q, k = torch.randn(6, 2, 8), torch.randn(6, 2, 8)\n"
            "v, g, beta = torch.randn(6, 4, 6), -torch.rand(6, 4), torch.rand(6, 4)\n"
            "pool = torch.randn(3, 4, 8, 6)\n"
            "src, qsl = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32)\n"
            "before = set(sys.modules)\n"
            "_, rec = ops.gdn_verify(q, k, v, g, beta, pool, src, qsl)\n"
            "ops.gdn_commit(pool, rec, qsl, src, torch.tensor([1, 2], dtype=torch.int32))\n"
            "new = sorted(set(sys.modules) - before)\n"
            "assert not new, new[:10]\n")
    proc = _fresh(code, ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
