"""The replicate axis of hybrid sharding (stages 1-2): how each reduced gradient shard is averaged across the shard
groups.

Hybrid sharding (``ShardedOptimizerStrategy(shard_size=K)``) reduces each gradient bucket inside its shard group of
``K`` ranks, then combines the ``1/K`` shard a rank holds with the same shard of the other groups. Who does the second
step is a :class:`ReplicaReduction`:

* :class:`ProcessGroupReplicas`: a plain process group over the ranks holding the same shard in every group (one job,
  the mesh's ``replicate`` axis); the buckets divide by its size and it sums.
* ``FaultTolerantReplicas`` (``fault_tolerance/replicas.py``): torchft's manager across replica groups that are
  separate jobs; it averages over the groups alive at the step, so the buckets divide by the group's ranks only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch.distributed as dist
from torch import Tensor

from lightning_parallel.accounting import CommunicationStats

__all__ = ["ProcessGroupReplicas", "ReplicaReduction"]


class ReplicaReduction(Protocol):
    """Combines each rank's reduced gradient shards with the same shards of the other replicas (collective)."""

    divisor: int
    """What the buckets divide each gradient by beyond their own group's ranks before :meth:`reduce` (it sums): the
    number of replicas, or 1 for a reduction that averages by itself."""

    def reduce(self, shards: Sequence[Tensor], used: Tensor | None, stats: CommunicationStats | None) -> None:
        """Collective across the replicas, in place: each of ``shards`` becomes its sum (or average, ``divisor=1``)
        over them, in the same order on every replica; ``used`` (one ``uint8`` per bucketed parameter, or ``None``)
        becomes 1 where any replica's is. ``stats``: where to count the bytes, or ``None``."""


class ProcessGroupReplicas:
    """:class:`ReplicaReduction` over a plain process group (one job's ``replicate`` mesh axis): sums, flags' MAX."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.divisor = dist.get_world_size(group)

    def reduce(self, shards: Sequence[Tensor], used: Tensor | None, stats: CommunicationStats | None) -> None:
        works = []
        for shard in shards:
            if stats is not None:
                stats.record("all_reduce", shard.numel() * shard.element_size())
            works.append(dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        if used is not None:
            if stats is not None:
                stats.record("all_reduce", used.numel() * used.element_size())
            works.append(dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        for work in works:
            work.wait()
