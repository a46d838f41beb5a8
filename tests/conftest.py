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


@pytest.fixture(scope="session")
def streamed_chunks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tests/streamed_data.py``'s samples as LitData chunks, written once a session (``litdata.optimize``: ~5 s on
    2 shared cores): the replica-group, Ray and ``tell_data_parallel_rank`` tests read them. Skipped without LitData or
    Hugging Face ``datasets``."""
    pytest.importorskip("litdata")
    pytest.importorskip("datasets")
    from streamed_data import write_streamed

    path = tmp_path_factory.mktemp("streamed") / "chunks"
    write_streamed(path)
    return path
