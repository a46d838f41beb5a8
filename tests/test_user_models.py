"""A user's own model, not our demo GPT: every strategy trains it like one device, and the planner predicts it.

The model is the kind people write first: an MLP whose repeated blocks sit in a top-level ``nn.ModuleList`` of
``nn.Sequential`` (ZeRO-3 used to hand that ``ModuleList`` to ``fully_shard``, which refuses containers), a
classification loss on ``(x, y)`` batches, SGD with momentum, and a ``pipeline_layers()`` method.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from model_zoo import through
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from training_helpers import assert_monitor_equals_plan, assert_weights_close, cpu_trainer

from lightning_parallel import ParallelismMonitor, plan

WIDTH, DEPTH, FEATURES, CLASSES = 48, 4, 16, 5
GLOBAL_BATCH, STEPS = 16, 3


class BlockMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, CLASSES)
        self.example_input_array = torch.zeros(GLOBAL_BATCH, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return through(self.pipeline_layers(), x)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.inp, *self.blocks, self.out]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(GLOBAL_BATCH * STEPS, FEATURES, generator=generator)
    return TensorDataset(x, torch.randint(0, CLASSES, (GLOBAL_BATCH * STEPS,), generator=generator))


def _loader(replicas: int, replica: int) -> DataLoader:
    """Step k's global batch is samples [k*B, (k+1)*B); replica r takes its r-th contiguous slice of it."""
    per_replica = GLOBAL_BATCH // replicas
    indices = [k * GLOBAL_BATCH + replica * per_replica + i for k in range(STEPS) for i in range(per_replica)]
    return DataLoader(Subset(_dataset(), indices), batch_size=per_replica, shuffle=False)


def _trainer(strategy, devices: int, **kwargs) -> pl.Trainer:
    return cpu_trainer(devices=devices, strategy=strategy, max_steps=STEPS, use_distributed_sampler=False, **kwargs)


@cache
def _single_device() -> dict:
    pl.seed_everything(0, verbose=False)
    module = BlockMLP()
    _trainer("auto", 1).fit(module, _loader(1, 0))
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _fit(rank: int, world_size: int, strategy: str) -> dict:
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(strategy, world_size)
    replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"]
    replica = trainer.strategy.distributed_sampler_kwargs["rank"]
    trainer.fit(BlockMLP(), _loader(replicas, replica))
    state = trainer.strategy.lightning_module_state_dict()  # consolidated on rank 0 (a collective: all ranks call it)
    return {name: tensor.detach().clone() for name, tensor in state.items()}


@pytest.mark.parametrize("strategy", ["data_parallel", "zero1", "zero2", "zero3", "pipeline", "pipeline_gpipe"])
def test_a_user_model_trains_like_one_device_under_every_strategy(strategy):
    results = run_distributed(_fit, 2, args=(strategy,), init_process_group=False, timeout=180)
    assert_weights_close(results[0], _single_device(), rtol=1e-5, atol=1e-6)


def _monitored(rank: int, world_size: int, strategy: str, summary: str) -> None:
    pl.seed_everything(0, verbose=False)
    monitor = ParallelismMonitor(figure_path=False, summary_path=summary)
    trainer = _trainer(strategy, world_size, callbacks=[monitor])
    replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"]
    trainer.fit(BlockMLP(), _loader(replicas, trainer.strategy.distributed_sampler_kwargs["rank"]))


@pytest.mark.parametrize(
    ("strategy", "configuration"),
    [("data_parallel", "data_parallel"), ("zero2", "zero2"), ("zero3", "zero3"), ("pipeline", "pipeline pp=2, dp=1")],
)
def test_the_planner_predicts_what_the_monitor_measures_for_a_user_model(strategy, configuration, tmp_path):
    summary = str(tmp_path / "summary.json")
    run_distributed(_monitored, 2, args=(strategy, summary), init_process_group=False, timeout=180)
    measured = json.loads(Path(summary).read_text())["ranks"]
    replicas = 1 if strategy == "pipeline" else 2
    planned = plan(
        BlockMLP(),
        world_size=2,
        batch_size=GLOBAL_BATCH // replicas,
        optimizer="sgd_momentum",
        num_microbatches=2,
        process_group_backend="gloo",  # measured on gloo, where ZeRO-1/2 all-reduce their buckets
    ).configuration(configuration)
    assert planned.communication_complete  # the model's example_input_array gives the stage boundaries
    # Under the pipeline the first rank's batch (fp32 x of FEATURES, int64 y) goes to the other rank too.
    batch = GLOBAL_BATCH * (FEATURES * 4 + 8) if strategy == "pipeline" else None
    assert_monitor_equals_plan(measured, planned.ranks, batch_broadcast=batch)
