"""The layers of DESIGN.md, enforced: imports flow llmdb -> engine -> kernels, never back up,
and the parts that need no tensors load without torch."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Directory -> (its import name, the llmdb packages it may import).
LAYERS = {
    "kernels": ("llmdb.kernels", ("llmdb.kernels",)),
    "engine": ("llmdb.engine", ("llmdb.engine", "llmdb.kernels")),
}


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a file (relative ones resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    parts = [package, *path.relative_to(ROOT / package.split(".")[-1]).with_suffix("").parts]
    here = parts[:-1]  # the package the file is in (for __init__.py, the package itself)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            out.append((node.lineno, module))
    return out


@pytest.mark.parametrize("directory", sorted(LAYERS))
def test_no_upward_import(directory):
    package, allowed = LAYERS[directory]
    bad = []
    for path in sorted((ROOT / directory).rglob("*.py")):
        for line, module in _imports(path, package):
            if (module == "llmdb" or module.startswith("llmdb.")) and not any(
                    module == a or module.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "imports against the layers (llmdb -> engine -> kernels):\n" + "\n".join(bad)


def _module_name(path: Path, package: str) -> str:
    parts = path.relative_to(ROOT / package.split(".")[-1]).with_suffix("").parts
    return ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _type_checking_lines(path: Path) -> set[int]:
    """The lines of `if TYPE_CHECKING:` blocks (imports for annotations only)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def test_no_import_cycles():
    """No engine or kernels module imports one that imports it back, even from inside a
    function (how scheduler.py and policies/ once leaned on each other). Importing a.b.c
    runs a/b/__init__.py too, unless the importer is inside a.b already; imports for type
    checking alone do not count."""
    graph: dict[str, set[str]] = {}
    for directory, (package, _) in LAYERS.items():
        for path in (ROOT / directory).rglob("*.py"):
            skip = _type_checking_lines(path)
            graph[_module_name(path, package)] = {
                m for line, m in _imports(path, package) if line not in skip}
    edges: dict[str, set[str]] = {}
    for name, modules in graph.items():
        edges[name] = set()
        for m in modules:
            while m and m not in graph:  # `from pkg.mod import f` names a module, not f
                m = m.rpartition(".")[0]
            parents = [m.rsplit(".", k)[0] for k in range(1, m.count("."))]
            edges[name] |= {t for t in (m, *parents)
                            if t in graph and t != name and not name.startswith(t + ".")}
    done: set[str] = set()

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        for m in sorted(edges[name]):
            if m in path:
                return path[path.index(m):] + [m]
            if m not in done and (found := cycle_from(m, path + [m])):
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = None if name in done else cycle_from(name, [name])
        assert found is None, "an import cycle: " + " -> ".join(found)


def test_runtime_does_not_import_research_code():
    """engine/research/ (simulator, bound, calibration) uses the engine; the engine that
    serves never loads it."""
    bad = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if "research" in path.relative_to(ROOT / "engine").parts:
            continue
        bad += [f"{path.relative_to(ROOT)}:{line} imports {module}"
                for line, module in _imports(path, "llmdb.engine")
                if module.startswith("llmdb.engine.research")]
    assert not bad, "the runtime imports research code:\n" + "\n".join(bad)


def test_only_the_bound_needs_ortools():
    # A None entry in sys.modules makes `import ortools` fail, as on a machine without it.
    code = ("import sys; sys.modules['ortools'] = None\n"
            "import llmdb.engine.research.sim, llmdb.engine.research.workloads\n"
            "import llmdb.engine.research.calibrate, llmdb.engine.research.fit\n"
            "import llmdb.engine.sched.policies, llmdb.engine.costmodel\n"
            "try:\n    import llmdb.engine.research.optimal\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "needs OR-Tools" in out and "llmdb[bound]" in out


@pytest.mark.parametrize("module", [
    "llmdb",  # the package's top level is lazy (PEP 562)
    "llmdb.engine.params",  # a request's parameters
    "llmdb.backends.base",  # the backend contract
    "llmdb.engine.research.sim",  # the simulator, its scheduler, policies and cost model
    pytest.param("llmdb.engine.research.optimal", marks=pytest.mark.skipif(
        importlib.util.find_spec("ortools") is None, reason="the bound needs OR-Tools")),
])
def test_loads_without_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules, 'duckdb' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "False", f"importing {module} loads torch"
    if module == "llmdb":
        assert out[1] == "False", "importing llmdb loads duckdb"
