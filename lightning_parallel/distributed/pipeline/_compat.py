"""Every private torch/Lightning name the pipeline code uses, in one place for version bumps.

* ``_optimizers_to_device`` (Lightning): moves optimizer state to the stage's device, as Lightning's own strategies do.
* ``_init_optimizers_and_lr_schedulers`` (Lightning): parses every ``configure_optimizers`` return format, used to
  record the whole-model optimizer layout once before the model is split.
* ``schedule._stage_backward_initialized`` / ``_stages_backward_initialized`` (torch): whether a schedule finished
  its metadata inference, which calls the loss function once on an uninitialised dummy output; the only way to tell
  that call from the real per-micro-batch ones (checked with torch 2.11 and 2.13).
* ``trainer.<loop>._data_source`` (Lightning): where the loop's dataloader comes from; one example batch sizes the
  split before any collective.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.trainer.states import TrainerFn

__all__ = [
    "data_source_for",
    "init_optimizers_and_lr_schedulers",
    "optimizers_to_device",
    "schedule_backward_initialized",
]

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
