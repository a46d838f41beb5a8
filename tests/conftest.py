"""Shared test set-up. torch and Lightning are imported here so forked ranks inherit them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Every test runs on CPU ranks forked from this process. On a GPU machine, anything here that touched CUDA (a
# Lightning run, torch.random.fork_rng) would make every later fork fail, so hide the GPUs from the test session.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import lightning.pytorch  # noqa: F401  (imported once in the parent so forked ranks inherit it)
import pytest
import torch

import lightning_parallel  # noqa: F401  (registers the strategy names)

sys.path.insert(0, str(Path(__file__).parent))

# One intra-op thread: ranks share two cores, and forking a process whose OpenMP pool is busy is unsafe.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def restore_environment():
    """Lightning's launchers write MASTER_PORT, WORLD_SIZE, ... into os.environ; undo that after each test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# The planner's dry-run tests run torch's fake process group and FakeTensorMode in this (the parent) process. After
# them, one forked ZeRO-3 test (tests/test_zero.py, manual accumulation at stage 3) trained differently from one
# device, every time, in the whole suite and in `pytest tests/test_planner_dry_run*.py tests/test_zero.py` alike; it
# passes in any run without them. The state they leave behind is not found yet (see the session's closing note): until
# it is, they run last, so that no forked test inherits it.
_RUN_LAST = ("test_planner_dry_run.py", "test_planner_dry_run_pipeline.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name in _RUN_LAST)  # stable: every other test keeps its order
