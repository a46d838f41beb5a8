"""Run every benchmark in one run and write ``benchmarks/RESULTS.md`` with its figures (``make bench``).

Usage::

    python -m benchmarks.run_all [--preset small|large|tiny] [--repeats N] [--steps N] [--only zero,pipeline]
                                 [--output benchmarks/RESULTS.md]

* ``small`` (default): the CPU suite at world size 2 (the scaling part at 1, 2, 4), a few minutes on 2 cores.
* ``large``: GPU sizes (``gpt-125m``, NCCL, one process per GPU); for a machine with >= 4 GPUs. Not run by us yet.
* ``tiny``: seconds; what the tests run.

A benchmark is a module with ``NAME``, ``configure(preset, *, repeats, steps)``, ``measure(config)`` and
``render_markdown(results, *, command)`` (and optionally ``write_figures(results, figures_dir)``); add new ones to
:data:`BENCHMARKS`. Each writes its own section of RESULTS.md; the summary section (ratios ours / anchor of every
comparison, figures, scaling) comes first. A benchmark that raises is reported and the others still run; the exit
status is then 1.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks import data_parallel, pipeline, scaling, summary, zero
from benchmarks.results import RESULTS_PATH, update_section
from lightning_parallel.demos.main import quiet_lightning

__all__ = ["BENCHMARKS", "PRESET_NAMES", "SuiteConfig", "SuiteResults", "main", "run_suite"]

BENCHMARKS: dict[str, ModuleType] = {module.NAME: module for module in (data_parallel, zero, pipeline)}
"""Benchmark name -> module, in the order they run."""
PRESET_NAMES = ("tiny", "small", "large")
"""Values of ``--preset``; every benchmark module has a configuration for each."""


@dataclass(kw_only=True)
class SuiteConfig:
    """What one run of the suite does."""

    preset: str = "small"
    """Size of every benchmark, one of :data:`PRESET_NAMES`."""
    repeats: int | None = None
    """Repeats of every timed comparison; ``None``: each benchmark's preset value."""
    steps: int | None = None
    """Optimizer steps of every timed run; ``None``: each benchmark's preset value."""
    only: tuple[str, ...] = tuple(BENCHMARKS)
    """Benchmarks to run, names of :data:`BENCHMARKS`."""
    results_path: Path = RESULTS_PATH
    """The markdown file to update; figures go to ``figures/`` beside it."""

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

    @property
    def figures_dir(self) -> Path:
        """Where the PNG figures go: ``figures/`` beside :attr:`results_path`."""
        return self.results_path.parent / "figures"

    def command(self) -> str:
        """The command line that reproduces this run."""
        parts = ["python -m benchmarks.run_all", f"--preset {self.preset}"]
        parts += [] if self.repeats is None else [f"--repeats {self.repeats}"]
        parts += [] if self.steps is None else [f"--steps {self.steps}"]
        parts += [] if self.only == tuple(BENCHMARKS) else [f"--only {','.join(self.only)}"]
        parts += [] if self.results_path == RESULTS_PATH else [f"--output {self.results_path}"]
        return " ".join(parts)


@dataclass
class SuiteResults:
    """What one run of the suite measured."""

    benchmarks: dict[str, Any] = field(default_factory=dict)
    """Benchmark name -> its result object, for those that ran."""
    failed: dict[str, str] = field(default_factory=dict)
    """Benchmark name -> the error of those that raised."""


def run_suite(config: SuiteConfig) -> SuiteResults:
    """Run the chosen benchmarks, write their sections, the summary and the figures; return what was measured.

    Sets this process to one intra-op thread before the first fork (a forked child of a process whose OpenMP pool
    ran can hang) and never initialises CUDA here (the ranks do).
    """
    torch.set_num_threads(1)
    quiet_lightning()
    zero.return_freed_memory_to_os()  # before the first fork, so every configuration's ranks inherit it alike
    command = config.command()
    results = SuiteResults()
    for name in config.only:
        module = BENCHMARKS[name]
        start = time.monotonic()
        try:
            bench_config = module.configure(config.preset, repeats=config.repeats, steps=config.steps)
            measured = module.measure(bench_config)
            if hasattr(module, "write_figures"):
                module.write_figures(measured, config.figures_dir)
            update_section(name, module.render_markdown(measured, command=command), path=config.results_path)
        except Exception as error:  # one broken benchmark must not hide the others' results
            traceback.print_exc()
            results.failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            continue
        results.benchmarks[name] = measured
        print(f"\n=== {name}: {time.monotonic() - start:.0f} s ===", flush=True)
    predicted = None
    if "zero" in results.benchmarks:
        try:
            predicted = scaling.predicted_scaling(results.benchmarks["zero"].config.memory)
        except Exception as error:  # the measured part is still worth writing
            traceback.print_exc()
            results.failed["planner"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    section = summary.render_summary(
        results.benchmarks,
        command=command,
        failed=results.failed,
        figures_dir=config.figures_dir,
        results_path=config.results_path,
        predicted=predicted,
    )
    update_section(summary.NAME, section, path=config.results_path, first=True)
    print("\n" + section)
    return results


def _parse_args(argv: Sequence[str] | None) -> SuiteConfig:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=PRESET_NAMES, help="benchmark size (default: small)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of every timed comparison")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of every timed run")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset of the benchmarks")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH, help="RESULTS.md to update (figures beside it)")
    args = parser.parse_args(argv)
    try:
        return SuiteConfig(
            preset=args.preset,
            repeats=args.repeats,
            steps=args.steps,
            only=tuple(name for name in args.only.split(",") if name),
            results_path=args.output,
        )
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite from the command line.

    Args:
        argv: Command-line arguments; ``None`` reads ``sys.argv``.

    Returns:
        0 if every benchmark ran (whether or not it met its goals: the tables say so), 1 if one raised.
    """
    results = run_suite(_parse_args(argv))
    if results.failed:
        print(f"Failed benchmarks: {', '.join(results.failed)}", file=sys.stderr)
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
