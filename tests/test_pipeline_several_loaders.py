"""Several training loaders under the pipeline: Lightning combines a dict of them into one batch per step, and the
pipeline learns the model's input from that combined batch (it took the first loader's batch alone before). A step
whose input rows are the batch's rows trains as one device; one whose rows are not is refused before any step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from torch.utils.data import DataLoader, DistributedSampler
from training_helpers import SEED, SEQ_LEN, assert_weights_close, make_trainer

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)


class TwoLoaderGPT(GPTLightningModule):
    """A step over a dict of two training loaders: each row is sample i of loader "a" followed by sample i of loader
    "b" along the sequence (``dim=1``, a row-wise input), or the two batches stacked (``dim=0``)."""

    def __init__(self, dim: int) -> None:
        super().__init__("tiny", n_layer=2, block_size=2 * SEQ_LEN, bias=False, optimizer="sgd", learning_rate=1e-1)
        self.dim = dim

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        (xa, ya), (xb, yb) = batch["a"], batch["b"]
        return super().training_step((torch.cat([xa, xb], self.dim), torch.cat([ya, yb], self.dim)), batch_idx)


def _fit_two_loaders(rank: int, world_size: int, dim: int) -> dict[str, Any]:
    pl.seed_everything(SEED, verbose=False)
    module = TwoLoaderGPT(dim)
    loaders = {}
    for key, samples, seed in (("a", 48, 7), ("b", 32, 8)):  # "b" is cycled (Lightning's `max_size_cycle`)
        dataset = RandomTokenDataset(samples, SEQ_LEN, seed=seed)
        # One device: the shuffling sampler Lightning gives each distributed loader, with one replica.
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=SEED) if world_size == 1 else None
        loaders[key] = DataLoader(dataset, batch_size=8, sampler=sampler)
    strategy = "auto" if world_size == 1 else PipelineParallelStrategy(num_microbatches=2, timeout=60)
    losses = _LoggedLosses()
    trainer = make_trainer(strategy, devices=world_size, max_epochs=1, max_steps=-1, callbacks=[losses])
    try:
        trainer.fit(module, train_dataloaders=loaders)
    except ValueError as error:
        return {"error": str(error), "steps": trainer.global_step}
    state = module.state_dict() if world_size == 1 else trainer.strategy.lightning_module_state_dict()
    state = {k: v.detach().clone() for k, v in state.items()}
    return {"state": state, "steps": trainer.global_step, "losses": losses.values}


class _LoggedLosses(pl.Callback):
    """What reaches the logger: ``train_loss`` after every step."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.values.append(float(trainer.callback_metrics["train_loss"]))


def test_a_dict_of_training_loaders_trains_as_one_device_or_is_refused_where_rows_cannot_be_cut():
    """Lightning combines a dict of training loaders into one batch ``{"a": ..., "b": ...}``: the pipeline learns the
    model's input from that combined batch (it used to take the first loader's batch alone: a `TypeError` in the
    user's step). A step whose input rows are the batch's rows trains as one device; one that stacks the two batches
    (16 input rows from batches of 8) is refused on every rank before the first step, naming the tensor."""
    (reference,) = run_distributed(_fit_two_loaders, 1, args=(1,), init_process_group=False, timeout=120)
    assert reference["steps"] == 6
    results = run_distributed(_fit_two_loaders, 2, args=(1,), init_process_group=False, timeout=120)
    assert [result["steps"] for result in results] == [6, 6]
    assert_weights_close(results[0]["state"], reference["state"], rtol=1e-5, atol=1e-6)  # consolidated on rank 0
    for result in results:  # the logged loss of every step, on every rank, as one device logs it
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    for result in run_distributed(_fit_two_loaders, 2, args=(0,), init_process_group=False, timeout=120):
        assert result["steps"] == 0
        assert "`training_step`'s `batch['a'][0]` has 8 rows along dim 0" in result["error"]
        assert "has 16" in result["error"]
