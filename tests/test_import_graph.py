"""The package's import graph (issue 31, item 4): no circle between modules, and the ZeRO building blocks load no
pipeline module.

Read from the source (module-level imports; ``TYPE_CHECKING`` blocks and imports inside functions left out, since
they run later, if ever), so it is exact and needs no process. Importing ``a.b.c`` runs the packages ``a`` and
``a.b`` first; that edge from a module to its own ancestors is Python's, not a circle we wrote, so it is left out.
"""

from __future__ import annotations

import ast
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
