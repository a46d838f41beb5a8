"""Lightning's optimizer wrapper, seen from below the strategies: the torch optimizer inside a ``LightningOptimizer``.

The strategies and the monitor both unwrap the optimizers Lightning hands them; this module sits below both, so the
monitor imports no strategy.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

__all__ = ["unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (or ``optimizer`` itself); the package's one
    unwrapping (the strategies and the monitor use it)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
