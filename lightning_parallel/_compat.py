"""The one place that imports private (``_``-prefixed) helpers of torch and Lightning.

They are stable in practice but not public API; a version bump that moves them needs a change here only.
"""

from __future__ import annotations

from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch.overrides.distributed import _sync_module_states as sync_module_states
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher as MultiProcessingLauncher

__all__ = ["MultiProcessingLauncher", "optimizers_to_device", "sync_module_states"]
