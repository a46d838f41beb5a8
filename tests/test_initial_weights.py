"""Every strategy starts every rank from rank 0's weights, so a script without a common seed trains one model.

Under the re-launching start method (scripts, torchrun, SLURM, mpirun) each rank builds its own module; a model
built without ``seed_everything`` (or with weights loaded on rank 0 only) has different weights on every rank. A
strategy that trains from a mix of them trains a model that exists nowhere. Each rank here builds
``RankSeededModel(rank)`` from a seed of its own; the result must equal one device trained from
``RankSeededModel(0)``, and every rank must hold the same model afterwards.
"""

from __future__ import annotations

import pytest
import torch
from distributed_harness import run_distributed
from model_zoo import RankSeededModel, loader, single_device, trainer
from training_helpers import assert_weights_close

STRATEGIES = ("data_parallel", "zero1", "zero2", "zero3", "pipeline")


def _fit_rank_seeded(rank: int, world_size: int, strategy: str) -> dict[str, torch.Tensor]:
    fit_trainer = trainer(strategy, world_size)
    sampler = fit_trainer.strategy.distributed_sampler_kwargs
    module = RankSeededModel(rank)  # no common seed: each rank draws other initial weights
    fit_trainer.fit(module, loader(sampler["num_replicas"], sampler["rank"]))
    state = fit_trainer.strategy.lightning_module_state_dict()  # consolidated on rank 0 (a collective)
    return {name: tensor.detach().clone() for name, tensor in state.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ranks_with_different_initial_weights_train_rank_zeros_model(strategy: str) -> None:
    results = run_distributed(_fit_rank_seeded, 2, args=(strategy,), init_process_group=False, timeout=180)
    expected = single_device(lambda: RankSeededModel(0))
    assert_weights_close(results[0], expected, rtol=1e-5, atol=1e-6)
