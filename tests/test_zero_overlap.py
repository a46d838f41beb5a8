"""ZeRO-1/2 overlap the parameter all-gather after the step with the next forward (``overlap_param_gather``).

* Equivalence: a transformer of ``nn.TransformerEncoderLayer`` blocks (whose attention reads ``out_proj.weight``
  without calling ``out_proj``) trains under zero1/zero2 with the overlap exactly as on one device, with the
  all-gathers really still pending between steps.
* Layout: each block waits for every bucket holding a parameter of the whole block (``out_proj`` included), the
  other buckets are waited for before the training step, and buckets are launched in the order they are needed.
* ``"auto"`` keeps the overlap off where a hook may read parameters between two steps (an EMA callback, a module's
  ``on_train_batch_start``, manual optimization), and on for Lightning's own default callbacks.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import (
    Callback,
    EMAWeightAveraging,
    ModelCheckpoint,
    ModelSummary,
    TQDMProgressBar,
)
from model_zoo import FreezeScheduleModel, TwoOptimizerGAN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training_helpers import make_module

from lightning_parallel import ParallelismMonitor, ShardedOptimizerStrategy
from lightning_parallel.distributed.zero import ShardedParameterBuckets
from lightning_parallel.distributed.zero_gather import OverlappedParameterGather
from lightning_parallel.strategies.param_gather import parameter_readers_between_steps

STEPS = 4
GLOBAL_BATCH = 8


class EncoderModel(pl.LightningModule):
    """Embedding -> 3 ``nn.TransformerEncoderLayer`` -> norm -> head, AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(
            # No biases: attention's key bias has an exactly-zero gradient that Adam turns into rounding-sized steps.
            nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True, bias=False)
            for _ in range(3)
        )
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h)).mean(dim=(1, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class _PendingProbe(Callback):
    """Records, between two steps, whether all-gathers are still pending (it reads no parameter values)."""

    reads_parameters = False

    def __init__(self) -> None:
        self.pending: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        gather = trainer.strategy.backend.gather
        self.pending.append(gather is not None and gather.is_pending)


def _data(world_size: int, rank: int) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * GLOBAL_BATCH, 5, 8, generator=generator)
    y = torch.randn(STEPS * GLOBAL_BATCH, generator=generator)
    per_rank = GLOBAL_BATCH // world_size
    # Step k of rank r takes samples [k*B + r*b, k*B + (r+1)*b): the one-device batch k is their union.
    index = torch.cat(
        [
            torch.arange(k * GLOBAL_BATCH + rank * per_rank, k * GLOBAL_BATCH + (rank + 1) * per_rank)
            for k in range(STEPS)
        ]
    )
    return DataLoader(TensorDataset(x[index], y[index]), batch_size=per_rank, shuffle=False)


def _fit(strategy: Any, world_size: int, rank: int, callbacks: list[Callback]) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    module = EncoderModel()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # `_data` gives each rank its own slice of every global batch
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=_data(world_size, rank))
    state = module.state_dict() if world_size == 1 else trainer.strategy.lightning_module_state_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def _overlapped_ranks(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for stage in (1, 2):
        probe = _PendingProbe()
        strategy = ShardedOptimizerStrategy(stage=stage, bucket_cap_mb=0.004)  # ~1 KiB-parameter buckets: many
        results[f"zero{stage}"] = _fit(strategy, world_size, rank, [probe])
        results[f"zero{stage}_pending"] = probe.pending
    return results


def _single_device(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    return _fit("auto", 1, 0, [])


def test_overlapped_gather_trains_like_one_device_with_gathers_pending_between_steps() -> None:
    (reference,) = run_distributed(_single_device, 1, init_process_group=False, timeout=120)
    for result in run_distributed(_overlapped_ranks, 2, init_process_group=False, timeout=240):
        for stage in ("zero1", "zero2"):
            assert result[f"{stage}_pending"] == [True] * STEPS, result[f"{stage}_pending"]
            for name, expected in reference.items():
                torch.testing.assert_close(result[stage][name], expected, rtol=1e-5, atol=1e-6, msg=f"{stage} {name}")


def _layout(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = EncoderModel()
    buckets = ShardedParameterBuckets(module, stage=1, bucket_cap_mb=0.004)
    gather = OverlappedParameterGather(buckets, module)
    bucket_of = {id(s.param): i for i, b in enumerate(buckets.buckets) for s in b.segments}
    gather.launch(range(len(buckets.buckets)))
    pending = gather.is_pending
    gather.wait_all()
    return {
        "num_buckets": len(buckets.buckets),
        "block_buckets": gather.block_buckets,
        "rest": gather.rest,
        "launch_order": gather.launch_order,
        "out_proj": [bucket_of[id(layer.self_attn.out_proj.weight)] for layer in module.layers],
        "block_params": [sorted({bucket_of[id(p)] for p in layer.parameters()}) for layer in module.layers],
        "outside": sorted({bucket_of[id(p)] for m in (module.embed, module.norm, module.head) for p in m.parameters()}),
        "pending_after_launch": pending,
        "pending_after_wait": gather.is_pending,
    }


def test_each_block_waits_for_the_buckets_of_all_its_parameters_and_the_rest_before_the_step() -> None:
    for layout in run_distributed(_layout, 2, timeout=60):
        assert layout["num_buckets"] > 6  # small buckets: the blocks need different ones
        assert layout["block_buckets"] == layout["block_params"]
        for out_proj, needed in zip(layout["out_proj"], layout["block_buckets"], strict=True):
            assert out_proj in needed  # read by attention without calling `out_proj`
        assert layout["rest"] == layout["outside"]
        order = layout["launch_order"]
        assert sorted(order) == list(range(layout["num_buckets"]))
        assert order[: len(layout["rest"])] == sorted(layout["rest"], reverse=True)  # needed first
        first_use = [
            min(i for i, needed in enumerate(layout["block_buckets"]) if b in needed)
            for b in order[len(layout["rest"]) :]
        ]
        assert first_use == sorted(first_use)  # then block by block, in forward order
        assert layout["pending_after_launch"] and not layout["pending_after_wait"]


class _ReadsOnBatchEnd(Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        pass


class _DeclaredHarmless(_ReadsOnBatchEnd):
    reads_parameters = False


# Modules are built in the test, not at collection: `make_module` seeds through Lightning, which sets
# `PL_GLOBAL_SEED` in this process's environment, where subprocesses of later tests would inherit it.
@pytest.mark.parametrize(
    ("make", "callbacks", "readers"),
    [
        (make_module, [ModelCheckpoint(), TQDMProgressBar(), ModelSummary(), ParallelismMonitor()], []),
        (make_module, [EMAWeightAveraging()], ["EMAWeightAveraging.on_train_batch_end"]),
        (make_module, [_ReadsOnBatchEnd()], ["_ReadsOnBatchEnd.on_train_batch_end"]),
        (make_module, [_DeclaredHarmless()], []),
        (FreezeScheduleModel, [], ["FreezeScheduleModel.on_train_batch_start"]),
        (TwoOptimizerGAN, [], ["manual optimization (`automatic_optimization=False`)"]),
    ],
    ids=["lightning-defaults", "ema", "user-callback", "declared-harmless", "module-hook", "manual"],
)
def test_auto_overlaps_only_when_no_hook_may_read_parameters_between_steps(make, callbacks, readers, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # restored after the test, whatever `make` sets
    found = parameter_readers_between_steps(make(), callbacks)
    assert all(reader in found for reader in readers), found  # named (EMA also reads in its epoch hooks)
    assert bool(found) == bool(readers)


def test_bad_overlap_value_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`overlap_param_gather='yes'` is invalid\. Valid options: 'auto'"):
        ShardedOptimizerStrategy(overlap_param_gather="yes")  # type: ignore[arg-type]
