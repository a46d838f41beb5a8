"""Torch-only building blocks (no Trainer needed): compression hooks, uneven-input lockstep, ..."""

from lightning_parallel.distributed.compression import (
    COMPRESSION_CHOICES,
    CommunicationStats,
    SerializedPowerSGD,
    low_precision_allreduce_hook,
)
from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.distributed.uneven import LockstepBatches, needs_lockstep

__all__ = [
    "COMPRESSION_CHOICES",
    "CommunicationStats",
    "LockstepBatches",
    "MeshLayout",
    "SerializedPowerSGD",
    "low_precision_allreduce_hook",
    "needs_lockstep",
]
