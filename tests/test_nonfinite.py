"""A NaN loss on one rank leads to the same decision on every rank: skip the step, or stop; never divergence."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import DistributedTestError, run_distributed
from torch.utils.data import DataLoader
from training_helpers import SEQ_LEN, assert_weights_close, make_module, make_trainer

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import RandomTokenDataset

NAN_RANK, NAN_BATCH = 1, 1


def _nan_on_one_rank(module, rank: int):
    original = module.training_step

    def training_step(batch, batch_idx):
        loss = original(batch, batch_idx)
        return loss * float("nan") if (rank == NAN_RANK and batch_idx == NAN_BATCH) else loss

    module.training_step = training_step
    return module


def _strategy(spec: str, policy: str):
    if spec == "data_parallel":
        return DataParallelStrategy(nonfinite_loss=policy)
    return ShardedOptimizerStrategy(stage=int(spec[-1]), nonfinite_loss=policy)


def _train(rank: int, world_size: int, spec: str, policy: str) -> dict:
    module = _nan_on_one_rank(make_module("sgd"), rank)
    loader = DataLoader(RandomTokenDataset(16, SEQ_LEN, seed=rank), batch_size=2)
    trainer = make_trainer(_strategy(spec, policy), devices=world_size, max_steps=4)
    try:
        trainer.fit(module, train_dataloaders=loader)
    except FloatingPointError as error:
        raise RuntimeError(f"rank {rank} stopped: {error}") from error
    weights = trainer.strategy.lightning_module_state_dict() if spec == "zero3" else module.state_dict()
    return {"weights": {k: v.clone() for k, v in weights.items()}, "global_step": trainer.global_step}


@pytest.mark.parametrize("spec", ["data_parallel", "zero2", "zero3"])
def test_skip_drops_the_step_on_every_rank_and_training_goes_on(spec):
    rank0, rank1 = run_distributed(_train, 2, args=(spec, "skip"), init_process_group=False, timeout=120)
    assert rank0["global_step"] == rank1["global_step"] == 4
    assert all(torch.isfinite(t).all() for t in rank0["weights"].values())
    if spec != "zero3":  # zero3's consolidated state dict is complete on rank 0 only
        assert_weights_close(rank1["weights"], rank0["weights"], rtol=0, atol=0)


@pytest.mark.parametrize("spec", ["data_parallel", "zero2"])
def test_stop_raises_on_every_rank(spec):
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_train, 2, args=(spec, "stop"), init_process_group=False, timeout=60)
    text = str(error.value)
    assert "did not finish" not in text
    assert "rank 1 stopped: The training loss at step 1 is NaN or infinite on this rank" in text
    assert "rank 0 stopped: The training loss at step 1 is NaN or infinite on another rank" in text


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match=r"`nonfinite_loss='retry'` is invalid\. Valid options: 'skip'"):
        DataParallelStrategy(nonfinite_loss="retry")
