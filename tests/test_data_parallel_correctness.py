"""DataParallelStrategy off the happy path (issue 10): models from ``model_zoo`` against single-device Lightning.

* ``requires_grad`` changing during training (a backbone unfrozen at step 2) trains like one device: the strategy
  re-wraps DDP when the trainable set changes, with and without gradient accumulation, and under Lightning's
  ``BackboneFinetuning`` (frozen after DDP wrapped the model, unfrozen at epoch 1); a change made inside
  ``training_step`` is refused on every rank, naming the parameters.
* An unused parameter gives our error naming it, under the popen path and Lightning's fork launcher (which also
  trains the unfreeze schedule like one device).
* ``Trainer(sync_batchnorm=True)`` on CPU is refused on every rank at setup, with one clear ``ValueError`` and no
  second error, under every strategy (all call ``strategies/batchnorm.py``); the pipeline refuses it on any device.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import nn
from torch.utils.data import DataLoader
from training_helpers import assert_weights_close

from lightning_parallel import DataParallelStrategy
from lightning_parallel.strategies.batchnorm import check_layer_sync, check_sync_batchnorm
from lightning_parallel.strategies.data_parallel import UNUSED_PARAMETERS_MESSAGE

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)

TIMEOUT_S = 180  # generous: the 2 cores are shared with other tests
FREEZE_CASES = [(1, {}), (2, {}), (1, {"static_graph": True, "gradient_as_bucket_view": False})]
FINETUNE_EPOCH_STEPS = 2


# ------------------------------------------------------------------ requires_grad changing during training
class _UnfreezeInsideTrainingStep(zoo.FreezeScheduleModel):
    """Unfreezes in ``training_step`` itself, after the step's DDP forward has started."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.unfreeze_at:
            self.backbone.requires_grad_(True)
        return super().training_step(batch, batch_idx)


def _error_of(fit: Any) -> tuple[str, str]:
    try:
        fit()
    except Exception as error:
        return type(error).__name__, str(error)
    return "no error", ""


def _backbone_finetuning(strategy: str, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    """Lightning's ``BackboneFinetuning``: frozen when fit starts (after DDP wrapped it), unfrozen at epoch 1."""
    pl.seed_everything(0, verbose=False)
    model = zoo.FreezeScheduleModel(unfreeze_at=-1)
    model.backbone.requires_grad_(True)  # the callback freezes it itself
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0, verbose=False)
    fit_trainer = zoo.trainer(strategy, world_size, max_steps=2 * FINETUNE_EPOCH_STEPS, callbacks=[callback])
    fit_trainer.fit(model, zoo.loader(world_size, rank, steps=FINETUNE_EPOCH_STEPS))
    return zoo.state_of(model)


def _freeze_schedule_in_rank(rank: int, world_size: int) -> dict[str, Any]:
    weights = [
        zoo.fit_in_rank(
            zoo.FreezeScheduleModel, DataParallelStrategy(**options), world_size, accumulate_grad_batches=accumulate
        )
        for accumulate, options in FREEZE_CASES
    ]
    weights.append(_backbone_finetuning("data_parallel", world_size, rank))
    inside = _error_of(lambda: zoo.fit_in_rank(_UnfreezeInsideTrainingStep, "data_parallel", world_size))
    unused = _error_of(lambda: zoo.fit_in_rank(zoo.AuxHeadModel, "data_parallel", world_size))
    # Manual optimization: the discriminator's step leaves the generator without gradients.
    gan = _error_of(lambda: zoo.fit_in_rank(zoo.TwoOptimizerGAN, "data_parallel", world_size))
    return {"weights": weights, "inside": inside, "unused": unused, "gan": gan}


def test_unfreezing_trains_like_one_device_and_bad_changes_are_named_on_every_rank() -> None:
    rank0, rank1 = run_distributed(_freeze_schedule_in_rank, 2, init_process_group=False, timeout=TIMEOUT_S)
    pl.seed_everything(0, verbose=False)
    untrained = zoo.state_of(zoo.FreezeScheduleModel())
    references = [zoo.single_device(zoo.FreezeScheduleModel, accumulate_grad_batches=a) for a, _ in FREEZE_CASES]
    references.append(_backbone_finetuning("auto", 1, 0))
    cases = [*FREEZE_CASES, (1, "BackboneFinetuning")]
    for (accumulate, options), reference, weights0, weights1 in zip(
        cases, references, rank0["weights"], rank1["weights"], strict=True
    ):
        assert_weights_close(weights0, reference, rtol=1e-5, atol=1e-6)
        assert_weights_close(weights1, weights0, rtol=0, atol=0)  # plain DDP: the replicas drift apart (1e-2)
        moved = (weights0["backbone.0.weight"] - untrained["backbone.0.weight"]).abs().max().item()
        assert moved > 1e-3, (accumulate, options)  # the unfrozen backbone really trained
    for rank in (rank0, rank1):
        kind, message = rank["inside"]
        assert kind == "RuntimeError", message
        assert "`requires_grad` changed during a training step" in message
        assert "now trainable: backbone.0.weight, backbone.0.bias, backbone.2.weight, backbone.2.bias" in message
        assert "on_train_batch_start" in message
        kind, message = rank["unused"]
        assert kind == "RuntimeError", message
        assert message.startswith(UNUSED_PARAMETERS_MESSAGE)
        assert "Parameters without a gradient on this rank: never_used.weight, never_used.bias." in message
        kind, message = rank["gan"]
        assert kind == "RuntimeError" and message.startswith(UNUSED_PARAMETERS_MESSAGE), message
        assert "on this rank: generator.0.weight, generator.0.bias, generator.2.weight, generator.2.bias." in message


