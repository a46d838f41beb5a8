"""Shared helpers of the pipeline tests: fit the tiny GPT under PipelineParallelStrategy in forked ranks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from distributed_harness import run_distributed
from torch.utils.data import DataLoader, DistributedSampler
from training_helpers import SEED, SEQ_LEN, make_module, make_trainer

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset

NUM_SAMPLES = 96


def tiny_module(optimizer: str = "sgd", n_layer: int = 2) -> GPTLightningModule:
    """The tiny GPT of ``training_helpers.make_module``, optionally deeper (more layers to split)."""
    if n_layer == 2:
        return make_module(optimizer)
    pl.seed_everything(SEED, verbose=False)
    lr = {"adamw": 1e-3, "sgd": 1e-1}[optimizer]
    return GPTLightningModule(
        "tiny", n_layer=n_layer, block_size=SEQ_LEN, bias=False, optimizer=optimizer, learning_rate=lr
    )


def train_loader(batch_size: int, *, single_device: bool) -> DataLoader:
    dataset = RandomTokenDataset(NUM_SAMPLES, SEQ_LEN, seed=7)
    if single_device:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def fit_reference(**kwargs: Any) -> tuple[dict[str, torch.Tensor], list[float]]:
    """:func:`fit_reference_here` in a forked process, so the pytest process never initialises CUDA (Lightning's
    RNG isolation touches it when a GPU is visible) and forked ranks can still use it."""
    (result,) = run_distributed(_reference_rank, 1, args=(kwargs,), init_process_group=False, timeout=120)
    return result


def _reference_rank(rank: int, world_size: int, kwargs: dict[str, Any]) -> Any:
    return fit_reference_here(**kwargs)


def fit_reference_here(
    *, batch_size: int, steps: int, optimizer: str = "sgd", n_layer: int = 2, **trainer_kwargs: Any
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-device run in this process: weights and the logged train losses of every step."""
    module = tiny_module(optimizer, n_layer)
    losses = LossRecorder()
    trainer = make_trainer("auto", devices=1, max_steps=steps, callbacks=[losses], **trainer_kwargs)
    trainer.fit(module, train_dataloaders=train_loader(batch_size, single_device=True))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, losses.values


class LossRecorder(pl.Callback):
    """Records ``train_loss`` from ``trainer.callback_metrics`` after every batch."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["train_loss"]))


def fit_pipeline(
    rank: int,
    world_size: int,
    strategy_kwargs: dict,
    batch_size: int,
    steps: int,
    optimizer: str = "sgd",
    n_layer: int = 2,
    trainer_kwargs: dict | None = None,
) -> dict:
    """Inside a forked rank: fit under the pipeline strategy; return consolidated weights (rank 0) and losses."""
    module = tiny_module(optimizer, n_layer)
    strategy = PipelineParallelStrategy(timeout=60, **strategy_kwargs)
    losses = LossRecorder()
    trainer = make_trainer(strategy, devices=world_size, max_steps=steps, callbacks=[losses], **(trainer_kwargs or {}))
    stage = StageRecorder()
    trainer.callbacks.append(stage)
    trainer.fit(module, train_dataloaders=train_loader(batch_size, single_device=False))
    weights = strategy.lightning_module_state_dict()
    return {"weights": weights, "losses": losses.values, **stage.values, "starts": strategy.stage_plan.starts}


class StageRecorder(pl.Callback):
    """What this rank's module holds at the end of training, while it is split (teardown makes it whole again)."""

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer_bytes = sum(
            v.numel() * v.element_size()
            for s in trainer.optimizers[0].state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        self.values = {
            "local_keys": sorted(pl_module.state_dict()),
            "param_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters()),
            "optimizer_bytes": optimizer_bytes,
        }
