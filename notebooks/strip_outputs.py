"""Strip outputs and execution counts from notebooks before committing them (``tests/test_notebooks.py`` checks).

Usage: ``python notebooks/strip_outputs.py [NOTEBOOK ...]`` (default: every ``.ipynb`` next to this file).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat


def strip_outputs(path: Path) -> bool:
    """Remove ``path``'s code-cell outputs and execution counts in place; return whether anything changed."""
    notebook = nbformat.read(path, as_version=4)
    changed = False
    for cell in notebook.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs = []
            cell.execution_count = None
            changed = True
    if changed:
        nbformat.write(notebook, path)
    return changed


def main(argv: list[str]) -> int:
    paths = [Path(arg) for arg in argv] or sorted(Path(__file__).resolve().parent.glob("*.ipynb"))
    for path in paths:
        if strip_outputs(path):
            print(f"stripped {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
