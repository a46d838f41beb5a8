"""One layout of the ranks for every strategy: a device mesh with the named axes ``replicate`` x ``shard`` x ``pp``.

The ranks are laid out row-major over ``(replicate, shard, pp)``: the pipeline ranks of a model replica are adjacent,
then the shards of one replica group, then the replica groups::

    global_rank = (replicate_rank * shard_size + shard_rank) * pipeline_parallel_size + pipeline_rank

* ``replicate``: ranks holding the same values (data parallel; ZeRO's replica groups under hybrid sharding; the
  pipeline's data-parallel replicas of a stage without ZeRO), whose gradients are averaged by an all-reduce;
* ``shard``: ranks holding different shards of the same values (ZeRO-1/2's buckets, ZeRO-3's FSDP2 parameters, also
  of one pipeline stage);
* ``pp``: the ranks of one pipeline, each holding other layers.

torchtitan's ``ParallelDims`` orders its axes the other way round (``pp`` outermost: the ranks of one pipeline stage
are adjacent, so its FSDP and TP groups stay inside a node). Here the pipeline is innermost, so the ranks of one
pipeline share a node and its point-to-point sends stay on the fast links; the shard groups span nodes. Which is
better depends on the network (pipeline sends are small and frequent, ZeRO's collectives large and once per step).

A data-parallel strategy is ``(world_size, 1, 1)``; ``ShardedOptimizerStrategy(shard_size=K)`` is ``(world_size / K, K,
1)`` (``shard_size=None``: ``(1, world_size, 1)``); ``PipelineParallelStrategy`` is ``(world_size / P, 1, P)``, with
ZeRO ``(world_size / (P * K), K, P)`` (``shard_size=None``: ``K = world_size / P``). Each rank of ``replicate`` x
``shard`` reads its own slice of the global batch (:meth:`MeshLayout.data_parallel_rank`); the ranks of one pipeline
read the same slice.

:class:`MeshLayout` is plain arithmetic (the planner uses it without any process); :meth:`MeshLayout.build` makes
torch's :class:`~torch.distributed.device_mesh.DeviceMesh` of it, a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["AXES", "Axis", "MeshLayout", "forget_process_groups", "validate_shard_size"]

Axis = Literal["replicate", "shard", "pp"]
AXES: tuple[Axis, Axis, Axis] = ("replicate", "shard", "pp")
"""The mesh's axes, outermost first."""


def validate_shard_size(shard_size: object) -> None:
    """Local. Refuse a ``shard_size`` that is not ``None`` or a positive integer (checked in ``__init__``; whether it
    divides the world size is checked by :class:`MeshLayout` once the world size is known)."""
    if shard_size is None:
        return
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(
            f"`shard_size={shard_size!r}` is invalid: pass a positive number of ranks that shard each state (a"
            " divisor of the world size, e.g. the devices of one node), or None to shard over every rank."
        )


