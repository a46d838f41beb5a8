"""Run every benchmark in one run and write ``benchmarks/RESULTS.md`` with its figures (``make bench``).

Usage::

    python -m benchmarks.run_all [--preset tiny|small|medium|large] [--repeats N] [--steps N] [--only zero,pipeline]
                                 [--output benchmarks/RESULTS.md]

``medium`` (default, ``make bench``, ~35 minutes on 2 cores) is the CPU suite at a realistic size: ``gpt-20m`` (20.5 M
parameters) at world size 2, ours and every anchor interleaved in 3 repeats (scaling at 1, 2, 4 on a 12.7 M model;
tensor parallelism 1 data x 2 tensor, 2 x 2 on 4 processes where 4 cores are there);
``small`` the same on the 3 M demo model (faster, less decisive); ``large`` the GPU sizes (``gpt-125m``, NCCL), not run
by us yet; ``tiny`` takes a few minutes (what the tests run). Every section records the machine's load during its runs
and warns when other work competed for the cores. A benchmark is a module with ``NAME``,
``PRESETS`` (preset -> a config with ``workload`` and ``repeats``), ``measure(config)`` returning results with
``comparisons``, ``render(results, *, command)`` and optionally ``write_figures(results, folder)``. The summary (every
comparison's ratios, in one table and one figure) is the first section. A benchmark that raises is reported, the
others still run, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks import data_parallel, figures, pipeline, tensor_parallel, zero
from benchmarks.isolation import return_freed_memory_to_os
from benchmarks.report import RESULTS_PATH, comparison_table, load_notes, section, update_section
from lightning_parallel.demos.main import quiet_lightning

__all__ = [
    "BENCHMARKS",
    "DEFAULT_PRESET",
    "PRESET_NAMES",
    "SuiteConfig",
    "SuiteResults",
    "configure",
    "main",
    "run_suite",
]

BENCHMARKS: dict[str, ModuleType] = {module.NAME: module for module in (data_parallel, zero, pipeline, tensor_parallel)}
PRESET_NAMES = ("tiny", "small", "medium", "large")
DEFAULT_PRESET = "medium"


@dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    """What one run of the suite does."""

    preset: str = DEFAULT_PRESET
    repeats: int | None = None
    """Repeats of every interleaved comparison; ``None``: each preset's."""
    steps: int | None = None
    """Optimizer steps of every compared fit (the warm-up is kept shorter); ``None``: each preset's."""
    only: tuple[str, ...] = tuple(BENCHMARKS)
    results_path: Path = RESULTS_PATH
    """The Markdown file to update; figures go to ``figures/`` beside it."""

    def __post_init__(self) -> None:
        if self.preset not in PRESET_NAMES:
            raise ValueError(f"`preset={self.preset!r}` is not one of {', '.join(PRESET_NAMES)}.")
        unknown = [name for name in self.only if name not in BENCHMARKS]
        if unknown or not self.only:
            raise ValueError(f"`only={list(self.only)}`: choose one or more of {', '.join(BENCHMARKS)}.")
        for name in ("repeats", "steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"`{name}={value}` must be at least 1 (or None for the preset's value).")

    def command(self) -> str:
        """The command line that reproduces this run."""
        parts = ["python -m benchmarks.run_all", f"--preset {self.preset}"]
        parts += [] if self.repeats is None else [f"--repeats {self.repeats}"]
        parts += [] if self.steps is None else [f"--steps {self.steps}"]
        parts += [] if self.only == tuple(BENCHMARKS) else [f"--only {','.join(self.only)}"]
        parts += [] if self.results_path == RESULTS_PATH else [f"--output {self.results_path}"]
        return " ".join(parts)


def configure(module: ModuleType, suite: SuiteConfig) -> Any:
    """``module``'s preset with the suite's ``repeats`` and ``steps`` where given."""
    config = module.PRESETS[suite.preset]
    if suite.steps is not None:
        warmup = min(config.workload.warmup_steps, suite.steps - 1)
        config = replace(config, workload=replace(config.workload, steps=suite.steps, warmup_steps=warmup))
    return config if suite.repeats is None else replace(config, repeats=suite.repeats)


@dataclass
class SuiteResults:
    benchmarks: dict[str, Any] = field(default_factory=dict)
    """Benchmark name -> its results, for those that ran."""
    failed: dict[str, str] = field(default_factory=dict)
    """Benchmark name -> the error of those that raised."""


def run_suite(suite: SuiteConfig) -> SuiteResults:
    """Run the chosen benchmarks, write their sections, figures and the summary; return what was measured.

    Every fit runs in a process of its own forked from a fresh interpreter (:mod:`benchmarks.isolation`), which forks
    the fit's ranks; this process sets one intra-op thread (a forked child of a process whose OpenMP pool ran can hang)
    and never initialises CUDA (the ranks do).
    """
    torch.set_num_threads(1)
    quiet_lightning()
    return_freed_memory_to_os()
    folder, command, results = suite.results_path.parent / "figures", suite.command(), SuiteResults()
    for name in suite.only:
        module = BENCHMARKS[name]
        try:
            measured = module.measure(configure(module, suite))
            if hasattr(module, "write_figures"):
                module.write_figures(measured, folder)
            update_section(name, module.render(measured, command=command), path=suite.results_path)
        except Exception as error:  # one broken benchmark must not hide the others' results
            traceback.print_exc()
            results.failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            continue
        results.benchmarks[name] = measured
    comparisons = [c for measured in results.benchmarks.values() for c in measured.comparisons]
    outcomes = [o for measured in results.benchmarks.values() for o in measured.outcomes.values()]
    bars = {f"{c.ours} / {c.anchor}": c.throughput for c in comparisons if c.throughput}
    blocks = {"": comparison_table(comparisons) if comparisons else "No comparison ran."}
    if results.failed:
        blocks["Benchmarks that failed"] = "\n".join(f"- `{n}`: `{e}`" for n, e in results.failed.items())
    if bars:
        figures.ratio_chart(bars, folder / "throughput_ratios.png")
        blocks["Throughput ratios"] = "![throughput ratios](figures/throughput_ratios.png)"
    summary = section(
        "Summary: ours beside the anchors",
        command=command,
        notes=[
            "Each row pairs two configurations of one benchmark, run back to back in every repeat (alternating"
            " order); ratios are ours / anchor. Bytes held and peak memory: largest rank; wire bytes: busiest rank per"
            " step (1: the same traffic; ZeRO-3 needs 1.5x DDP's by design). Exposed communication: the monitor's"
            " median per step, ours / anchor. CPU s/step: the largest rank's CPU seconds per step (every thread of"
            " the rank) in the same timed fits, ours / anchor: the work done per step, which other work on a shared"
            " machine changes far less than the seconds waited (`-`: a side that does not measure it). Details in"
            " the sections below.",
            *load_notes(outcomes),
        ],
        blocks=blocks,
    )
    update_section("summary", summary, path=suite.results_path, first=True)
    print("\n" + summary)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite from the command line; 0 if every benchmark ran, 1 if one raised."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default=DEFAULT_PRESET, choices=PRESET_NAMES, help=f"benchmark size (default: {DEFAULT_PRESET})"
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats of every interleaved comparison")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of every compared fit")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset of the benchmarks")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH, help="RESULTS.md to update (figures beside it)")
    args = parser.parse_args(argv)
    try:
        suite = SuiteConfig(
            preset=args.preset,
            repeats=args.repeats,
            steps=args.steps,
            only=tuple(name for name in args.only.split(",") if name),
            results_path=args.output,
        )
    except ValueError as error:
        parser.error(str(error))
    results = run_suite(suite)
    if results.failed:
        print(f"Failed benchmarks: {', '.join(results.failed)}", file=sys.stderr)
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
