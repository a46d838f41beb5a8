"""ZeRO-3 off the happy path, with user-like models (tests/model_zoo.py) against one-device Lightning.

One 2-rank run holds every case (each is a few steps of a tiny model): ranks that build different initial weights,
a freeze/unfreeze schedule, code that runs on rank 0 only after ``fit``, a callback that prunes parameters
(refused), and errors inside ``fit`` that must surface as themselves.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import ModelPruning
from model_zoo import (
    BatchNormCNN,
    FreezeScheduleModel,
    RankSeededModel,
    ResidualMLP,
    dataset,
    fit_in_rank,
    loader,
    single_device,
    trainer,
)
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import lightning_parallel  # noqa: F401  (registers "zero3")

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
WORLD_SIZE = 2
CALLBACKS = {  # weight averaging works under zero3 (tests/test_weight_averaging_sharded.py); pruning is refused
    "ModelPruning": lambda: ModelPruning("l1_unstructured", amount=0.1),
}


class _FailingModel(RankSeededModel):
    """Raises ``ValueError("boom")`` inside a sharded block's forward (its parameters gathered) in the second step."""

    def __init__(self) -> None:
        super().__init__(0)
        self.blocks[1].append(_RaiseOnSecondCall())


class _RaiseOnSecondCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise ValueError("boom")
        return x


def _probe() -> torch.Tensor:
    return dataset()[:3][0]


def _last_error(fit: Any) -> str:
    """The exception a user sees from ``fit()``: its type and message (a teardown error would replace it)."""
    try:
        fit()
    except Exception as error:  # the one that propagates, whichever it is
        return f"{type(error).__name__}: {error}"
    return "no error"


def _rank_seeded_then_rank_zero_only(rank: int, world_size: int, results: dict) -> None:
    fit_trainer = trainer("zero3", world_size)
    module = RankSeededModel(rank)  # each rank seeds its own weights, as a re-launched script without a seed
    fit_trainer.fit(module, loader(world_size, rank))
    results["rank_seeded"] = {k: v.clone() for k, v in fit_trainer.strategy.lightning_module_state_dict().items()}
    if rank == 0:  # rank 0 alone, outside the block: a clear error, raised before any collective
        results["outside"] = _last_error(lambda: module(_probe()))
    with fit_trainer.strategy.full_module():
        if rank == 0:
            with torch.no_grad():
                results["rank_zero_output"] = module(_probe()).clone()
                results["rank_zero_output_again"] = module(_probe()).clone()
                module.state_dict()  # reshards an FSDP2 module: a later call must say so instead of hanging
                results["after_state_dict"] = _last_error(lambda: module(_probe()))


def _refused_callbacks(rank: int, world_size: int) -> dict[str, str]:
    refused = {}
    for name, make in CALLBACKS.items():
        fit_trainer = trainer("zero3", world_size, callbacks=[make()], max_epochs=2, max_steps=-1)
        refused[name] = _last_error(lambda t=fit_trainer: t.fit(RankSeededModel(0), loader(world_size, rank)))
    return refused


class _ShardedAfterForward(pl.Callback):
    """Before each backward: which FSDP2 units hold plain (gathered) parameters instead of their sharded DTensors."""

    def __init__(self) -> None:
        self.gathered: list[list[str]] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        units = [(name, m) for name, m in pl_module.named_modules() if isinstance(m, FSDPModule)]

        def own(unit: nn.Module) -> list[nn.Parameter]:  # the unit's parameters, not those of units nested in it
            inside = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
            nested = {id(p) for m in inside for p in m.parameters()}
            return [p for p in unit.parameters() if id(p) not in nested]

        self.gathered.append([name for name, unit in units if any(not isinstance(p, DTensor) for p in own(unit))])


def _flat_model(rank: int, world_size: int) -> dict[str, Any]:
    """ResidualMLP: its blocks, input and output layers are direct children, so no unit is nested in another."""
    probe = _ShardedAfterForward()
    weights = fit_in_rank(ResidualMLP, "zero3", world_size, callbacks=[probe])
    return {"weights": weights, "gathered_before_backward": probe.gathered}


class _Net(nn.Module):
    """ResidualMLP's layers as a plain network, for a LightningModule that wraps it."""

    def __init__(self) -> None:
        super().__init__()
        layers = ResidualMLP()  # the same layers, drawn in the same order
        self.inp, self.blocks, self.out = layers.inp, layers.blocks, layers.out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class WrappedModel(pl.LightningModule):
    """A LightningModule that wraps its network (``self.model``), as most do, and validates after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Net()
        self.validated = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.validated += 1
        self.log("val_loss", nn.functional.cross_entropy(self.model(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _wrapped_model(rank: int, world_size: int) -> dict[str, Any]:
    """The wrapped network is the unit every block is nested in: it stays gathered from its forward to backward (as
    FSDP2's root would); the blocks reshard. Validation runs between steps (the network then stays gathered after a
    forward without backward until the next training step's backward reshards it)."""
    probe = _ShardedAfterForward()
    validation = {"val_check_interval": 1, "limit_val_batches": 2}
    fit_trainer = trainer("zero3", world_size, callbacks=[probe], **validation)
    pl.seed_everything(0, verbose=False)
    module = WrappedModel()
    fit_trainer.fit(module, loader(world_size, rank), loader(world_size, rank))
    weights = {k: v.detach().clone() for k, v in fit_trainer.strategy.lightning_module_state_dict().items()}
    return {"weights": weights, "gathered_before_backward": probe.gathered, "validated": module.validated}


def _in_ranks(rank: int, world_size: int) -> dict:
    results: dict[str, Any] = {}
    results["flat_model"] = _flat_model(rank, world_size)
    results["wrapped_model"] = _wrapped_model(rank, world_size)
    _rank_seeded_then_rank_zero_only(rank, world_size, results)
    results["freeze_schedule"] = fit_in_rank(FreezeScheduleModel, "zero3", world_size)
    results["callbacks"] = _refused_callbacks(rank, world_size)
    # Errors inside fit: what the user sees must be the error itself, not a teardown error after it.
    results["sync_batchnorm"] = _last_error(
        lambda: trainer("zero3", world_size, sync_batchnorm=True).fit(BatchNormCNN(), loader(world_size, rank))
    )
    results["boom"] = _last_error(lambda: trainer("zero3", world_size).fit(_FailingModel(), loader(world_size, rank)))
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_in_ranks, WORLD_SIZE, init_process_group=False, timeout=180)


