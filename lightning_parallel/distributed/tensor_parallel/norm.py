"""Clipping by the global gradient norm when the gradients are ``DTensor``s on several meshes.

Under tensor parallelism with ZeRO-3 a split weight's gradient lives on the ``("shard", "tensor")`` mesh and a weight
the plan leaves whole (a norm's) on the ``"shard"`` mesh alone, replicated over the tensor ranks. torch's
``clip_grad_norm_`` stacks the per-parameter norms, which refuses ``DTensor``s of different meshes (torchtitan clips
such models with its own function). Here each rank takes the norm of its local pieces that it is the first holder of
(rank 0 on every axis of the strategy's mesh that does not shard the gradient), and the p-th powers are summed over
every rank (:func:`~lightning_parallel.distributed.clipping.norm_over_ranks`): each element counted exactly once.

Under ZeRO-1/2 the optimizer steps flat pieces of each parameter's local tensor (``distributed/zero/buckets.py``), no
longer ``DTensor``s: :func:`counted_once` sorts those pieces by their parameter, a split weight's counted on every
tensor rank (each holds other elements), a weight the plan leaves whole on tensor rank 0 only, and the norm is summed
over the data (shard) group and the :class:`TensorAxis`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_parallel.distributed.clipping import norm_over_ranks
from lightning_parallel.distributed.tensor_parallel.apply import is_tensor_parallel

__all__ = ["TensorAxis", "clip_grad_norm_of_placed_", "counted_once", "is_split", "tensor_axis_of"]


@dataclass(frozen=True)
class TensorAxis:
    """This rank's place on the mesh's ``tensor`` axis."""

    group: Any
    """The process group of the tensor ranks holding the other slices of this rank's split weights."""
    rank: int
    """This rank's coordinate on the axis."""


def tensor_axis_of(mesh: DeviceMesh | None, module: nn.Module) -> TensorAxis | None:
    """Local. The ``tensor`` axis of ``mesh`` when ``module``'s layers are split over it, else ``None``."""
    if mesh is None or not is_tensor_parallel(module):
        return None
    return TensorAxis(group=mesh.get_group("tensor"), rank=mesh.get_local_rank("tensor"))


def is_split(param: Tensor) -> bool:
    """Whether ``param`` is a ``DTensor`` whose tensor ranks hold different elements (not replicated on every axis)."""
    return isinstance(param, DTensor) and not all(placement.is_replicate() for placement in param.placements)


def counted_once(pieces: Iterable[tuple[Tensor, Tensor]], *, tensor_rank: int) -> tuple[list[Tensor], list[Tensor]]:
    """Local. ``(counted, copies)`` of the ``(parameter, piece)`` pairs: a split parameter's piece is counted on every
    tensor rank, a whole one's on tensor rank 0 only (elsewhere a copy: scaled, not counted)."""
    counted: list[Tensor] = []
    copies: list[Tensor] = []
    for param, piece in pieces:
        (counted if tensor_rank == 0 or is_split(param) else copies).append(piece)
    return counted, copies


def _counted_here(grad: Tensor, mesh: DeviceMesh) -> bool:
    """Whether this rank counts ``grad``'s local piece: the ranks holding the same piece differ only on the axes of
    ``mesh`` that do not shard ``grad`` (replicated on them, or absent from its sub-mesh), and the one at 0 on each of
    them counts it. A plain tensor is replicated everywhere: counted by the mesh's first rank."""
    sharding: set[str] = set()
    if isinstance(grad, DTensor):
        assert not any(placement.is_partial() for placement in grad.placements), "gradients are reduced first"
        names = grad.device_mesh.mesh_dim_names or ()
        # Not `is_shard()`: FSDP2's dim-0 shard of a tensor-parallel weight is a `_StridedShard`, which says False.
        sharding = {names[dim] for dim, placement in enumerate(grad.placements) if not placement.is_replicate()}
    return all(mesh.get_local_rank(axis) == 0 for axis in mesh.mesh_dim_names or () if axis not in sharding)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def clip_grad_norm_of_placed_(
    parameters: Sequence[Tensor], max_norm: float, *, mesh: DeviceMesh, norm_type: float = 2.0, device: torch.device
) -> Tensor:
    """Collective over the default group (every rank). ``torch.nn.utils.clip_grad_norm_`` over ``parameters`` whose
    gradients are ``DTensor``s on sub-meshes of ``mesh`` (the strategy's, spanning the world, its axes named);
    returns the global norm. The scaling is torch's: ``max_norm / (norm + 1e-6)`` clamped to 1, applied to each local
    piece."""
    grads = [param.grad for param in parameters if param.grad is not None]
    counted = [_local(grad).detach() for grad in grads if _counted_here(grad, mesh)]
    total = norm_over_ranks(counted, norm_type=norm_type, groups=(None,), device=device)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        local = _local(grad)
        local.mul_(scale.to(local.device, local.dtype))
    return total
