"""Standalone tier: the pipeline example started the way users start it (script re-launch, torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from distributed_harness import find_free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "pipeline_parallel.py")


def _run(command: list[str], timeout: float = 240) -> str:
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "WORLD_SIZE", "RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
def test_script_relaunch_popen_trains_a_two_stage_pipeline():
    output = _run([sys.executable, EXAMPLE, "--devices", "2", "--max-steps", "4"])
    assert "world_size=2 split starts=(0, 2)" in output
    assert "rank 0: stages [0]" in output and "rank 1: stages [1]" in output


@pytest.mark.slow
def test_torchrun_launch_trains_an_interleaved_pipeline():
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={find_free_port()}", EXAMPLE, "--devices", "2", "--max-steps", "4",
        "--schedule", "interleaved1f1b",
    ]  # fmt: skip
    output = _run(command)
    assert "rank 0: stages [0, 2]" in output and "rank 1: stages [1, 3]" in output


@pytest.mark.slow
def test_one_rank_runs_the_whole_model_as_one_stage_whatever_the_schedule():
    # Validation runs too (sanity check and at the end): torch's multi-stage runtimes fail forward-only with two
    # stages on one rank, so a one-rank pipeline is a single stage.
    output = _run([sys.executable, EXAMPLE, "--devices", "1", "--max-steps", "3", "--schedule", "Interleaved1F1B"])
    assert "world_size=1 split starts=(0,)" in output and "val_loss" in output


@pytest.mark.slow
def test_spawn_start_method_trains_and_reports_from_the_ranks():
    output = _run([sys.executable, EXAMPLE, "--devices", "2", "--max-steps", "4", "--start-method", "spawn"])
    assert "world_size=2 split starts=(0, 2)" in output and "rank 1: stages [1]" in output
