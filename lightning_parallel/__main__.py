"""``python -m lightning_parallel``: the same command as ``lightning-parallel`` (see :mod:`lightning_parallel.cli`)."""

from __future__ import annotations

import sys

from lightning_parallel.cli import main

if __name__ == "__main__":
    sys.exit(main())
