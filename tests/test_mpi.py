"""``mpirun -np 2 python example.py``: Lightning's MPIEnvironment (mpi4py) drives each of our strategies.

Needs Open MPI's ``mpirun`` and ``mpi4py`` (CI installs both, see ``.ci/run``). Elsewhere the tests skip and say
why, unless ``LIGHTNING_PARALLEL_REQUIRE_LAUNCHERS=1`` (set by CI) turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from launch_helpers import (
    assert_all_succeeded,
    assert_equals_single_device,
    assert_ranks_took_part,
    clean_environment,
    example_command,
    run_together,
)


def _mpi_missing() -> str | None:
    """Why MPI runs cannot happen here, or ``None``."""
    if shutil.which("mpirun") is None:
        return "`mpirun` not found: install Open MPI (`apt-get install openmpi-bin libopenmpi-dev`)"
    check = [sys.executable, "-c", "from mpi4py import MPI"]
    result = subprocess.run(check, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        return f"mpi4py cannot load MPI here (`pip install mpi4py`): {result.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.fixture(scope="module")
def mpirun() -> list[str]:
    reason = _mpi_missing()
    if reason is not None:
        if os.environ.get("LIGHTNING_PARALLEL_REQUIRE_LAUNCHERS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    # As root Open MPI refuses to start without --allow-run-as-root; --oversubscribe: 2 ranks even on 1 core.
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2"]


# One run per strategy at np=2 (each ~13 s on 2 cores); the pipeline is 2 stages, one per MPI rank.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["data_parallel", "zero2", "pipeline"])
def test_mpirun_trains_each_strategy_like_one_device(strategy, mpirun, tmp_path):
    save = tmp_path / "final.ckpt"
    command = [*mpirun, sys.executable, *example_command(strategy, save)]
    finished = run_together({"mpirun": command}, {"mpirun": clean_environment()})
    output = assert_all_succeeded(finished)
    # Lightning chose MPIEnvironment by itself; ranks and local ranks come from MPI, not from torch's variables.
    assert_ranks_took_part(output, world_size=2, num_nodes=1, environment="MPIEnvironment")
    assert_equals_single_device(save)
