"""Run every benchmark and update ``benchmarks/RESULTS.md``.

Usage: ``python -m benchmarks.run_all [--preset small|tiny] [--repeats N]``.

A benchmark is a module with ``main(argv, *, command=...) -> int``; add new ones to :data:`BENCHMARKS`. A benchmark
that raises is reported and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType

from benchmarks import data_parallel, pipeline, zero

__all__ = ["BENCHMARKS", "main"]

BENCHMARKS: tuple[ModuleType, ...] = (data_parallel, pipeline, zero)
"""The benchmark modules, in the order they run."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run every benchmark of :data:`BENCHMARKS` with the same ``--preset`` and ``--repeats``.

    Args:
        argv: Command-line arguments; ``None`` reads ``sys.argv``.

    Returns:
        0 if every benchmark ran, 1 if one raised or returned non-zero.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description="Run every benchmark.")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"], help="model size (default: small)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (default: 3)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be at least 1.")
    command = f"python -m benchmarks.run_all --preset {args.preset} --repeats {args.repeats}"
    failed = []
    for module in BENCHMARKS:
        try:
            status = module.main(["--preset", args.preset, "--repeats", str(args.repeats)], command=command)
        except Exception:  # one broken benchmark must not hide the others' results
            traceback.print_exc()
            status = 1
        if status != 0:
            failed.append(module.__name__)
    if failed:
        print(f"Failed benchmarks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
