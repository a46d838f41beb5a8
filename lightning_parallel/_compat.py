"""Private (``_``-prefixed) Lightning names the strategies use, each with the reason it is needed.

They are stable in practice but not public API; a Lightning version bump that moves them needs a change here only.
This is one of four ``_compat`` modules, one per layer, so that ``distributed/`` never imports Lightning:

* this module: Lightning privates used by ``strategies/``;
* :mod:`lightning_parallel.distributed.pipeline._compat`: torch pipelining privates (schedule and stage internals);
* :mod:`lightning_parallel.distributed.zero.stage3_compat`: FSDP2 privates of the ZeRO-3 backend;
* :mod:`lightning_parallel.monitor._compat`: the c10d ops and FSDP2 module name the monitor's collective tap reads.

Names here:

* ``_optimizers_to_device`` (fabric): moves optimizer state to the root device, as Lightning's own strategies do.
* ``_sync_module_states``: broadcasts rank 0's parameters and buffers, as ``DDPStrategy`` does before wrapping.
* ``_MultiProcessingLauncher``: the fork/spawn launcher our launchers extend.
* ``_init_optimizers_and_lr_schedulers``: parses every ``configure_optimizers`` return format; the pipeline records
  the whole-model optimizer layout with it once before the model is split.
* ``trainer.<loop>._data_source``: where the running loop's dataloader comes from; the pipeline sizes its split from
  one example batch before any collective.
* ``strategy._layer_sync``: set when ``Trainer(sync_batchnorm=True)``; read to refuse the flag.
* ``callback._average_model``: the averaged copy of the module that ``WeightAveraging`` (an ``AveragedModel``, the
  copy being its ``.module``) and ``StochasticWeightAveraging`` (the copy itself) create in their ``setup``; neither
  exposes it publicly. ZeRO-3 and the pipeline make it hold what the module holds (their shards, their stage).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers as init_optimizers_and_lr_schedulers
from lightning.pytorch.overrides.distributed import _sync_module_states as sync_module_states
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher as MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn

__all__ = [
    "MultiProcessingLauncher",
    "averaged_copy_of",
    "data_source_for",
    "init_optimizers_and_lr_schedulers",
    "layer_sync_of",
    "optimizers_to_device",
    "sync_module_states",
]

_LOOPS = {
    TrainerFn.FITTING: "fit_loop",
    TrainerFn.VALIDATING: "validate_loop",
    TrainerFn.TESTING: "test_loop",
    TrainerFn.PREDICTING: "predict_loop",
}


def data_source_for(trainer: Any) -> Any | None:
    """The ``_DataLoaderSource`` of the loop the trainer is about to run, or ``None``."""
    loop = getattr(trainer, _LOOPS.get(trainer.state.fn, ""), None)
    return getattr(loop, "_data_source", None)


def layer_sync_of(strategy: Any) -> Any | None:
    """The layer-sync plugin (``TorchSyncBatchNorm``) Lightning set on ``strategy`` for ``sync_batchnorm=True``."""
    return strategy._layer_sync


def averaged_copy_of(callback: Any) -> Any | None:
    """The module copy a weight-averaging callback averages into (created in its ``setup`` for ``fit``), else
    ``None`` (another callback, or not set up)."""
    if isinstance(callback, WeightAveraging):
        average = callback._average_model
        return None if average is None else average.module
    if isinstance(callback, StochasticWeightAveraging):
        return callback._average_model
    return None
