"""A finished process leaves no process group to the interpreter's teardown, and torchrun'd jobs exit with status 0.

A gloo group still alive when Python tears itself down can abort the process ("terminate called without an active
exception") after training finished (docs/reliability.md, "Known issue"). ``release_process_groups``, registered
at exit by every strategy, destroys the groups and frees them while the interpreter is whole.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist
from distributed_harness import find_free_port, run_distributed
from exit_probe import gloo_threads
from training_helpers import fit_tiny

from lightning_parallel.strategies.shutdown import release_process_groups

ROOT = Path(__file__).resolve().parents[1]


def _fit_and_watch_groups(strategy: str, world_size: int) -> list[weakref.ref]:
    """Fit on every rank; weak references to every process group that exists afterwards (the strategy, its mesh,
    FSDP2 or the pipeline hold them; they go out of scope here, as at the end of a script)."""
    fit_tiny(strategy, devices=world_size, per_device_batch=2, max_steps=2)
    groups = list(dist.distributed_c10d._world.pg_map)  # every group of this process, the default one included
    assert len(groups) >= 2, groups  # the default group and the mesh's
    return [weakref.ref(group) for group in groups]


def _fit_then_release(rank: int, world_size: int, strategy: str) -> dict:
    groups = _fit_and_watch_groups(strategy, world_size)
    assert gloo_threads(), "the groups' threads run before the release"
    release_process_groups()
    # A collective still finishing on a gloo thread holds its group until it completes: under load (the whole suite
    # on 2 cores) that took a moment after the release twice, so wait a bounded time for them to go; a group held
    # by a reference (what this test is about) never goes.
    deadline = time.monotonic() + 10
    while any(ref() is not None for ref in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
        gc.collect()
    return {"alive_groups": sum(ref() is not None for ref in groups), "gloo_threads": gloo_threads()}


@pytest.mark.parametrize("strategy", ["zero3", "pipeline"])
def test_release_frees_every_process_group_and_its_threads(strategy):
    # Without the release, three groups and their nine threads outlived `destroy_process_group()` (the mesh and
    # DTensor's caches held them under ZeRO-3; reference cycles under every strategy).
    results = run_distributed(_fit_then_release, 2, args=(strategy,), init_process_group=False, timeout=120)
    assert results == [{"alive_groups": 0, "gloo_threads": []}] * 2


@pytest.mark.slow
def test_torchrun_job_exits_0_with_no_process_group_left_at_interpreter_teardown(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{find_free_port()}",
        str(ROOT / "tests" / "exit_probe.py"), str(ROOT / "examples" / "fault_tolerant.py"),
        "--strategy", "zero3", "--dir", str(tmp_path / "ckpt"), "--max-steps", "2", "--every", "1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "EXIT_PROBE_DIR": str(tmp_path)})
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "finished at step 2" in output and "terminate called" not in output, output[-3000:]
    records = sorted((json.loads(path.read_text()) for path in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert records == [{"rank": r, "gloo_threads": [], "mesh_groups": 0} for r in (0, 1)], output[-3000:]
