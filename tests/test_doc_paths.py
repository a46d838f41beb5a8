"""Every file the docs and the package's docstrings and comments name exists (issue 45, item 4): a module renamed or
folded leaves no pointer to a file that is gone.

Read from the text, no import: each ``name.py`` / ``name.md`` token (with or without folders) in ``docs/*.md``,
``README.md`` and every module under ``lightning_parallel/`` must be a file of the repository. A token with folders
matches a file whose path ends with it (``pipeline/stage_plan.py``, ``distributed/zero/optimizer.py``), a
``../`` token is resolved from the file that holds it, and a bare name matches a file of that name anywhere.
Files of other projects and the user's own scripts are listed in :data:`FOREIGN`, each with the reason.

And docs/architecture.md covers the package: a section per top-level folder, and every site
tests/test_no_patching.py allows named by its file and function.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOREIGN = {
    # token: why it names no file of ours
    "script.py": "the user's training script in a command line",
    "train.py": "the user's training script in a command line",
    "my_cli.py": "the user's CLI script in an example",
    "deepspeed/runtime/pipe/engine.py": "DeepSpeed's source, quoted",
    "torch/distributed/_tools/mem_tracker.py": "torch's source, quoted",
    "torchtitan/distributed/activation_checkpoint.py": "torchtitan's source, quoted",
    "docs/performance.md": "torchtitan's docs, quoted",
    "transformers/distributed/tensor_parallel.py": "transformers' source, quoted",
}
_TOKEN = re.compile(r"(?<![\w./-])((?:\.\./)*(?:[\w.-]+/)*[\w-]+\.(?:py|md))(?![\w/])")


def _texts() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "lightning_parallel").rglob("*.py")),
    ]


def _repository_files() -> list[str]:
    """The files git tracks or would track (not ignored): never the venvs, caches or build outputs beside them."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in listed.stdout.splitlines() if (ROOT / line).is_file()]


def missing_files(text: str, where: Path, files: list[str]) -> list[str]:
    """The tokens of ``text`` (held by ``where``) that name no file of ``files`` (paths relative to the root)."""
    names = {file.rsplit("/", 1)[-1] for file in files}
    missing = []
    for token in _TOKEN.findall(text):
        if token in FOREIGN:
            continue
        if token.startswith("../"):
            found = (where.parent / token).resolve().is_file()
        elif "/" in token:
            path = token.removeprefix("lightning_parallel/")
            found = any(file == path or file.endswith("/" + path) for file in files)
        else:
            found = token in names
        if not found:
            missing.append(token)
    return missing


def test_every_file_the_docs_and_docstrings_name_exists() -> None:
    files = _repository_files()
    missing = [
        f"{path.relative_to(ROOT)}:{number}: {token}"
        for path in _texts()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for token in missing_files(line, path, files)
    ]
    assert missing == [], "these name no file of the repository (renamed or gone?):\n" + "\n".join(missing)


def test_the_scan_sees_a_missing_file() -> None:
    files = ["lightning_parallel/distributed/zero/stage3_gloo.py", "docs/zero.md", "README.md"]
    where = ROOT / "docs" / "zero.md"
    text = "``zero3_gloo.py``, `distributed/zero/stage3_gloo.py`, zero/stage3_gloo.py, [x](../README.md), train.py"
    assert missing_files(text, where, files) == ["zero3_gloo.py"]
    assert missing_files("see `pipeline/partition.py` and ../docs/nowhere.md", where, files) == [
        "pipeline/partition.py",
        "../docs/nowhere.md",
    ]


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_the_architecture_page_covers_every_folder_and_every_allowed_patch() -> None:
    """docs/architecture.md has a section for each top-level folder of the package and names each site that
    tests/test_no_patching.py allows (its file and its function), so the page cannot say less than the test."""
    from test_no_patching import ALLOWED

    page = ARCHITECTURE.read_text()
    folders = sorted(p.name for p in (ROOT / "lightning_parallel").iterdir() if (p / "__init__.py").is_file())
    assert "distributed" in folders and "fault_tolerance" in folders
    assert [f for f in folders if f"**`{f}/`**" not in page] == []
    unnamed = [
        (path, function) for path, function, _ in ALLOWED if f"`{path}`" not in page or f"`{function}`" not in page
    ]
    assert unnamed == []