@dataclass(frozen=True)
class MeshLayout:
    """The degrees of the three axes for ``world_size`` ranks; validated on construction (a ``ValueError`` naming
    the bad value and the fix, the same on every rank, so raise it before any collective).

    Args:
        world_size: Number of ranks.
        shard_size: Ranks per shard group (``shard`` axis); ``None``: every rank of a pipeline stage's replicas
            (the whole world without a pipeline).
        pipeline_parallel_size: Ranks per pipeline (``pp`` axis).
    """

    world_size: int
    shard_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        validate_shard_size(self.shard_size)
        p = self.pipeline_parallel_size
        if isinstance(p, bool) or not isinstance(p, int) or p < 1 or self.world_size % p:
            raise ValueError(
                f"`pipeline_parallel_size={p!r}` must be a positive divisor of the world size ({self.world_size}):"
                " each pipeline spans that many ranks and the world holds whole pipelines."
            )
        data_parallel = self.world_size // p
        if data_parallel % self.shard_size:
            divisors = [d for d in range(1, data_parallel + 1) if data_parallel % d == 0]
            raise ValueError(
                f"`shard_size={self.shard_size}` does not divide the {data_parallel} data-parallel ranks (world size"
                f" {self.world_size}{f' / pipeline_parallel_size {p}' if p > 1 else ''}): each replica group must"
                f" hold whole shard groups. Use one of {divisors}, or None to shard over every rank."
            )

    @classmethod
    def for_sharding(cls, world_size: int, shard_size: int | None) -> MeshLayout:
        """ZeRO's layout: ``shard_size`` ranks per shard group (``None``: the whole world), replicated across the
        ``world_size / shard_size`` groups."""
        return cls(world_size, shard_size=world_size if shard_size is None else shard_size)

    # ------------------------------------------------------------------ degrees
    @property
    def replicate_size(self) -> int:
        """Number of replica groups (the ``replicate`` axis)."""
        return self.world_size // (self.shard_size * self.pipeline_parallel_size)

    @property
    def data_parallel_size(self) -> int:
        """Ranks reading different data: ``replicate_size * shard_size``."""
        return self.replicate_size * self.shard_size

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(replicate, shard, pp)`` degrees."""
        return (self.replicate_size, self.shard_size, self.pipeline_parallel_size)

    @property
    def is_hybrid(self) -> bool:
        """Whether states are both sharded (over more than one rank) and replicated across several groups."""
        return self.shard_size > 1 and self.replicate_size > 1

    # ------------------------------------------------------------------ coordinates
    def coordinates(self, global_rank: int) -> tuple[int, int, int]:
        """``(replicate_rank, shard_rank, pipeline_rank)`` of ``global_rank``."""
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"`global_rank={global_rank}` is outside the world of {self.world_size} ranks.")
        s, p = self.shard_size, self.pipeline_parallel_size
        return (global_rank // (s * p), (global_rank // p) % s, global_rank % p)

    def global_rank(self, replicate: int, shard: int, pp: int) -> int:
        """The rank at these coordinates."""
        return (replicate * self.shard_size + shard) * self.pipeline_parallel_size + pp

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which slice of the global batch ``global_rank`` reads (its pipeline's ranks read the same one)."""
        return global_rank // self.pipeline_parallel_size

    def shard_rank(self, global_rank: int) -> int:
        return self.coordinates(global_rank)[1]

    def replicate_rank(self, global_rank: int) -> int:
        return self.coordinates(global_rank)[0]

    def pipeline_rank(self, global_rank: int) -> int:
        return self.coordinates(global_rank)[2]

    def group_ranks(self, axis: Axis, global_rank: int) -> list[int]:
        """The global ranks of ``global_rank``'s group along ``axis`` (the others' coordinates fixed), in order."""
        index = AXES.index(axis)
        coordinates = list(self.coordinates(global_rank))
        ranks = []
        for value in range(self.shape[index]):
            coordinates[index] = value
            ranks.append(self.global_rank(*coordinates))
        return ranks

    # ------------------------------------------------------------------ torch
    def build(self, device_type: str) -> DeviceMesh:
        """Collective: torch's ``DeviceMesh`` of this layout, with the axes :data:`AXES` (every rank, same order)."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)


def forget_process_groups(mesh: DeviceMesh) -> int:
    """Local. Drop ``mesh``'s own references to its process groups; returns how many it held.

    Only for after ``destroy_process_group()``: torch 2.13's ``DeviceMesh`` keeps each group in ``_pg_registry``
    (private; kept for ``torch.compile``, eager code resolves groups by name), and a mesh lives on in DTensor's
    caches (``MeshTopoInfo.build_from_mesh`` is an unbounded ``lru_cache``), so its groups and their gloo threads
    would otherwise outlive ``destroy_process_group()`` until the interpreter tears itself down.
    """
    registry = getattr(mesh, "_pg_registry", None)
    if not isinstance(registry, dict):
        return 0
    count = len(registry)
    registry.clear()
    return count
