"""Whether a fit's code reads the parameters' ``.grad`` between backward and the optimizer step."""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

__all__ = ["GRADIENT_HOOKS", "reads_gradients"]

GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")
"""The hooks Lightning calls while gradients exist and before the step (its docs' place to inspect them)."""


def reads_gradients(module: pl.LightningModule, callbacks: Iterable[pl.Callback]) -> bool:
    """Manual optimization (the step reads ``.grad`` after ``manual_backward``), or ``module`` or a callback that is
    not this package's own overriding one of :data:`GRADIENT_HOOKS`. Our callbacks (the monitor) read no gradient."""
    if not module.automatic_optimization:
        return True
    if any(is_overridden(hook, module, pl.LightningModule) for hook in GRADIENT_HOOKS):
        return True
    users = (callback for callback in callbacks if not type(callback).__module__.startswith("lightning_parallel."))
    return any(is_overridden(hook, callback, pl.Callback) for callback in users for hook in GRADIENT_HOOKS)
