"""Private torch names reach the package only through its ``_compat`` modules (one per layer, each naming why it
needs them), so a torch release that moves one has one place to look (issue 42)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "lightning_parallel"
COMPAT_MODULES = {"_compat.py", "stage3_compat.py"}
ALLOWED = {
    # module: why it may be imported anywhere
    "torch.utils._pytree": "pytrees: torch's own libraries and docs use them so; unchanged since torch 2.0",
    "torch.utils._python_dispatch": "`TorchDispatchMode` (only it): the documented way to write a dispatch mode",
}


def _private_torch_imports(path: Path, root: Path = PACKAGE_DIR) -> list[str]:
    found = []
    where = path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            private_module = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                if node.module in ALLOWED and not alias.name.startswith("_"):
                    continue
                if private_module or alias.name.startswith("_"):
                    found.append(
                        f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} from {node.module} import {alias.name}"
                    )
        elif isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno} import {alias.name}"
                for alias in node.names
                if alias.name.split(".")[0] == "torch" and any(p.startswith("_") for p in alias.name.split("."))
            ]
    return found


def test_private_torch_imports_only_in_compat_modules() -> None:
    offenders = [
        line
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if path.name not in COMPAT_MODULES
        for line in _private_torch_imports(path)
    ]
    assert offenders == [], "import these through the layer's _compat module, with the reason:\n" + "\n".join(offenders)


def test_the_scan_sees_a_private_import(tmp_path: Path) -> None:
    module = PACKAGE_DIR / "_scan_probe_never_committed.py"
    try:
        module.write_text(
            "from torch._subclasses.fake_tensor import FakeTensorMode\nfrom torch.utils._pytree import _x\n"
        )
        assert len(_private_torch_imports(module)) == 2
    finally:
        module.unlink()
