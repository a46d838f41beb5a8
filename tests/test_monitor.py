"""ParallelismMonitor: degrades gracefully under Lightning's own DDPStrategy, logs through the Trainer's loggers,
writes its table/JSON/PNG at the end of fit; its tap counts only what FSDP2 issues.

The exact bytes it measures under our strategies are checked against the planner in ``test_planner.py``."""

from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from training_helpers import make_trainer

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.distributed.compression import CommunicationStats
from lightning_parallel.monitor import CollectiveTap, ParallelismMonitor, format_table, write_figure

BATCH, SEQ, STEPS = 4, 16, 3


def _module() -> GPTLightningModule:
    pl.seed_everything(0, verbose=False)
    return GPTLightningModule("tiny", block_size=SEQ)


def _fit_lightning_ddp(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        logger = CSVLogger(tmp, name="", version="run")
        trainer = make_trainer(
            "ddp_notebook", devices=2, max_steps=STEPS, logger=logger, callbacks=[ParallelismMonitor()]
        )
        trainer.fit(_module(), train_dataloaders=DataLoader(RandomTokenDataset(64, SEQ, seed=3), batch_size=BATCH))
        log_dir = Path(tmp, "run")
        with open(log_dir / "metrics.csv") as file:
            rows = list(csv.DictReader(file))
        return {
            "summary": json.loads((log_dir / "parallelism_monitor.json").read_text()),
            "png": (log_dir / "parallelism_monitor.png").read_bytes()[:8],
            "rows": rows,
        }


@pytest.mark.slow
def test_under_lightning_ddp_reports_throughput_and_memory_and_logs_to_csv() -> None:
    (result,) = run_distributed(
        _fit_lightning_ddp, world_size=1, init_process_group=False, launcher_env=False, timeout=240
    )
    summary = result["summary"]
    numel = sum(p.numel() for p in _module().parameters())
    assert summary["strategy"] == "DDPStrategy" and len(summary["ranks"]) == 2
    for rank in summary["ranks"]:
        assert rank["communication_measured"] is False
        # Lightning's DDP: whole replicas, `.grad` tensors of their own, two AdamW states per element.
        assert rank["memory"] == {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer_state": 8 * numel}
        assert rank["peak_memory_bytes"] > 0
        assert len(rank["steps"]) == STEPS
        for step in rank["steps"]:
            assert step["samples"] == 2 * BATCH and step["tokens"] == 2 * BATCH * SEQ
            assert step["communication"] is None and step["exposed_communication_s"] is None
            assert step["pipeline_idle_s"] is None and step["step_time_s"] > 0
    assert "not measured" in format_table(summary)
    assert result["png"] == b"\x89PNG\r\n\x1a\n"
    # Every step's metrics reached the CSV through the Trainer's logger; no communication columns.
    logged = [row for row in result["rows"] if row.get("monitor/samples_per_s")]
    assert [int(row["step"]) for row in logged] == list(range(STEPS))
    assert all(float(row["monitor/held_parameters_bytes"]) == 4 * numel for row in logged)
    assert all(float(row["monitor/tokens_per_s"]) > 0 for row in logged)
    assert not any(key.startswith("monitor/bytes_") for key in result["rows"][0])


def test_figure_is_skipped_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    summary = {
        "strategy": "PipelineParallelStrategy",
        "world_size": 1,
        "ranks": [
            {
                "rank": 0,
                "memory": {"parameters": 2**20, "gradients": 2**20, "optimizer_state": 2**21},
                "peak_memory_bytes": 2**28,
                "communication_measured": True,
                "steps": [
                    {"step": 0, "step_time_s": 0.5, "samples": 8, "timeline": [["F", 0, 0.0, 0.1], ["B", 0, 0.2, 0.4]]}
                ],
            }
        ],
    }
    assert write_figure(summary, tmp_path / "with.png")
    assert (tmp_path / "with.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` does when it is not installed
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert write_figure(summary, tmp_path / "without.png") is False
    assert not (tmp_path / "without.png").exists()


def _tap_counts(rank: int, world_size: int) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))  # 44 parameters: 22 per rank, 176 bytes gathered
    if world_size == 2:
        mesh = init_device_mesh("cpu", (2,))
    else:  # HSDP: sharded over 2 ranks, replicated twice; FSDP2 all-reduces the gradient shards across replicas
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    model(torch.ones(3, 4)).sum().backward()  # outside the tap: not counted
    stats = CommunicationStats()
    with CollectiveTap(stats):
        model(torch.ones(3, 4)).sum().backward()
        dist.all_reduce(torch.ones(5))  # ours (or the user's), not FSDP2's
        dist.all_gather_into_tensor(torch.zeros(2 * world_size), torch.ones(2))
    return dict(stats.bytes_by_collective)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tap_counts_only_what_fsdp2_issues(world_size: int) -> None:
    """The dispatch mode sees every c10d op but records only those FSDP2 issues (HSDP's all-reduce included)."""
    for counts in run_distributed(_tap_counts, world_size=world_size):
        all_reduce = {"all_reduce": 88} if world_size == 4 else {}  # the gradient shard: 22 float32
        assert counts == {"all_gather": counts["all_gather"], "reduce_scatter": 176, **all_reduce}
        assert counts["all_gather"] % 176 == 0  # the gathered output (forward; backward too where resharded)


def test_nothing_is_counted_without_a_monitor() -> None:
    assert DataParallelStrategy().track_communication is False
    assert ShardedOptimizerStrategy(stage=2).track_communication is False


def test_validation() -> None:
    with pytest.raises(ValueError, match="log_every_n_steps=0"):
        ParallelismMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="figure_path=True"):
        ParallelismMonitor(figure_path=True)


def test_single_device_in_process(tmp_path: Path) -> None:
    """No process group at all (Lightning's single-device strategy): measured in this process, written under
    `default_root_dir` when there is no logger."""
    monitor = ParallelismMonitor(log_every_n_steps=2)
    trainer = make_trainer("auto", devices=1, max_steps=2, callbacks=[monitor], default_root_dir=tmp_path)
    module = _module()
    trainer.fit(module, train_dataloaders=DataLoader(RandomTokenDataset(16, SEQ, seed=3), batch_size=BATCH))
    numel = sum(p.numel() for p in module.parameters())
    assert monitor.summary is not None
    (rank,) = monitor.summary["ranks"]
    assert rank["memory"] == {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer_state": 8 * numel}
    assert [s["samples"] for s in rank["steps"]] == [BATCH, BATCH]
    assert rank["communication_measured"] is False
    assert json.loads((tmp_path / "parallelism_monitor.json").read_text()) == monitor.summary
    assert (tmp_path / "parallelism_monitor.png").exists()
