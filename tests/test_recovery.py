"""Kill a rank under torchrun --max-restarts=1: the job restarts, resumes from the last checkpoint by itself, and
ends with the weights of an uninterrupted run; a hundred steps with periodic checkpoints leak nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_harness import find_free_port
from training_helpers import assert_weights_close

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "fault_tolerant.py")
STEPS, EVERY, KILL_AT = 100, 20, 70


# torch 2.13 + gloo: a process may abort *after* the job finished and saved ("terminate called without an active
# exception"), and torchrun counts that as a failure. Known issue (docs/reliability.md): seen with ZeRO-3 (about 1 in 8
# once, then 0 in 66 runs) and once (2026-12-02) in the pipeline's restarted attempt, with gloo groups left to the
# interpreter's teardown; the exit handler frees them since, but the abort was too rare to show it gone. The test gives
# torchrun one spare restart for it and still requires the final weights to equal an uninterrupted run's.
def _torchrun(directory: Path, strategy: str, *, kill: bool) -> dict:
    """Run the example under torchrun; return what rank 0 saved at the end."""
    restarts = 2  # one for the kill, one spare for the known exit abort
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--max-restarts={restarts}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{find_free_port()}",
        SCRIPT, "--strategy", strategy, "--dir", str(directory), "--max-steps", str(STEPS), "--every", str(EVERY),
    ]  # fmt: skip
    if kill:
        command += ["--kill-rank", "1", "--kill-at-step", str(KILL_AT)]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert f"finished at step {STEPS}" in output, output[-3000:]
    aborted = "terminate called" in output
    if aborted:  # only after the job had finished
        assert output.index(f"finished at step {STEPS}") < output.index("terminate called"), output[-3000:]
    elif kill:
        assert "Restored all states from the checkpoint" in output, output[-3000:]
    else:
        assert "Restoring states" not in output, output[-3000:]  # an uninterrupted run never restarts
    return torch.load(directory / "final.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["data_parallel", "zero2", "zero3", "pipeline"])
def test_killed_rank_restarts_resumes_and_matches_the_uninterrupted_run(tmp_path, strategy):
    uninterrupted = _torchrun(tmp_path / "uninterrupted", strategy, kill=False)
    recovered = _torchrun(tmp_path / "recovered", strategy, kill=True)
    assert_weights_close(recovered["weights"], uninterrupted["weights"], rtol=1e-6, atol=1e-7)
    for run in (uninterrupted, recovered):
        if not run["resources"]:  # the known exit abort: the spare restart found the job done and trained nothing
            continue
        resources = run["resources"]
        assert resources["end"] == resources["after_first_save"], resources  # (fds, threads, child processes)
