"""Fault tolerance without restarts for the replicated dimension, on PyTorch's torchft (an optional extra).

Importing this package never imports torchft: only :mod:`lightning_parallel.fault_tolerance.replica_sync` does, when
a strategy configured with :class:`FaultTolerance` starts training.
"""

from lightning_parallel.fault_tolerance.agreement import ReplicaGroupMismatchError
from lightning_parallel.fault_tolerance.config import FaultTolerance

__all__ = ["FaultTolerance", "ReplicaGroupMismatchError"]
