"""Small training runs shared by the integration tests: one tiny GPT, seeded data, real Trainers."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset

SEQ_LEN = 16
SEED = 1234


def make_module(optimizer: str = "adamw", learning_rate: float | None = None) -> GPTLightningModule:
    """The tiny GPT without biases (a key bias has an exactly-zero gradient, which Adam turns into noise-sized
    steps of size ~lr, so its value depends on rounding alone)."""
    pl.seed_everything(SEED, verbose=False)
    if learning_rate is None:
        learning_rate = {"adamw": 1e-3, "sgd": 1e-1}[optimizer]
    return GPTLightningModule("tiny", block_size=SEQ_LEN, bias=False, optimizer=optimizer, learning_rate=learning_rate)


# What a test's Trainer leaves out: it writes no logs, checkpoints, progress bar or model summary.
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def cpu_trainer(**options: Any) -> pl.Trainer:
    """A quiet (:data:`QUIET`) CPU Trainer; ``options`` add to these settings or replace them."""
    return pl.Trainer(**{"accelerator": "cpu", **QUIET, **options})


def make_trainer(strategy: Any, *, devices: int, max_steps: int, accumulate: int = 1, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "devices": devices,
        "strategy": strategy,
        "max_steps": max_steps,
        "accumulate_grad_batches": accumulate,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    return cpu_trainer(**{**options, **kwargs})


def strategy_of(
    spec: str, *, timeout: float
) -> DataParallelStrategy | PipelineParallelStrategy | ShardedOptimizerStrategy:
    """The strategy named ``spec`` (``"data_parallel"``, ``"pipeline"`` with two micro-batches, ``"zero1"`` to
    ``"zero3"``), its process groups timing out after ``timeout`` seconds."""
    if spec == "data_parallel":
        return DataParallelStrategy(timeout=timeout)
    if spec == "pipeline":
        return PipelineParallelStrategy(num_microbatches=2, timeout=timeout)
    return ShardedOptimizerStrategy(stage=int(spec[-1]), timeout=timeout)


def fit_tiny(
    strategy: Any,
    *,
    devices: int,
    per_device_batch: int,
    max_steps: int = 3,
    accumulate: int = 1,
    optimizer: str = "adamw",
    **trainer_kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Fit the tiny GPT on seeded tokens and return the weights.

    With several devices Lightning inserts its ``DistributedSampler(shuffle=True, seed=SEED)``, so rank r takes
    ``perm[r::N]`` of one global permutation. At ``devices=1`` the same permutation is used explicitly, so global
    batch k of the single-device run (batch ``N * b``) holds exactly the samples of step k on the N ranks.
    """
    module = make_module(optimizer)
    loader = _loader_for(devices, per_device_batch)
    trainer = make_trainer(strategy, devices=devices, max_steps=max_steps, accumulate=accumulate, **trainer_kwargs)
    trainer.fit(module, train_dataloaders=loader)
    # Lightning's fork/spawn launchers bring weights back to the parent but not the loop counters.
    assert trainer.global_step == max_steps or trainer.strategy.launcher.is_interactive_compatible
    # The strategy's own (consolidated) state dict: plain tensors even where the module holds shards (ZeRO-3);
    # rank 0 holds all of it.
    state = module.state_dict() if devices == 1 or trainer.strategy.launcher.is_interactive_compatible else None
    if state is None:
        state = trainer.strategy.lightning_module_state_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def refusal_before_the_process_group(fit: Any) -> str:
    """``fit()``'s ``ValueError`` message, asserting it was raised before any process group was built."""
    import torch.distributed as dist

    try:
        fit()
    except ValueError as error:
        assert not dist.is_initialized()
        return str(error)
    raise AssertionError("not refused")


def _loader_for(devices: int, per_device_batch: int) -> DataLoader:
    """96 seeded samples; at one device the permutation Lightning's DistributedSampler uses, made explicit."""
    dataset = RandomTokenDataset(96, SEQ_LEN, seed=7)
    if devices == 1:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        return DataLoader(dataset, batch_size=per_device_batch, sampler=sampler)
    return DataLoader(dataset, batch_size=per_device_batch, shuffle=False)


def assert_weights_close(actual: dict, expected: dict, *, rtol: float, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def assert_checkpoint_is_single_devices(saved: dict, single: dict, *, rtol: float, atol: float) -> None:
    """A consolidated checkpoint holds what single-device Lightning saves: the same keys in the same order, the same
    weights, and the optimizer state in the single-device layout (param groups, state per parameter index)."""
    assert list(saved["state_dict"]) == list(single["state_dict"])
    assert_weights_close(saved["state_dict"], single["state_dict"], rtol=rtol, atol=atol)
    (optimizer,), (expected,) = saved["optimizer_states"], single["optimizer_states"]
    assert optimizer["param_groups"] == expected["param_groups"]
    assert optimizer["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(optimizer["state"][index][key], value, rtol=rtol, atol=atol)


def assert_monitor_equals_plan(
    measured_ranks: list[dict], predicted_ranks: list[Any], *, batch_broadcast: int | None = None
) -> None:
    """Every rank's bytes held (from a ``ParallelismMonitor`` summary) and last step's communication equal the
    planner's ``RankEstimate`` for that rank, to the byte. ``batch_broadcast``: under the pipeline, the bytes of the
    batch its first rank sends to the others (``"broadcast"``), which the planner does not predict (it depends on the
    loader's batch, not on the model)."""
    assert len(measured_ranks) == len(predicted_ranks)
    for measured, expected in zip(measured_ranks, predicted_ranks, strict=True):
        assert measured["memory"] == {
            "parameters": expected.parameters,
            "gradients": expected.gradients,
            "optimizer_state": expected.optimizer_state,
        }, f"rank {measured['rank']}"
        # The last step: the first may carry torch's one-off pipeline set-up messages, which are not counted.
        measured_comm = dict(measured["steps"][-1]["communication"])
        assert measured_comm.pop("broadcast", None) == batch_broadcast, f"rank {measured['rank']}"
        assert measured_comm == expected.communication, f"rank {measured['rank']}: {measured_comm}"
