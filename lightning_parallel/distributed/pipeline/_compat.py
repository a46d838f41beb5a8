"""Every private torch/Lightning name the pipeline code uses, in one place for version bumps.

* ``_optimizers_to_device`` (Lightning): moves optimizer state to the stage's device, as Lightning's own strategies do.
* ``_init_optimizers_and_lr_schedulers`` (Lightning): parses every ``configure_optimizers`` return format, used to
  record the whole-model optimizer layout once before the model is split.
* ``schedule._stage_backward_initialized`` / ``_stages_backward_initialized`` (torch): whether a schedule finished
  its metadata inference, which calls the loss function once on an uninitialised dummy output; the only way to tell
  that call from the real per-micro-batch ones (checked with torch 2.11 and 2.13).
* ``trainer.<loop>._data_source`` (Lightning): where the loop's dataloader comes from; one example batch sizes the
  split before any collective.
* ``PipelineStage._compute_outputs`` (torch >= 2.12) / ``_shape_inference`` (earlier): the methods that run a stage's
  forward for metadata inference only; wrapped so that run leaves no trace in buffers (BatchNorm statistics) or RNG.
  If neither exists we refuse to build stages rather than silently update BatchNorm statistics twice.
* ``strategy._layer_sync`` (Lightning): set when ``Trainer(sync_batchnorm=True)``; read to refuse the flag.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.trainer.states import TrainerFn

__all__ = [
    "data_source_for",
    "init_optimizers_and_lr_schedulers",
    "layer_sync_of",
    "optimizers_to_device",
    "schedule_backward_initialized",
    "stage_inference_method",
]

_STAGE_INFERENCE_METHODS = ("_compute_outputs", "_shape_inference")

optimizers_to_device = _optimizers_to_device
init_optimizers_and_lr_schedulers = _init_optimizers_and_lr_schedulers

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


def schedule_backward_initialized(schedule: Any) -> bool:
    """Whether torch's ``schedule`` has finished its backward metadata inference."""
    flag = getattr(schedule, "_stage_backward_initialized", None)  # PipelineScheduleSingle
    if flag is None:
        flag = getattr(schedule, "_stages_backward_initialized", False)  # PipelineScheduleMulti
    return bool(flag)


def stage_inference_method(stage_class: type) -> str:
    """The name of the method of torch's ``PipelineStage`` that runs the stage's forward for metadata inference.

    Raises:
        RuntimeError: If this torch has none of the known ones.
    """
    for name in _STAGE_INFERENCE_METHODS:
        if callable(getattr(stage_class, name, None)):
            return name
    raise RuntimeError(
        f"This torch ({torch.__version__}) has none of `PipelineStage.{'` / `'.join(_STAGE_INFERENCE_METHODS)}`, which"
        " lightning_parallel wraps so that torch's shape inference leaves BatchNorm statistics alone. Use a torch"
        " version this package supports, or report it."
    )


def layer_sync_of(strategy: Any) -> Any | None:
    """The layer-sync plugin (``TorchSyncBatchNorm``) Lightning set on ``strategy`` for ``sync_batchnorm=True``."""
    return strategy._layer_sync
