"""Integration tier: DataParallelStrategy inside real Lightning Trainers on 2 forked CPU ranks (gloo).

Ranks are started the way torchrun starts them (MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK in the
environment), so the strategy takes Lightning's "processes created externally" path; one test also goes through
Lightning's own fork launcher ("data_parallel_notebook").
"""

from __future__ import annotations

import pytest
import torch
from distributed_harness import DistributedTestError, run_distributed
from torch.utils.data import DataLoader
from training_helpers import SEQ_LEN, assert_weights_close, fit_tiny, make_module, make_trainer

from lightning_parallel import DataParallelStrategy
from lightning_parallel.demos import RandomTokenDataset

PER_DEVICE_BATCH = 4
STEPS = 3


def _fit_data_parallel(rank: int, world_size: int, accumulate: int, optimizer: str, strategy_kwargs: dict) -> dict:
    strategy = DataParallelStrategy(**strategy_kwargs)
    weights = fit_tiny(
        strategy,
        devices=world_size,
        per_device_batch=PER_DEVICE_BATCH,
        max_steps=STEPS,
        accumulate=accumulate,
        optimizer=optimizer,
    )
    stats = strategy.communication_stats
    return {"weights": weights, "bytes": stats.total_bytes}


def _single_device_reference(accumulate: int, optimizer: str, world_size: int = 2) -> dict:
    return fit_tiny(
        "auto",
        devices=1,
        per_device_batch=PER_DEVICE_BATCH * world_size,
        max_steps=STEPS,
        accumulate=accumulate,
        optimizer=optimizer,
    )


# SGD is held to fp32 rounding. Adam divides by sqrt(v), which turns rounding-level gradient differences on
# near-zero gradients into differences of a few ulp of the learning rate, hence its looser bound.
TOLERANCE = {"sgd": {"rtol": 1e-5, "atol": 1e-6}, "adamw": {"rtol": 1e-4, "atol": 1e-5}}


@pytest.mark.parametrize(("accumulate", "optimizer"), [(1, "sgd"), (2, "sgd"), (1, "adamw"), (2, "adamw")])
def test_two_ranks_match_single_device_on_the_same_global_batch(accumulate, optimizer):
    reference = _single_device_reference(accumulate, optimizer)
    rank0, rank1 = run_distributed(_fit_data_parallel, args=(accumulate, optimizer, {}), timeout=120)
    assert_weights_close(rank0["weights"], reference, **TOLERANCE[optimizer])
    assert_weights_close(rank1["weights"], rank0["weights"], rtol=0, atol=0)
    # The weights really moved: equality is not the trivial "nothing trained".
    untrained = make_module(optimizer).state_dict()
    assert not torch.equal(rank0["weights"]["model.head.weight"], untrained["model.head.weight"])


@pytest.mark.parametrize(("compression", "tolerance"), [("fp16", 2e-3), ("bf16", 2e-2)])
def test_compressed_gradients_stay_within_dtype_tolerance(compression, tolerance):
    reference = _single_device_reference(1, "sgd")
    exact = run_distributed(_fit_data_parallel, args=(1, "sgd", {"track_communication": True}), timeout=120)
    options = {"gradient_compression": compression}
    rank0, rank1 = run_distributed(_fit_data_parallel, args=(1, "sgd", options), timeout=120)
    assert_weights_close(rank0["weights"], reference, rtol=tolerance, atol=tolerance)
    assert_weights_close(rank1["weights"], rank0["weights"], rtol=0, atol=0)
    assert rank0["bytes"] * 2 == exact[0]["bytes"] > 0


def test_powersgd_trains_on_gloo_with_several_buckets():
    options = {"gradient_compression": "powersgd", "powersgd_start_iter": 2, "bucket_cap_mb": 0.05}
    rank0, rank1 = run_distributed(_fit_data_parallel, args=(1, "sgd", options), timeout=120)
    assert_weights_close(rank1["weights"], rank0["weights"], rtol=0, atol=0)
    assert all(torch.isfinite(tensor).all() for tensor in rank0["weights"].values())


def test_world_size_one_is_plain_single_device_training():
    reference = _single_device_reference(1, "adamw", world_size=1)
    (result,) = run_distributed(
        _fit_data_parallel, world_size=1, args=(1, "adamw", {"gradient_compression": "fp16"}), timeout=120
    )
    # No DDP wrapper, no compression, no padding at world size 1: the plain run up to fp32 rounding.
    assert_weights_close(result["weights"], reference, rtol=1e-6, atol=1e-7)
    assert result["bytes"] == 0


# ------------------------------------------------------------------ uneven inputs
UNEVEN_BATCHES = {0: 6, 1: 4}


def _uneven_loader(rank: int) -> DataLoader:
    dataset = RandomTokenDataset(UNEVEN_BATCHES[rank] * PER_DEVICE_BATCH, SEQ_LEN, seed=11 + rank)
    return DataLoader(dataset, batch_size=PER_DEVICE_BATCH, shuffle=False)


class _Infinite(torch.utils.data.IterableDataset):
    """A length-less dataset (no __len__): the case Lightning cannot plan for."""

    def __init__(self, rank: int) -> None:
        self.dataset = RandomTokenDataset(UNEVEN_BATCHES[rank] * PER_DEVICE_BATCH, SEQ_LEN, seed=11 + rank)

    def __iter__(self):
        return (self.dataset[index] for index in range(len(self.dataset)))


