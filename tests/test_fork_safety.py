"""The CUDA-before-fork check: every fork launch of every strategy runs it, and it refuses with advice.

What is real here and what is injected: this machine has no GPU (and conftest hides any), so
``torch.cuda.is_initialized()`` is always False. The launches below are real ``Trainer.fit`` runs that fork 2 ranks
joined by gloo, and they pass the check reading torch's real state. The refusal is exercised by injecting the fact
"CUDA is initialised" into our own check (``check_cuda_before_fork(cuda_initialized=True)``, or replacing our one-line
reader ``fork_safety._cuda_is_initialized``); torch, torch.distributed and Lightning are not patched. Not covered
here: a real CUDA context created before a real fork (needs a GPU machine).
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from training_helpers import cpu_trainer

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.strategies import fork_safety
from lightning_parallel.strategies.fork_safety import CUDA_BEFORE_FORK_MESSAGE, ForkSafeLauncher, check_cuda_before_fork
from lightning_parallel.strategies.registry import registered_names

SEQ_LEN = 16
PROCESS_GROUP_TIMEOUT_S = 180  # generous: the 2 cores are shared with other tests


def test_refuses_to_fork_after_cuda_was_initialized() -> None:
    with pytest.raises(RuntimeError) as error:
        check_cuda_before_fork("fork", cuda_initialized=True)
    message = str(error.value)
    assert message == CUDA_BEFORE_FORK_MESSAGE
    # Names the cause and every fix.
    for phrase in ("CUDA was initialised", "restart", "kernel", "start_method='spawn'", "start_method='popen'"):
        assert phrase in message


@pytest.mark.parametrize(
    ("start_method", "cuda_initialized"),
    [("fork", False), ("spawn", True), ("popen", True), ("spawn", False), ("popen", False)],
)
def test_allows_what_is_safe(start_method: str, cuda_initialized: bool) -> None:
    check_cuda_before_fork(start_method, cuda_initialized=cuda_initialized)  # fresh interpreters may use CUDA


def test_reads_torch_state_by_default() -> None:
    assert torch.cuda.is_initialized() is False  # this test session never creates a CUDA context
    assert fork_safety._cuda_is_initialized() is False
    check_cuda_before_fork("fork")


@pytest.mark.parametrize("name", [n for n in registered_names() if n.endswith(("_notebook", "_spawn"))])
def test_every_fork_and_spawn_name_uses_the_checked_launcher(name: str) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy.launcher, ForkSafeLauncher)
    assert trainer.strategy.launcher._start_method == ("fork" if name.endswith("_notebook") else "spawn")


STRATEGIES = {
    "data_parallel": lambda: DataParallelStrategy(start_method="fork", timeout=PROCESS_GROUP_TIMEOUT_S),
    "zero2": lambda: ShardedOptimizerStrategy(stage=2, start_method="fork", timeout=PROCESS_GROUP_TIMEOUT_S),
    "zero3": lambda: ShardedOptimizerStrategy(stage=3, start_method="fork", timeout=PROCESS_GROUP_TIMEOUT_S),
    "pipeline": lambda: PipelineParallelStrategy(start_method="fork", timeout=PROCESS_GROUP_TIMEOUT_S),
}


class _MarkStart(Callback):
    """Writes a file on every rank when fit starts, so the test sees whether any rank ever ran."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.directory / f"rank{trainer.global_rank}").touch()


def _fit(strategy: Any, directory: Path) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = cpu_trainer(
        devices=2,
        strategy=strategy,
        max_steps=2,
        callbacks=[_MarkStart(directory)],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    loader = DataLoader(RandomTokenDataset(32, SEQ_LEN, seed=7), batch_size=4)
    trainer.fit(GPTLightningModule("tiny", block_size=SEQ_LEN), train_dataloaders=loader)
    return trainer


@pytest.mark.timeout(2 * PROCESS_GROUP_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fork_launch_passes_the_real_check(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real 2-rank fork launch reaches the check once (reading torch's real state) and trains."""
    calls = []

    def counting_reader() -> bool:
        calls.append(multiprocessing.current_process().pid)
        return torch.cuda.is_initialized()

    monkeypatch.setattr(fork_safety, "_cuda_is_initialized", counting_reader)
    trainer = _fit(STRATEGIES[name](), tmp_path)
    assert len(calls) == 1  # in this (the parent) process, before forking
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    assert "train_loss" in trainer.callback_metrics  # rank 0's metrics came back to the parent


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fork_launch_refuses_before_forking(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA initialised (injected), ``fit`` raises our error and no rank ever starts."""
    monkeypatch.setattr(fork_safety, "_cuda_is_initialized", lambda: True)
    with pytest.raises(RuntimeError) as error:
        _fit(STRATEGIES[name](), tmp_path)
    assert str(error.value) == CUDA_BEFORE_FORK_MESSAGE
    assert list(tmp_path.iterdir()) == []
    assert multiprocessing.active_children() == []
