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
