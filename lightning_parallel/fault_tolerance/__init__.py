"""Fault tolerance without restarts for the replicated dimension, on PyTorch's torchft (an optional extra).

Every part of it lives here:

* :mod:`.config`: :class:`FaultTolerance`, the user's settings (plain data, validated on construction);
* :mod:`.replicas`: ``FaultTolerantReplicas``, the Lightning side the strategies (``DataParallelStrategy``,
  ``ShardedOptimizerStrategy`` stages 1-2) call at four points of a step;
* :mod:`.replica_sync`: ``ReplicaGroupSync``, one replica group's side of torchft's per-step protocol (torch-only; the
  only module that imports torchft);
* :mod:`.agreement`: what groups compare when they meet (:class:`ReplicaGroupMismatchError` when they differ);
* :mod:`.lighthouse`: whether the configured lighthouse answers, before torchft connects to it;
* :mod:`.shard_state`: what a healing group's rank receives from a live one under hybrid sharding.

The one seam in ``distributed/``: ZeRO's buckets average each reduced gradient shard across replicas through a
``ReplicaReduction`` (``distributed/zero/replica_reduction.py``); ``FaultTolerantReplicas`` is one, so
``distributed/zero`` imports nothing of this package.

Importing this package never imports torchft: only :mod:`lightning_parallel.fault_tolerance.replica_sync` does, when
a strategy configured with :class:`FaultTolerance` starts training.
"""

from lightning_parallel.fault_tolerance.agreement import ReplicaGroupMismatchError
from lightning_parallel.fault_tolerance.config import FaultTolerance

__all__ = ["FaultTolerance", "ReplicaGroupMismatchError"]
