"""One layout of the ranks for every strategy: a device mesh with the named axes ``replicate`` x ``shard`` x ``pp``
x ``tensor``.

The ranks are laid out row-major over ``(replicate, shard, pp, tensor)``: the tensor-parallel ranks of a layer are
adjacent, then the pipeline ranks of a model replica, then the shards of one replica group, then the replica groups::

    global_rank = ((replicate_rank * shard_size + shard_rank) * pipeline_parallel_size + pipeline_rank)
                  * tensor_parallel_size + tensor_rank

* ``replicate``: ranks holding the same values (data parallel; ZeRO's replica groups under hybrid sharding; the
  pipeline's data-parallel replicas of a stage without ZeRO), whose gradients are averaged by an all-reduce;
* ``shard``: ranks holding different shards of the same values (ZeRO-1/2's buckets, ZeRO-3's FSDP2 parameters, also
  of one pipeline stage);
* ``pp``: the ranks of one pipeline, each holding other layers;
* ``tensor``: the ranks splitting each layer's matrices (tensor parallelism, ``distributed/tensor_parallel/``): they
  hold different slices of the same layers, read the same batch and exchange activations inside every layer, so the
  axis is innermost, within a node (torchtitan's order, Megatron's too).

torchtitan's ``ParallelDims`` orders its axes the other way round (``pp`` outermost: the ranks of one pipeline stage
are adjacent, so its FSDP and TP groups stay inside a node). Here the pipeline is innermost, so the ranks of one
pipeline share a node and its point-to-point sends stay on the fast links; the shard groups span nodes. Which is
better depends on the network (pipeline sends are small and frequent, ZeRO's collectives large and once per step).

A data-parallel strategy is ``(world_size, 1, 1)``; ``ShardedOptimizerStrategy(shard_size=K)`` is ``(world_size / K, K,
1)`` (``shard_size=None``: ``(1, world_size, 1)``); ``PipelineParallelStrategy`` is ``(world_size / P, 1, P)``, with
ZeRO ``(world_size / (P * K), K, P)`` (``shard_size=None``: ``K = world_size / P``); ``tensor_parallel_size=T``
appends ``T`` and divides the data axes by it (``ShardedOptimizerStrategy(tensor_parallel_size=T)``:
``(world_size / (K * T), K, 1, T)``, ``shard_size=None``: ``K = world_size / T``). Each rank of ``replicate`` x
``shard`` reads its own slice of the global batch (:meth:`MeshLayout.data_parallel_rank`); the ranks of one pipeline
and of one tensor-parallel group read the same slice.

:class:`MeshLayout` is plain arithmetic (the planner uses it without any process); :meth:`MeshLayout.build` makes
torch's :class:`~torch.distributed.device_mesh.DeviceMesh` of it, a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "AXES",
    "Axis",
    "MeshLayout",
    "forget_process_groups",
    "validate_shard_size",
    "validate_tensor_parallel_size",
]

Axis = Literal["replicate", "shard", "pp", "tensor"]
AXES: tuple[Axis, Axis, Axis, Axis] = ("replicate", "shard", "pp", "tensor")
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


def validate_tensor_parallel_size(tensor_parallel_size: object) -> None:
    """Local. Refuse a ``tensor_parallel_size`` that is not a positive integer (checked in ``__init__``; whether it
    divides the world size is checked by :class:`MeshLayout` once the world size is known)."""
    t = tensor_parallel_size
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(
            f"`tensor_parallel_size={t!r}` is invalid: pass a positive number of ranks that split each layer's"
            " matrices (a divisor of the world size, at most the devices of one node; 1 turns tensor parallelism off)."
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
        tensor_parallel_size: Ranks splitting each layer (``tensor`` axis, innermost).
    """

    world_size: int
    shard_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        validate_shard_size(self.shard_size)
        validate_tensor_parallel_size(self.tensor_parallel_size)
        t = self.tensor_parallel_size
        if self.world_size % t:
            raise ValueError(
                f"`tensor_parallel_size={t}` does not divide the world size ({self.world_size}): each tensor-parallel"
                f" group spans {t} ranks and the world holds whole groups. Use one of"
                f" {_divisors(self.world_size)}, or run on a multiple of {t} devices."
            )
        p = self.pipeline_parallel_size
        if isinstance(p, bool) or not isinstance(p, int) or p < 1 or (self.world_size // t) % p:
            raise ValueError(
                f"`pipeline_parallel_size={p!r}` must be a positive divisor of the world size ({self.world_size}"
                f"{f' / tensor_parallel_size {t}' if t > 1 else ''}): each pipeline spans that many ranks and the world"
                " holds whole pipelines."
            )
        data_parallel = self.world_size // (p * t)
        if data_parallel % self.shard_size:
            divided = "".join(
                f" / {name} {size}"
                for name, size in (("pipeline_parallel_size", p), ("tensor_parallel_size", t))
                if size > 1
            )
            raise ValueError(
                f"`shard_size={self.shard_size}` does not divide the {data_parallel} data-parallel ranks (world size"
                f" {self.world_size}{divided}): each replica group must hold whole shard groups. Use one of"
                f" {_divisors(data_parallel)}, or None to shard over every rank."
            )

    @classmethod
    def for_sharding(cls, world_size: int, shard_size: int | None, *, tensor_parallel_size: int = 1) -> MeshLayout:
        """ZeRO's layout: ``shard_size`` ranks per shard group (``None``: every data-parallel rank, ``world_size /
        tensor_parallel_size``), replicated across the ``world_size / (shard_size * tensor_parallel_size)`` groups."""
        validate_tensor_parallel_size(tensor_parallel_size)
        t = tensor_parallel_size
        if shard_size is None:
            shard_size = world_size // t if world_size % t == 0 else world_size  # else: refused on construction
        return cls(world_size, shard_size=shard_size, tensor_parallel_size=t)

    # ------------------------------------------------------------------ degrees
    @property
    def replicate_size(self) -> int:
        """Number of replica groups (the ``replicate`` axis)."""
        return self.world_size // (self.shard_size * self.pipeline_parallel_size * self.tensor_parallel_size)

    @property
    def data_parallel_size(self) -> int:
        """Ranks reading different data: ``replicate_size * shard_size``."""
        return self.replicate_size * self.shard_size

    @property
    def shape(self) -> tuple[int, ...]:
        """The degrees of :attr:`axes`: ``(replicate, shard, pp)``, and ``tensor`` with tensor parallelism."""
        degrees = (self.replicate_size, self.shard_size, self.pipeline_parallel_size, self.tensor_parallel_size)
        return degrees[: len(self.axes)]

    @property
    def is_hybrid(self) -> bool:
        """Whether states are both sharded (over more than one rank) and replicated across several groups."""
        return self.shard_size > 1 and self.replicate_size > 1

    # ------------------------------------------------------------------ coordinates
    def coordinates(self, global_rank: int) -> tuple[int, ...]:
        """The coordinates of ``global_rank`` on :attr:`axes`: ``(replicate_rank, shard_rank, pipeline_rank)``, and
        ``tensor_rank`` with tensor parallelism."""
        return self._all_coordinates(global_rank)[: len(self.axes)]

    def _all_coordinates(self, global_rank: int) -> tuple[int, int, int, int]:
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"`global_rank={global_rank}` is outside the world of {self.world_size} ranks.")
        s, p, t = self.shard_size, self.pipeline_parallel_size, self.tensor_parallel_size
        return (global_rank // (s * p * t), (global_rank // (p * t)) % s, (global_rank // t) % p, global_rank % t)

    def global_rank(self, replicate: int, shard: int, pp: int, tensor: int = 0) -> int:
        """The rank at these coordinates."""
        pipeline_index = (replicate * self.shard_size + shard) * self.pipeline_parallel_size + pp
        return pipeline_index * self.tensor_parallel_size + tensor

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which slice of the global batch ``global_rank`` reads (its pipeline's and its tensor-parallel group's ranks
        read the same one)."""
        return global_rank // (self.pipeline_parallel_size * self.tensor_parallel_size)

    def shard_rank(self, global_rank: int) -> int:
        return self.coordinates(global_rank)[1]

    def replicate_rank(self, global_rank: int) -> int:
        return self.coordinates(global_rank)[0]

    def pipeline_rank(self, global_rank: int) -> int:
        return self.coordinates(global_rank)[2]

    def tensor_rank(self, global_rank: int) -> int:
        return self._all_coordinates(global_rank)[3]

    def model_parallel_coordinates(self, global_rank: int) -> tuple[int, int]:
        """``(pipeline_rank, tensor_rank)``: which part of the model ``global_rank`` holds; the ranks sharing them
        are its data-parallel peers."""
        coordinates = self._all_coordinates(global_rank)
        return coordinates[2], coordinates[3]

    def group_ranks(self, axis: Axis, global_rank: int) -> list[int]:
        """The global ranks of ``global_rank``'s group along ``axis`` (the others' coordinates fixed), in order."""
        index = AXES.index(axis)
        coordinates = list(self._all_coordinates(global_rank))
        degrees = (self.replicate_size, self.shard_size, self.pipeline_parallel_size, self.tensor_parallel_size)
        ranks = []
        for value in range(degrees[index]):
            coordinates[index] = value
            ranks.append(self.global_rank(*coordinates))
        return ranks

    # ------------------------------------------------------------------ torch
    @property
    def axes(self) -> tuple[Axis, ...]:
        """The axes :meth:`build` names: :data:`AXES`, without ``tensor`` when its degree is 1 (a run without tensor
        parallelism builds the process groups it built before the axis existed)."""
        return AXES if self.tensor_parallel_size > 1 else AXES[:3]

    def build(self, device_type: str) -> DeviceMesh:
        """Collective: torch's ``DeviceMesh`` of this layout, with the axes :attr:`axes` (every rank, same order)."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.axes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
