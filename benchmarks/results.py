"""``benchmarks/RESULTS.md``: one section per benchmark, replaced in place when the benchmark runs again."""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

import lightning
import torch

__all__ = ["FIGURES_DIR", "RESULTS_PATH", "machine_description", "markdown_table", "today", "update_section"]

RESULTS_PATH = Path(__file__).with_name("RESULTS.md")
"""Where the benchmarks write their results."""
FIGURES_DIR = Path(__file__).with_name("figures")
"""Where the benchmarks save their PNG figures (linked from RESULTS.md by relative paths)."""

_HEADER = """# Benchmark results

Written by `python -m benchmarks.run_all` (`make bench`); each section is replaced when its benchmark runs again.
Numbers are medians over repeats on the machine named in the section; compare ratios, not absolute speeds.
"""


def machine_description() -> str:
    """CPU model, core count and the versions that matter: ``"Intel Xeon ..., 2 cores; Python 3.11, torch ..."``."""
    cpu = platform.processor() or platform.machine()
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        match = None
    if match is not None:
        cpu = match.group(1).strip()
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()}; Python {platform.python_version()},"
        f" torch {torch.__version__}, lightning {lightning.__version__}"
    )


def today() -> str:
    """Today's date (UTC) as ``YYYY-MM-DD``."""
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table; the first column is left-aligned, the others right-aligned."""
    align = [":---"] + ["---:"] * (len(header) - 1)
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def update_section(name: str, body: str, *, path: Path = RESULTS_PATH, first: bool = False) -> None:
    """Replace benchmark ``name``'s section of ``path`` with ``body`` (added if new; the file is created if missing).

    Sections are delimited by ``<!-- begin NAME -->`` / ``<!-- end NAME -->`` comments, so other sections and text
    outside them are kept. A new section is appended, or with ``first=True`` put before the first other section.
    """
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    section = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else _HEADER
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    elif first and "<!-- begin " in text:
        head, tail = text.split("<!-- begin ", 1)
        text = f"{head.rstrip()}\n\n{section}\n\n<!-- begin {tail}"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")
