"""CPU (gloo) process groups beside the device's, for the per-step agreements on facts the host already holds.

Some per-step checks exchange values that live on the host: which parameters require grad
(``distributed/trainable.py``), which parameters got a gradient in this backward (ZeRO-1/2's flags,
``distributed/zero/buckets.py``). Sent over the device's group (NCCL), each would copy the values to the GPU and read
the result back: two waits of the host for everything queued on the device before them (torch's copies between host
and device without ``non_blocking`` wait for the stream), so the host stops queueing kernels ahead of the GPU. Over a
gloo group of CPU tensors the exchange waits only for the other ranks' hosts to reach the same point, never for a
device, and it does not queue behind the device group's collectives either (one group completes its collectives in
order: a check on the shard group would wait for the parameter all-gathers launched after the last step).

:class:`HostGroups` are built once per process group and layout, with the device mesh (``strategies/base.py``). Gloo
joins its ranks over TCP: on a multi-node cluster it needs the interface NCCL uses (``GLOO_SOCKET_IFNAME``, as
torch's own CPU collectives of a GPU job do).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_parallel.distributed.mesh import MeshLayout

__all__ = ["HostGroups"]


@dataclass(frozen=True)
class HostGroups:
    """Gloo groups over this run's ranks; tensors sent over them live on the CPU."""

    world: dist.ProcessGroup
    """Every rank."""
    data_parallel: dist.ProcessGroup
    """The ranks whose gradients are averaged with this rank's: the ``replicate`` x ``shard`` ranks of its pipeline
    rank and tensor rank (every rank without a pipeline or tensor parallelism, then the same group as :attr:`world`)."""

    @classmethod
    def build(cls, layout: MeshLayout, *, timeout: timedelta) -> HostGroups:
        """Collective over the default group (every rank, in the same order): the groups of ``layout``."""
        world = dist.new_group(backend="gloo", timeout=timeout)
        if layout.data_parallel_size == layout.world_size:
            return cls(world=world, data_parallel=world)
        # The peers of a rank hold the same part of the model: the same pipeline rank and tensor rank.
        parts = sorted({layout.model_parallel_coordinates(rank) for rank in range(layout.world_size)})
        cohorts = [
            [rank for rank in range(layout.world_size) if layout.model_parallel_coordinates(rank) == part]
            for part in parts
        ]
        mine, _ = dist.new_subgroups_by_enumeration(cohorts, timeout=timeout, backend="gloo")
        assert mine is not None  # every rank is in one cohort
        return cls(world=world, data_parallel=mine)
