"""The package's import graph (issue 31, item 4): no circle between modules, and the ZeRO building blocks load no
pipeline module.

Read from the source (module-level imports; ``TYPE_CHECKING`` blocks and imports inside functions left out, since
they run later, if ever), so it is exact and needs no process. Importing ``a.b.c`` runs the packages ``a`` and
``a.b`` first; that edge from a module to its own ancestors is Python's, not a circle we wrote, so it is left out.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_parallel"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.Module) -> set[str]:
    """Names ``lightning_parallel.*`` that the module body imports when it runs (modules and ``module.attribute``)."""
    names: set[str] = set()
    for statement in tree.body:
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightning_"):
                names.add(node.module or "")
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (not its own ancestor packages)."""
    imports = {_module_name(path): _imported(ast.parse(path.read_text())) for path in PACKAGE.rglob("*.py")}
    modules = set(imports)
    return {
        module: {d for d in names if d in modules and d != module and not module.startswith(d + ".")}
        for module, names in imports.items()
    }


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for imported in graph[todo.pop()] - seen:
            seen.add(imported)
            todo.append(imported)
    return seen


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    circles = sorted(module for module in graph if module in _reachable(graph, module))
    assert not circles, f"modules on an import circle: {circles}"


@pytest.mark.parametrize(
    "module",
    ["lightning_parallel.distributed.zero.backends", "lightning_parallel.distributed.zero.buckets"],
)
def test_the_zero_building_blocks_load_no_pipeline_lightning_or_strategy_module(module: str) -> None:
    loaded = _reachable(_graph(), module)
    assert loaded, "the graph lost the module's imports"
    sideways = sorted(m for m in loaded if ".pipeline" in m or ".strategies" in m or m.endswith(".monitor"))
    assert not sideways, f"{module} loads {sideways}"


def test_the_zero_building_blocks_live_in_one_subpackage() -> None:
    loose = sorted(path.name for path in (PACKAGE / "distributed").glob("zero*.py"))
    assert not loose, f"ZeRO modules outside distributed/zero/: {loose}"


def _imports_anywhere(tree: ast.Module) -> set[str]:
    """Top-level names of every module imported anywhere in the file (functions and ``TYPE_CHECKING`` included)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names


RAY_MODULE = "lightning_parallel.integrations.ray"


def test_only_the_ray_integration_imports_ray_and_nothing_imports_it() -> None:
    """Issue 33: Ray is optional. Only ``integrations/ray.py`` imports it, and no module of the package imports that
    one (users import it by name), so ``import lightning_parallel`` works, and loads nothing of Ray, without Ray."""
    importing_ray = sorted(
        _module_name(path) for path in PACKAGE.rglob("*.py") if "ray" in _imports_anywhere(ast.parse(path.read_text()))
    )
    assert importing_ray == [RAY_MODULE]
    graph = _graph()
    assert RAY_MODULE in graph, "the graph lost the Ray integration"
    assert not sorted(module for module, imported in graph.items() if RAY_MODULE in imported)


def test_the_package_imports_with_ray_missing() -> None:
    """The package's entry points import in a fresh interpreter where ``import ray`` fails, as it does without Ray
    installed (the static test above covers every other module); the integration then fails with Ray's ImportError."""
    code = f"""
import importlib, sys
sys.modules["ray"] = None  # `import ray` raises ImportError, as when Ray is not installed
import lightning_parallel
for name in ("lightning_parallel.cli", "lightning_parallel.demos", "lightning_parallel.integrations"):
    importlib.import_module(name)
try:
    importlib.import_module("{RAY_MODULE}")
except ImportError as error:
    assert "ray" in str(error), error
else:
    raise AssertionError("the Ray integration imported without Ray")
assert sys.modules["ray"] is None and not [name for name in sys.modules if name.startswith("ray.")]
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_the_monitor_loads_no_strategy_module() -> None:
    """Issue 45, item 3: the monitor reads what a strategy reports (``instrumentation``), never a strategy module;
    what both need (``unwrap_optimizer``) sits below both."""
    loaded = _reachable(_graph(), "lightning_parallel.monitor.callback")
    assert "lightning_parallel.lightning_optimizer" in loaded, "the graph lost the monitor's imports"
    assert not sorted(m for m in loaded if ".strategies" in m)
