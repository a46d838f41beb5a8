"""A pipeline rank's view of the shared device mesh: its coordinates and the process groups a split needs.

Torch-only. :class:`ParallelDims` is frozen: its mesh arithmetic
(:class:`~lightning_parallel.distributed.mesh.MeshLayout`) is computed once, at construction, and
:meth:`ParallelDims.with_groups` returns a copy holding a new mesh. :func:`build_parallel_dims` makes a rank's
dims on the pipeline's mesh (:func:`pipeline_mesh_layout`), a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.distributed.zero.config import ZeroConfig

__all__ = ["ParallelDims", "build_parallel_dims", "pipeline_mesh_layout"]


@dataclass(frozen=True)
class ParallelDims:
    """A pipeline rank's view of the shared mesh (``distributed/mesh.py``): ``replicate x shard x pp (x tensor)``
    ranks, the pipeline ranks of a replica adjacent (each with its ``tensor`` ranks innermost), the data-parallel
    replicas of each stage on the mesh's data axes (``replicate``, and ``shard`` where ZeRO shards the stage over
    them).

    ``global_rank = (data_parallel_rank * pipeline_parallel_size + pipeline_rank) * tensor_parallel_size +
    tensor_rank``. With tensor parallelism, :attr:`pipeline_group` holds the ranks of this rank's tensor rank: every
    tensor rank of a stage exchanges the (whole) activations with the same tensor rank of the next stage.
    """

    world_size: int
    global_rank: int
    pipeline_parallel_size: int
    shard_size: int = 1
    """Ranks of the ``shard`` axis: the replicas of a stage that ZeRO shards it over (1 without ZeRO)."""
    tensor_parallel_size: int = 1
    """Ranks of the ``tensor`` axis: the ranks splitting each layer of a stage (1: no tensor parallelism)."""
    mesh: DeviceMesh | None = field(default=None, repr=False)
    """The strategy's mesh, axes ``("replicate", "shard", "pp")`` (and ``"tensor"`` with tensor parallelism); with
    both data axes larger than one also the flattened ``"dp"`` axis, with tensor parallelism in a pipeline the
    flattened ``"pp_tensor"`` axis (:meth:`flatten_data_axes`); ``None`` until :meth:`with_groups` built one or the
    strategy handed its own."""
    host_data_parallel_group: Any = field(default=None, repr=False)
    """A CPU (gloo) group of :attr:`data_parallel_group`'s ranks (``HostGroups.data_parallel``), for the per-step
    agreements on host facts (ZeRO's "got a gradient" flags) with no device sync; ``None``: they go over the device."""
    layout: MeshLayout = field(init=False, repr=False, compare=False)
    """The degrees and coordinates of the mesh (computed once, from the counts above)."""

    def __post_init__(self) -> None:
        layout = MeshLayout(
            self.world_size,
            shard_size=self.shard_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            tensor_parallel_size=self.tensor_parallel_size,
        )
        object.__setattr__(self, "layout", layout)  # frozen: set once, here

    @property
    def pipeline_group(self) -> Any:
        """Process group of this rank's pipeline (the ranks of one replica): the mesh's ``"pp"`` axis."""
        return self._mesh().get_group("pp")

    @property
    def tensor_group(self) -> Any:
        """Process group of the ranks splitting this rank's layers: the mesh's ``"tensor"`` axis (``None`` without
        tensor parallelism)."""
        return self._mesh().get_group("tensor") if self.tensor_parallel_size > 1 else None

    @property
    def tensor_rank(self) -> int:
        return self.layout.tensor_rank(self.global_rank)

    @property
    def data_parallel_group(self) -> Any:
        """Process group of every data-parallel replica of this rank's stages: the mesh's ``"replicate"`` or
        ``"shard"`` axis, whichever holds them (both: the flattened ``"dp"`` axis)."""
        layout = self.layout
        if layout.shard_size == 1:
            return self._mesh().get_group("replicate")
        if layout.replicate_size == 1:
            return self._mesh().get_group("shard")
        return self._mesh()["dp"].get_group()

    def flatten_data_axes(self) -> None:
        """Collective (every rank, once, after the mesh is set): with both data axes larger than one, create the
        flattened ``"dp"`` axis :attr:`data_parallel_group` returns (a process group of its own); with tensor
        parallelism in a pipeline, the flattened ``"pp_tensor"`` axis :attr:`replica_group` returns."""
        if self.layout.is_hybrid:
            self._mesh()["replicate", "shard"]._flatten("dp")  # torchtitan's way; no public API in torch 2.13
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            self._mesh()["pp", "tensor"]._flatten("pp_tensor")  # the replica's ranks: `replica_group`

    @property
    def replica_group(self) -> Any:
        """Process group of every rank of this rank's pipeline replica: :attr:`pipeline_group`, with tensor
        parallelism also every tensor rank of each stage (they all train on one batch: ``replica_batches.py``)."""
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            return self._mesh()["pp_tensor"].get_group()
        return self.pipeline_group if self.tensor_parallel_size == 1 else self.tensor_group

    def replica_source(self, pipeline_rank: int) -> int:
        """Global rank of ``pipeline_rank`` at tensor rank 0 in this rank's replica (whose batch the replica reads)."""
        return (self.data_parallel_rank * self.pipeline_parallel_size + pipeline_rank) * self.tensor_parallel_size

    @property
    def device(self) -> torch.device:
        """The device this rank's groups take tensors on: the mesh's device type at the current index (this rank's
        GPU under NCCL, the one torch's object collectives use), the CPU under gloo."""
        device_type = self._mesh().device_type
        if device_type == "cpu":
            return torch.device("cpu")
        return torch.device(device_type, torch.get_device_module(device_type).current_device())

    def _mesh(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError("`ParallelDims` has no process groups before `with_groups` (a collective) built them.")
        return self.mesh

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def pipeline_rank(self) -> int:
        return self.layout.pipeline_rank(self.global_rank)

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.data_parallel_rank(self.global_rank)

    def pipeline_global_rank(self, pipeline_rank: int) -> int:
        """Global rank of ``pipeline_rank`` in this rank's replica (at this rank's tensor rank)."""
        return (self.data_parallel_rank * self.pipeline_parallel_size + pipeline_rank) * self.tensor_parallel_size + (
            self.tensor_rank
        )

    def with_groups(self, device_type: str) -> ParallelDims:
        """Collective: a copy holding a new mesh and its process groups, created on every rank in the same order (a
        strategy hands its own ``device_mesh`` instead)."""
        return replace(self, mesh=self.layout.build(device_type))


def pipeline_mesh_layout(
    world_size: int,
    *,
    pipeline_parallel_size: int,
    zero_config: ZeroConfig | None = None,
    tensor_parallel_size: int = 1,
) -> MeshLayout:
    """``replicate x shard x pp (x tensor)``: the data-parallel replicas of each stage on the ``replicate`` axis, or
    with ZeRO on the ``shard`` axis (``zero_config.shard_size`` of them, the rest on ``replicate``: hybrid sharding);
    ``tensor_parallel_size`` ranks split each stage's layers (innermost)."""
    p, t = pipeline_parallel_size, tensor_parallel_size
    if zero_config is None or world_size % (p * t):
        return MeshLayout(world_size, pipeline_parallel_size=p, tensor_parallel_size=t)
    shard_size = zero_config.shard_size or world_size // (p * t)
    return MeshLayout(world_size, shard_size=shard_size, pipeline_parallel_size=p, tensor_parallel_size=t)


def build_parallel_dims(
    world_size: int,
    global_rank: int,
    *,
    pipeline_parallel_size: int,
    zero_config: ZeroConfig | None = None,
    tensor_parallel_size: int = 1,
    mesh: DeviceMesh | None = None,
    device_type: str = "cpu",
    host_data_parallel_group: Any = None,
) -> ParallelDims:
    """Collective (every rank, once). This rank's :class:`~.parallel_dims.ParallelDims` on ``mesh`` (the
    :func:`pipeline_mesh_layout`'s, built on ``device_type`` when not given) with the groups a split needs
    (``host_data_parallel_group``: see :attr:`~.parallel_dims.ParallelDims.host_data_parallel_group`)."""
    layout = pipeline_mesh_layout(
        world_size,
        pipeline_parallel_size=pipeline_parallel_size,
        zero_config=zero_config,
        tensor_parallel_size=tensor_parallel_size,
    )
    dims = ParallelDims(
        world_size,
        global_rank,
        pipeline_parallel_size,
        shard_size=layout.shard_size,
        tensor_parallel_size=tensor_parallel_size,
        mesh=mesh,
        host_data_parallel_group=host_data_parallel_group,
    )
    if mesh is None:
        dims = dims.with_groups(device_type)
    dims.flatten_data_axes()  # hybrid sharding: one group of every replica of the stage (a collective)
    return dims
