"""Integration: ParallelismMonitor's metrics reach a TensorBoard event file through Lightning's TensorBoardLogger.

A real 2-rank fit (ZeRO-2, fork launcher) writes the event file; TensorBoard's own ``EventAccumulator`` reads it back.
Skipped when the optional `tensorboard` extra is not installed (`pip install -e ".[tensorboard]"`; `test` has it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from torch.utils.data import DataLoader
from training_helpers import make_trainer

from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.monitor import ParallelismMonitor

pytest.importorskip("tensorboard", reason="the `tensorboard` extra is not installed")
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

BATCH, SEQ, STEPS = 4, 16, 3


def _fit_and_read_events(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        logger = TensorBoardLogger(tmp, name="", version="run", default_hp_metric=False)
        monitor = ParallelismMonitor(log_every_n_steps=1, figure_path=False)
        trainer = make_trainer("zero2_notebook", devices=2, max_steps=STEPS, logger=logger, callbacks=[monitor])
        pl.seed_everything(0, verbose=False)
        module = GPTLightningModule("tiny", block_size=SEQ)
        numel = sum(p.numel() for p in module.parameters())
        trainer.fit(module, train_dataloaders=DataLoader(RandomTokenDataset(64, SEQ, seed=3), batch_size=BATCH))
        events = list(Path(tmp, "run").glob("events.out.tfevents.*"))
        accumulator = EventAccumulator(str(Path(tmp, "run")))
        accumulator.Reload()
        tags = accumulator.Tags()["scalars"]
        series = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in tags}
        return {"events": len(events), "series": series, "numel": numel}


@pytest.mark.slow
def test_monitor_series_and_per_rank_memory_reach_tensorboard() -> None:
    (result,) = run_distributed(
        _fit_and_read_events, world_size=1, init_process_group=False, launcher_env=False, timeout=240
    )
    assert result["events"] >= 1
    series, numel = result["series"], result["numel"]
    # Per-step series from rank 0: one point per optimizer step.
    for tag in ("monitor/step_time_s", "monitor/samples_per_s", "monitor/tokens_per_s", "monitor/bytes_all_gather"):
        assert [step for step, _ in series[tag]] == list(range(STEPS)), tag
        assert all(value > 0 for _, value in series[tag]), tag
    # Per-rank memory, exact: ZeRO-2 on 2 ranks holds whole fp32 parameters, half the gradients and half of AdamW's
    # two states per element (the tiny GPT's element count is even, so the halves are equal).
    for rank in (0, 1):
        assert series[f"monitor/rank{rank}/held_parameters_bytes"][-1][1] == 4 * numel, rank
        assert series[f"monitor/rank{rank}/held_optimizer_state_bytes"][-1][1] == 8 * numel // 2, rank
        assert series[f"monitor/rank{rank}/peak_memory_bytes"][-1][1] > 0, rank
