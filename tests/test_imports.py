"""The package's modules do not import each other in a circle (issue 19: ``ssm_spec.hf.adapter``
and ``ssm_spec.hf.cache`` did, the cache through an import inside its constructor), and each
of the two imports on its own in a fresh interpreter."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of ssm_spec it imports}``, from every import statement in its source,
    those inside functions too (an import deferred into a function is still a dependency; it
    only hides the cycle until the call). An import of a module's own parent package (``from .
    import x``) counts as an import of ``x`` alone."""
    modules = {_module_name(p): p for p in (ROOT / "ssm_spec").rglob("*.py")}
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
