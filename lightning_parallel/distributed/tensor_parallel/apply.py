"""Split a module's layers over the ``tensor`` axis of the mesh: torch's ``parallelize_module`` with a resolved plan.

torchtitan's order, which ZeRO-3 follows: tensor parallelism first, on the ``tensor`` sub-mesh (each split weight
becomes a ``DTensor`` sharded over it), then FSDP2's ``fully_shard`` on the data axes of the same mesh, which shards
those ``DTensor``s again on dim 0 (a weight then has the placements ``(Shard(0), Shard(d))`` on
``("shard", "tensor")``). Every rank of a tensor-parallel group must read the same batch.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_parallel.distributed.broadcast import broadcast_from_rank0
from lightning_parallel.distributed.tensor_parallel.plan import TensorParallelPlan, check_divisible
from lightning_parallel.distributed.tensor_parallel.whole import is_split, record_style_hooks

__all__ = ["apply_tensor_parallel", "is_tensor_parallel", "parallelize"]


def apply_tensor_parallel(module: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh, device: torch.device) -> None:
    """Collective over the default group (every rank, same plan): start from global rank 0's weights (broadcast
    through ``device``), then split ``module``'s layers over ``mesh`` (the ``tensor`` sub-mesh) as ``plan`` says
    (each split weight is sliced from the mesh's first rank's copy, torch's ``distribute_tensor``). Idempotent: a
    module already split (a second ``fit``) is left alone. Weights tied between layers (an embedding and the LM head)
    stay tied: the second layer takes the first one's split parameter, when both split it the same way (else
    ``ValueError``)."""
    if is_tensor_parallel(module):
        return
    if any(param.is_meta for param in module.parameters()):
        raise ValueError(
            "Tensor parallelism splits weights that exist: this module has parameters on the meta device (created"
            " under `trainer.init_module(empty_init=True)`). Create it without `empty_init` when using"
            " `tensor_parallel_size`."
        )
    check_divisible(module, plan, mesh.size())
    broadcast_from_rank0(module, device)
    parallelize(module, plan, mesh)


def parallelize(module: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh) -> None:
    """Collective over ``mesh`` (the ``tensor`` sub-mesh; its ranks hold the same weights already). Split
    ``module``'s layers as ``plan`` says, tied weights kept tied (see :func:`apply_tensor_parallel`)."""
    check_divisible(module, plan, mesh.size())
    ties = _tied_parameters(module)
    record_style_hooks(module, lambda: parallelize_module(module, mesh, plan.styles))  # `whole_layers` lifts them
    _retie(module, ties)


def is_tensor_parallel(module: nn.Module) -> bool:
    """Whether a parameter of ``module`` is split over a mesh with a ``tensor`` axis."""
    return any(is_split(param) for param in module.parameters())


def _tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The ``(owner, attribute)`` places of each parameter registered more than once."""
    places: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for owner in module.modules():
        for attribute, param in owner.named_parameters(recurse=False):
            places[id(param)].append((owner, attribute))
    return [group for group in places.values() if len(group) > 1]


@torch.no_grad()
def _retie(module: nn.Module, ties: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every place of a tied weight at the first place's parameter as it is after the split."""
    for places in ties:
        first_owner, first_attribute = places[0]
        kept = getattr(first_owner, first_attribute)
        for owner, attribute in places[1:]:
            other = getattr(owner, attribute)
            if other is kept:
                continue
            if _placements(other) != _placements(kept):
                raise ValueError(
                    f"The tensor-parallel plan splits a tied weight two ways ({type(first_owner).__name__}."
                    f"{first_attribute}: {_placements(kept)}, {type(owner).__name__}.{attribute}:"
                    f" {_placements(other)}): give both layers styles that split it on the same dimension (e.g."
                    " `embedding_rowwise` and `colwise`/`colwise_gather_output` for an embedding tied to the LM head)."
                )
            owner.register_parameter(attribute, kept)


def _placements(param: nn.Parameter) -> tuple[object, ...]:
    return tuple(param.placements) if isinstance(param, DTensor) else ()
