"""One ZeRO-1/2 bucket layout (``distributed/zero/layout.py``) for the buckets and the planner: a model with a bf16
layer between fp32 ones gets a bucket per dtype run, and the planner's bytes per rank and per step EQUAL what
ParallelismMonitor measures for it (the planner's former copy of the layout put all three layers in one fp32
bucket)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training_helpers import assert_monitor_equals_plan, make_trainer

from lightning_parallel import ShardedOptimizerStrategy
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.layout import STAGE2_MIN_BUCKETS, BucketMember, bucket_layout, min_buckets
from lightning_parallel.monitor import ParallelismMonitor
from lightning_parallel.planner import plan
from lightning_parallel.planner.estimate import planned_buckets
from lightning_parallel.planner.spec import model_spec

STAGES = (1, 2)
STEPS = 2


class MixedDtypes(pl.LightningModule):
    """fp32, bf16, fp32 layers of 35, 40 and 18 elements: odd or not a multiple of 4, so buckets pad differently
    when they are split by dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 7)
        self.b = nn.Linear(7, 5).to(torch.bfloat16)
        self.c = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.b(torch.tanh(self.a(x)).to(torch.bfloat16)).float()
        return self.c(hidden)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def test_a_bucket_per_dtype_run_and_the_cap() -> None:
    members = [BucketMember(10, 4, "fp32"), BucketMember(10, 4, "fp32"), BucketMember(4, 2, "bf16")]
    members += [BucketMember(100, 4, "fp32"), BucketMember(1, 4, "fp32")]
    assert bucket_layout(members, bucket_cap_mb=1) == [[0, 1], [2], [3, 4]]
    # A cap of 80 bytes: 10 + 10 fp32 elements fill it; a member over the cap gets its own bucket.
    assert bucket_layout(members, bucket_cap_mb=80 / 2**20) == [[0, 1], [2], [3], [4]]
    assert bucket_layout([], bucket_cap_mb=1) == []


def _built_buckets(rank: int, world_size: int) -> dict[int, list[tuple[int, torch.dtype]]]:
    built = {}
    for stage in STAGES:
        buckets = ShardedParameterBuckets(MixedDtypes(), stage=stage)
        built[stage] = [(sum(s.numel for s in b.segments), b.flat_params.dtype) for b in buckets.buckets]
    return built


def test_planner_buckets_are_the_built_ones() -> None:
    (built,) = run_distributed(_built_buckets, world_size=1)
    assert built[1] == [(18, torch.float32), (40, torch.bfloat16), (35, torch.float32)]
    # Stage 2: at most a thirty-second of the model's bytes per bucket (292 B -> 10 B), so every parameter alone.
    assert len(built[2]) == sum(1 for p in MixedDtypes().parameters())
    sizes = {torch.float32: 4, torch.bfloat16: 2}
    for stage in STAGES:
        planned = planned_buckets(model_spec(MixedDtypes()), element_bytes=4, bucket_cap_mb=25.0, stage=stage)
        expected = [(numel, sizes[dtype]) for numel, dtype in built[stage]]
        assert [(b.numel, b.element_size) for b in planned] == expected


def test_stage2_splits_a_model_under_the_cap_into_thirty_two_buckets() -> None:
    members = [BucketMember(100, 4, "fp32")] * 64  # 25,600 B, far under a 25 MiB cap
    assert len(bucket_layout(members, bucket_cap_mb=25.0, min_buckets=min_buckets(1))) == 1
    stage2 = bucket_layout(members, bucket_cap_mb=25.0, min_buckets=min_buckets(2))
    assert len(stage2) == STAGE2_MIN_BUCKETS == 32
    assert [len(bucket) for bucket in stage2] == [2] * 32
    # Over 32 x the cap the cap decides, as before.
    big = [BucketMember(2**20, 4, "fp32")] * 80  # 320 MiB of 4 MiB parameters under an 8 MiB cap
    assert bucket_layout(big, bucket_cap_mb=8.0, min_buckets=min_buckets(2)) == bucket_layout(big, bucket_cap_mb=8.0)


def _measure(rank: int, world_size: int, devices: int) -> dict[int, dict]:
    """In an isolated process: fit ZeRO-1 and ZeRO-2 with the monitor on `devices` fork-launched ranks."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    summaries = {}
    for stage in STAGES:
        with tempfile.TemporaryDirectory() as tmp:
            monitor = ParallelismMonitor(summary_path=Path(tmp, "summary.json"), figure_path=False)
            strategy = ShardedOptimizerStrategy(stage=stage, start_method="fork")
            trainer = make_trainer(strategy, devices=devices, max_steps=STEPS, callbacks=[monitor])
            data = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)))
            trainer.fit(MixedDtypes(), train_dataloaders=DataLoader(data, batch_size=4))
            summaries[stage] = json.loads(Path(tmp, "summary.json").read_text())
    return summaries


@pytest.fixture(scope="module")
def measured() -> dict[int, dict]:
    (summaries,) = run_distributed(
        _measure, world_size=1, args=(2,), init_process_group=False, launcher_env=False, timeout=180
    )
    return summaries


@pytest.mark.parametrize("stage", STAGES)
def test_planner_equals_monitor_with_mixed_dtypes(measured: dict[int, dict], stage: int) -> None:
    predicted = plan(MixedDtypes(), world_size=2, batch_size=4, seq_len=1, process_group_backend="gloo")
    predicted_ranks = predicted.configuration(f"zero{stage}").ranks
    summary = measured[stage]
    assert len(summary["ranks"]) == 2 == len(predicted_ranks)
    assert_monitor_equals_plan(summary["ranks"], predicted_ranks)