def _fit_uneven(rank: int, world_size: int, iterable: bool) -> dict:
    module = make_module("sgd", learning_rate=0.1)
    dataset = _Infinite(rank) if iterable else None
    loader = DataLoader(dataset, batch_size=PER_DEVICE_BATCH) if iterable else _uneven_loader(rank)
    trainer = make_trainer(
        DataParallelStrategy(timeout=60), devices=world_size, max_steps=-1, max_epochs=2, use_distributed_sampler=False
    )
    trainer.fit(module, train_dataloaders=loader)
    return {"weights": module.state_dict(), "global_step": trainer.global_step}


def _uneven_reference() -> dict:
    """Plain torch: ranks with data contribute their gradient, a rank that ran out contributes zero, / world size."""
    module = make_module("sgd", learning_rate=0.1)
    optimizer = module.configure_optimizers()
    loaders = {rank: list(_uneven_loader(rank)) for rank in UNEVEN_BATCHES}
    for _epoch in range(2):
        for step in range(max(UNEVEN_BATCHES.values())):
            optimizer.zero_grad()
            losses = [
                module.loss_fn(module(x), y)
                for rank, (x, y) in ((r, b[step]) for r, b in loaders.items() if step < len(b))
            ]
            (sum(losses) / len(UNEVEN_BATCHES)).backward()
            optimizer.step()
    return module.state_dict()


@pytest.mark.parametrize("iterable", [False, True], ids=["sized-loaders", "iterable-dataset"])
def test_uneven_inputs_finish_with_join_semantics(iterable):
    rank0, rank1 = run_distributed(_fit_uneven, args=(iterable,), timeout=120)
    assert rank0["global_step"] == rank1["global_step"] == 2 * max(UNEVEN_BATCHES.values())
    assert_weights_close(rank1["weights"], rank0["weights"], rtol=0, atol=0)
    assert_weights_close(rank0["weights"], _uneven_reference(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ launchers
def _fit_with_fork_launcher(rank: int, world_size: int) -> dict:
    return fit_tiny("data_parallel_notebook", devices=2, per_device_batch=PER_DEVICE_BATCH, max_steps=STEPS)


def test_fork_launcher_registry_name_trains_and_returns_weights_to_the_parent():
    reference = _single_device_reference(1, "adamw")
    (weights,) = run_distributed(
        _fit_with_fork_launcher, world_size=1, init_process_group=False, launcher_env=False, timeout=120
    )
    assert_weights_close(weights, reference, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start_method": "forkserver"}, "Unknown `start_method='forkserver'`. Valid options: 'popen'"),
        ({"gradient_compression": "int8"}, "Unknown `gradient_compression='int8'`. Valid options: None, 'fp16'"),
        ({"gradient_compression": "powersgd", "powersgd_rank": 0}, "`powersgd_rank=0` is invalid"),
        ({"uneven_inputs": "sometimes"}, "`uneven_inputs='sometimes'` is invalid. Valid options: 'auto'"),
        ({"bucket_cap_mb": 0}, "`bucket_cap_mb=0` must be a positive"),
        ({"timeout": -1}, "`timeout=-1` must be positive"),
    ],
)
def test_bad_arguments_raise_value_error_naming_value_and_options(kwargs, message):
    with pytest.raises(ValueError) as error:
        DataParallelStrategy(**kwargs)
    assert message in str(error.value)


def _fit_with_mismatched_environment(rank: int, world_size: int, devices: int, num_nodes: int) -> None:
    trainer = make_trainer(DataParallelStrategy(timeout=20), devices=devices, max_steps=1, num_nodes=num_nodes)
    try:
        trainer.fit(make_module())
    except ValueError as error:
        assert torch.distributed.is_initialized() is False, "the error must come before any collective"
        raise ValueError(f"rank {rank}: {error}") from error


@pytest.mark.parametrize(
    ("env", "devices", "num_nodes", "message"),
    [
        ({"WORLD_SIZE": "4"}, 2, 1, "WORLD_SIZE=4 processes, but the Trainer was given `devices=2` and `num_nodes=1`"),
        ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, 1, 1, "`devices=1`"),
        ({}, 2, 2, "(2 * 2 = 4)"),
    ],
    ids=["launcher-world-size", "torchrun-devices", "num-nodes"],
)
def test_devices_that_do_not_match_the_launcher_fail_fast_on_every_rank(env, devices, num_nodes, message):
    with pytest.raises(DistributedTestError) as error:
        run_distributed(
            _fit_with_mismatched_environment, args=(devices, num_nodes), init_process_group=False, env=env, timeout=60
        )
    text = str(error.value)
    assert "did not finish" not in text, "a rank hung instead of raising"
    for rank in (0, 1):
        assert f"ValueError: rank {rank}: " in text
    assert message in text


def test_registry_names_resolve_to_our_strategy_with_their_start_method():
    import lightning.pytorch as pl

    for name, start_method in [("data_parallel", "popen"), ("data_parallel_spawn", "spawn")]:
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, DataParallelStrategy)
        assert trainer.strategy.start_method == start_method