# ------------------------------------------------------------------ unused parameters under the fork launcher
class _FreezeScheduleWithItsData(zoo.FreezeScheduleModel):
    """Loads its rank's slice of each global batch itself: forked ranks all receive the loader given to ``fit``."""

    def train_dataloader(self) -> DataLoader:
        return zoo.loader(self.trainer.world_size, self.global_rank)


def _under_fork_launcher(rank: int, world_size: int) -> tuple[dict[str, torch.Tensor], tuple[str, str]]:
    """The unfreeze schedule (weights come back to this parent process), then an unused parameter."""
    pl.seed_everything(0, verbose=False)
    model = _FreezeScheduleWithItsData()
    zoo.trainer("data_parallel_notebook", 2).fit(model)
    pl.seed_everything(0, verbose=False)
    fit_trainer = zoo.trainer("data_parallel_notebook", 2)
    unused = _error_of(lambda: fit_trainer.fit(zoo.AuxHeadModel(), zoo.loader(2, 0)))
    return zoo.state_of(model), unused


def test_fork_launcher_unfreezes_like_one_device_and_names_unused_parameters() -> None:
    """Lightning's fork workers never call ``on_exception``: the worker's traceback (which the parent re-raises as
    ``ProcessRaisedException``) used to end in torch's raw "Expected to have finished reduction"."""
    ((weights, (kind, message)),) = run_distributed(
        _under_fork_launcher, 1, init_process_group=False, launcher_env=False, timeout=TIMEOUT_S
    )
    assert_weights_close(weights, zoo.single_device(zoo.FreezeScheduleModel), rtol=1e-5, atol=1e-6)
    assert kind == "ProcessRaisedException", message
    assert message.startswith(UNUSED_PARAMETERS_MESSAGE)
    assert f"RuntimeError: {UNUSED_PARAMETERS_MESSAGE}" in message  # the worker itself raised ours
    assert "never_used.weight, never_used.bias" in message


# ------------------------------------------------------------------ sync_batchnorm
SYNC_BATCHNORM_STRATEGIES = ("data_parallel", "zero1", "zero2", "zero3", "pipeline")
NEEDS_CUDA = ("data_parallel", "zero1", "zero2", "zero3")  # supported on CUDA; the pipeline never supports it


def _sync_batchnorm_on_cpu(rank: int, world_size: int) -> dict[str, tuple[str, str, bool]]:
    results = {}
    for name in SYNC_BATCHNORM_STRATEGIES:
        pl.seed_everything(0, verbose=False)
        fit_trainer = zoo.trainer(name, world_size, sync_batchnorm=True)
        try:
            fit_trainer.fit(zoo.BatchNormCNN(), zoo.loader(world_size, rank))
            results[name] = ("no error", "", False)
        except Exception as error:
            results[name] = (type(error).__name__, str(error), error.__context__ is not None)
    return results


def test_sync_batchnorm_on_cpu_is_refused_at_setup_on_every_rank() -> None:
    for results in run_distributed(_sync_batchnorm_on_cpu, 2, init_process_group=False, timeout=TIMEOUT_S):
        for name in SYNC_BATCHNORM_STRATEGIES:
            kind, message, has_second_error = results[name]
            assert kind == "ValueError", (name, message)
            if name in NEEDS_CUDA:
                assert message.startswith("`Trainer(sync_batchnorm=True)` needs CUDA devices"), (name, message)
                assert f"With strategy {name!r} on CPU remove `sync_batchnorm=True`" in message
            else:
                assert message.startswith("`Trainer(sync_batchnorm=True)` is not supported by strategy 'pipeline'")
            assert "running statistics saved in checkpoints are rank 0's" in message
            assert not has_second_error, (name, message)  # raised alone, not while handling another error


def test_sync_batchnorm_check_answers_per_device_and_strategy() -> None:
    check_sync_batchnorm("data_parallel", torch.device("cuda", 0), supported=True)
    with pytest.raises(ValueError, match="needs CUDA devices: torch's SyncBatchNorm cannot run on MPS"):
        check_sync_batchnorm("zero2", torch.device("mps"), supported=True)
    with pytest.raises(ValueError, match="not supported by strategy 'pipeline': remove `sync_batchnorm=True`"):
        check_sync_batchnorm("pipeline", torch.device("cuda", 0), supported=False)

    class _OwnSync(LayerSync):
        def apply(self, model: nn.Module) -> nn.Module:
            return model

        def revert(self, model: nn.Module) -> nn.Module:
            return model

    check_layer_sync(None, "zero2", torch.device("cpu"), supported=True)  # flag not set
    check_layer_sync(_OwnSync(), "zero2", torch.device("cpu"), supported=True)  # a user's own plugin: theirs
