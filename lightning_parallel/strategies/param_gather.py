"""When ZeRO-1/2 may overlap its parameter all-gather with the next forward (``overlap_param_gather="auto"``).

With the overlap, a bucket's parameters are current only once it has been waited for: before the training step (the
buckets outside the repeated blocks), at each block's forward (its buckets), and before backward, checkpoints and
evaluation (all). Lightning runs user code between the optimizer step and the next training step: callbacks' and the
module's ``on_train_batch_end``, ``on_train_batch_start``, ``on_before_zero_grad`` and epoch hooks. An EMA callback
that averages the parameters there would average stale values without any error. So ``"auto"`` overlaps only when
no such hook can read parameters: automatic optimization (manual optimization may read them anywhere after
``opt.step()``), the LightningModule overriding none of those hooks, and every callback either not overriding them or
being a Lightning callback known to read no parameter values (checkpointing goes through the strategy, which waits).
A callback of yours that reads no parameters in those hooks can say so with a class attribute
``reads_parameters = False``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import (
    DeviceStatsMonitor,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)
from lightning.pytorch.core.hooks import ModelHooks

__all__ = ["HOOKS_BETWEEN_STEPS", "parameter_readers_between_steps"]

HOOKS_BETWEEN_STEPS: tuple[str, ...] = (
    "on_train_batch_end",
    "on_train_batch_start",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "on_train_epoch_end",
    "on_train_epoch_start",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_train_end",
)
"""Hooks that run after an optimizer step and before the strategy has waited for every parameter."""

_READS_NO_PARAMETERS: tuple[type, ...] = (
    Callback,  # the first three: the base classes' empty hooks
    ModelHooks,
    LightningModule,
    ModelCheckpoint,  # saves through the strategy, which waits for the parameters first
    ProgressBar,
    ModelSummary,
    LearningRateMonitor,
    Timer,
    EarlyStopping,
    ThroughputMonitor,
    DeviceStatsMonitor,
    GradientAccumulationScheduler,
)
"""Classes whose implementations of :data:`HOOKS_BETWEEN_STEPS` read no parameter values."""


def parameter_readers_between_steps(module: LightningModule, callbacks: Iterable[Any]) -> list[str]:
    """The hooks (``"EMA.on_train_batch_end"``) that may read parameters between a step and the next training step,
    or a reason such as manual optimization; empty when the all-gather may overlap the next forward."""
    readers = [] if module.automatic_optimization else ["manual optimization (`automatic_optimization=False`)"]
    for obj in (module, *callbacks):
        if getattr(obj, "reads_parameters", True) is False:
            continue
        for hook in HOOKS_BETWEEN_STEPS:
            owner = next((cls for cls in type(obj).__mro__ if hook in vars(cls)), None)
            if owner is not None and not _reads_no_parameters(owner):
                readers.append(f"{type(obj).__name__}.{hook}")
    return readers


def _reads_no_parameters(owner: type) -> bool:
    """Whether ``owner``'s hooks are known to read no parameters: one of those classes, or Lightning's own subclass of
    one (``TQDMProgressBar``, ``RichModelSummary``); a user's subclass may read anything."""
    if owner in _READS_NO_PARAMETERS:
        return True
    return issubclass(owner, _READS_NO_PARAMETERS[3:]) and owner.__module__.startswith("lightning.pytorch.")
