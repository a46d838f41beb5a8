"""``benchmarks/RESULTS.md``: its sections, and the one Markdown renderer every benchmark's tables go through."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import lightning
import torch

from benchmarks.harness import Comparison, Outcome

__all__ = [
    "RESULTS_PATH",
    "comparison_table",
    "load_notes",
    "markdown_table",
    "mib",
    "outcome_table",
    "paired_blocks",
    "ratios_cell",
    "section",
    "update_section",
]

RESULTS_PATH = Path(__file__).with_name("RESULTS.md")
"""Where the benchmarks write their results; figures go to ``figures/`` beside it."""

_HEADER = """# Benchmark results

Written by `python -m benchmarks.run_all` (`make bench`); each section is replaced when its benchmark runs again.
Ratios are ours / anchor of runs made back to back in one process, medians over repeats with the spread beside them;
compare ratios, not absolute speeds.
"""


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; the first column is left-aligned, the others right-aligned."""
    lines = [list(header), [":---"] + ["---:"] * (len(header) - 1), *map(list, rows)]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def mib(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value / 2**20:,.{digits}f}"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ms(seconds: float | None) -> str:
    return "not measured" if seconds is None else f"{seconds * 1e3:,.1f}"


def ratios_cell(values: Sequence[float]) -> str:
    """``median (min-max)`` of per-repeat ratios; ``-`` for none."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def outcome_table(outcomes: Iterable[Outcome]) -> str:
    """One row per contender: medians over repeats of throughput, loss, bytes held, peak and bytes on the wire."""
    header = ["configuration", "tokens/s (min-max)", "exposed comm ms/step", "final loss", "held MiB/rank"]
    header += ["peak MiB/rank", "wire MiB/rank/step", "payload MiB/step by collective (rank 0)"]
    rows = []
    for outcome in outcomes:
        if outcome.unavailable is not None:
            rows.append([outcome.contender.label, f"not available: `{outcome.unavailable}`", *["-"] * 6])
            continue
        speeds = [run.tokens_per_s for run in outcome.runs]
        payload = outcome.runs[0].payload
        by_collective = (
            "not measured"
            if payload is None
            else ", ".join(f"{k} {mib(v, 3)}" for k, v in sorted(payload[0].items())) or "none"
        )
        rows.append(
            [
                outcome.contender.label,
                f"{statistics.median(speeds):,.0f} ({min(speeds):,.0f}-{max(speeds):,.0f})",
                _ms(outcome.median(lambda run: run.exposed_s)),
                _num(outcome.median(lambda run: run.loss), 4),
                mib(outcome.median(lambda run: run.max_held)),
                mib(outcome.median(lambda run: run.max_peak), 1),
                mib(outcome.median(lambda run: run.wire), 3),
                by_collective,
            ]
        )
    return markdown_table(header, rows)


def comparison_table(comparisons: Iterable[Comparison]) -> str:
    """One row per pair: throughput ratio (median, spread, per repeat), the exposed communication per step of both
    sides (what explains much of a ratio), the byte ratios and the CPU seconds per step (work done, what load on a
    shared machine changes least); an anchor that did not run says why."""
    header = ["ours", "anchor", "throughput ours/anchor, median (min-max); > 1: ours faster", "per repeat"]
    header += ["exposed comm ms/step, ours / anchor", "held bytes ratio (< 1: ours less)", "peak memory ratio"]
    header += ["wire bytes ratio", "CPU s/step ours/anchor, median (min-max); < 1: ours less work"]
    rows = []
    for c in comparisons:
        if c.unavailable is not None:
            rows.append([c.ours, c.anchor, f"not available: `{c.unavailable}`", *["-"] * 6])
            continue
        per_repeat = ", ".join(f"{r:.3f}" for r in c.throughput)
        exposed = " / ".join(_ms(seconds) for seconds in c.exposed_s)
        ratios = [_num(c.held), _num(c.peak), _num(c.wire), ratios_cell(c.cpu)]
        rows.append([c.ours, c.anchor, ratios_cell(c.throughput), per_repeat, exposed, *ratios])
    return markdown_table(header, rows)


def paired_blocks(comparisons: Iterable[Comparison], outcomes: Iterable[Outcome]) -> dict[str, str]:
    """The tables of a section whose contenders train one workload in pairs: ours / anchor, then every contender's
    medians over repeats."""
    return {"Ours / anchor": comparison_table(comparisons), "Medians over repeats": outcome_table(outcomes)}


def load_notes(outcomes: Iterable[Outcome]) -> list[str]:
    """The machine's 1-minute load average over the runs (start and end of every fit): min / median / max, and a
    warning when its maximum exceeds the cores + 0.5 (other work shared the cores: the ratios are noisy)."""
    loads = [value for outcome in outcomes for value in outcome.loads]
    if not loads:
        return ["Load 1-min average during the runs: not recorded."]
    cores = os.cpu_count() or 1
    notes = [
        f"Load 1-min average during the runs (start and end of every fit; the benchmark's own ranks count):"
        f" {min(loads):.2f} / {statistics.median(loads):.2f} / {max(loads):.2f} (min / median / max), {cores} cores."
    ]
    if max(loads) > cores + 0.5:
        notes.append(
            f"**Warning: noisy run.** The load reached {max(loads):.2f} on {cores} cores (> cores + 0.5): other work"
            " competed for the cores during these runs; rerun on a quiet machine before trusting small ratios."
        )
    return notes


def machine_description() -> str:
    """CPU model, core count and the versions that matter."""
    cpu = platform.processor() or platform.machine()
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        match = None
    cpu = match.group(1).strip() if match else cpu
    if torch.cuda.is_available():
        cpu += f"; {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return (
        f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__},"
        f" lightning {lightning.__version__}"
    )


def section(title: str, *, command: str, notes: Sequence[str], blocks: Mapping[str, str]) -> str:
    """A RESULTS.md section: title, command, date, machine, notes, then each ``### heading`` and its block."""
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    lines = [f"## {title}", "", f"- Command: `{command}`", f"- Date: {date}", f"- Machine: {machine_description()}"]
    lines += [f"- {note}" for note in notes]
    for heading, block in blocks.items():
        lines += ["", f"### {heading}", "", block] if heading else ["", block]
    return "\n".join(lines)


def update_section(name: str, body: str, *, path: Path = RESULTS_PATH, first: bool = False) -> None:
    """Replace section ``name`` of ``path`` (between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``) with ``body``.

    A new section is appended, or with ``first=True`` put before the first other section; other text is kept.
    """
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else _HEADER
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    elif first and "<!-- begin " in text:
        head, tail = text.split("<!-- begin ", 1)
        text = f"{head.rstrip()}\n\n{block}\n\n<!-- begin {tail}"
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")