def test_ranks_with_their_own_initial_weights_train_rank_zero_s_model(ranks):
    reference = single_device(lambda: RankSeededModel(0))
    torch.testing.assert_close(ranks[0]["rank_seeded"], reference, **TOLERANCE)


def test_rank_zero_alone_calls_the_full_module_after_fit(ranks):
    reference = single_device(lambda: RankSeededModel(0))
    module = RankSeededModel(0)
    module.load_state_dict(reference)
    with torch.no_grad():
        expected = module(_probe())
    torch.testing.assert_close(ranks[0]["rank_zero_output"], expected, **TOLERANCE)
    torch.testing.assert_close(ranks[0]["rank_zero_output_again"], expected, **TOLERANCE)
    assert ranks[0]["outside"].startswith("RuntimeError: `RankSeededModel` is sharded across 2 ranks by ZeRO-3")
    assert "with trainer.strategy.full_module():" in ranks[0]["outside"]
    assert ranks[0]["after_state_dict"].startswith("RuntimeError: `RankSeededModel` was resharded inside")


def test_units_not_nested_in_another_reshard_after_forward_and_train_like_one_device(ranks):
    # FSDP2 keeps a root unit gathered from forward to backward. This model's units are all direct children of the
    # LightningModule (the root, without parameters of its own): each must be sharded again after its forward.
    for result in ranks:
        assert result["flat_model"]["gathered_before_backward"]  # the probe ran
        assert all(gathered == [] for gathered in result["flat_model"]["gathered_before_backward"])
    torch.testing.assert_close(ranks[0]["flat_model"]["weights"], single_device(ResidualMLP), **TOLERANCE)


def test_the_wrapped_network_stays_gathered_to_backward_and_trains_like_one_device(ranks):
    for rank in ranks:
        result = rank["wrapped_model"]
        assert result["validated"] > 0
        assert result["gathered_before_backward"]  # the probe ran
        assert result["gathered_before_backward"] == [["model"]] * len(result["gathered_before_backward"])
    reference = single_device(WrappedModel)  # validation changes no weight
    torch.testing.assert_close(ranks[0]["wrapped_model"]["weights"], reference, **TOLERANCE)


def test_unfreezing_during_training_trains_like_one_device(ranks):
    reference = single_device(FreezeScheduleModel)
    torch.testing.assert_close(ranks[0]["freeze_schedule"], reference, **TOLERANCE)


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_pruning_is_refused_before_training_on_every_rank(ranks, name):
    for result in ranks:
        message = result["callbacks"][name]
        assert message.startswith(f"ValueError: `{name}` cannot run under strategy 'zero3'"), message
        assert "strategy='zero2'" in message


def test_errors_inside_fit_surface_as_themselves(ranks):
    for result in ranks:
        assert result["boom"] == "ValueError: boom"
        assert result["sync_batchnorm"].startswith("ValueError: `Trainer(sync_batchnorm=True)` needs CUDA devices")


def _meta_initialised(rank: int, world_size: int, seeds: tuple[int, int]) -> dict:
    fit_trainer = trainer("zero3", world_size, max_steps=0)  # set-up only: the initial weights
    with fit_trainer.init_module(empty_init=True):
        module = RankSeededModel(rank)
    torch.manual_seed(seeds[rank])  # the seed each rank holds when its shards are initialised
    fit_trainer.fit(module, loader(world_size, rank, steps=1))
    return {k: v.clone() for k, v in fit_trainer.strategy.lightning_module_state_dict().items()}


def test_meta_initialised_shards_depend_on_rank_zero_s_seed_only_and_differ_between_ranks():
    common_seed, rank_one_differs = (
        run_distributed(_meta_initialised, WORLD_SIZE, args=(seeds,), init_process_group=False, timeout=180)[0]
        for seeds in ((0, 0), (0, 5))
    )
    torch.testing.assert_close(rank_one_differs, common_seed, rtol=0, atol=0)
    for name, weight in common_seed.items():  # a common seed must not give both ranks' shards the same values
        half = weight.shape[0] // WORLD_SIZE
        assert not torch.equal(weight[:half], weight[half : 2 * half]), name
