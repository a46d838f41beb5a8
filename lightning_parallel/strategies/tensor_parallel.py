"""The strategies' side of tensor parallelism (``distributed/tensor_parallel/``): the option checked in ``__init__``,
the plan resolved and checked before the processes join, the module split in ``setup``.

``ShardedOptimizerStrategy(tensor_parallel_size=T)`` takes it (TP inside, ZeRO-1/2/3 over the data axes);
``PipelineParallelStrategy(tensor_parallel_size=T)`` splits each stage's layers (with the stage's ZeRO over its
replicas, every ``zero_stage``); ``DataParallelStrategy`` refuses it naming those strategies
(:func:`refuse_tensor_parallel`). docs/tensor_parallel.md.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.distributed.mesh import validate_tensor_parallel_size
from lightning_parallel.distributed.tensor_parallel import (
    TensorParallelPlan,
    apply_tensor_parallel,
    check_divisible,
    resolve_plan,
)

__all__ = [
    "TAKEN_BY",
    "check_plan_early",
    "refuse_tensor_parallel",
    "split_module",
    "tensor_parallel_plan",
]

TAKEN_BY = (
    "`ShardedOptimizerStrategy(tensor_parallel_size=...)` or `PipelineParallelStrategy(tensor_parallel_size=...)`"
)
"""The strategies that take ``tensor_parallel_size``, as refusals name them."""


def refuse_tensor_parallel(tensor_parallel_size: object, *, owner: str) -> None:
    """Local, in ``__init__``: ``owner`` takes no tensor parallelism; ``ValueError`` naming the strategies that do
    unless ``tensor_parallel_size`` is 1."""
    validate_tensor_parallel_size(tensor_parallel_size)
    if tensor_parallel_size != 1:
        raise ValueError(
            f"`{owner}` does not split layers: `tensor_parallel_size={tensor_parallel_size}` is taken by {TAKEN_BY}."
            " Use one of those strategies, or drop the argument."
        )


def tensor_parallel_plan(module: nn.Module, tensor_parallel_size: int, *, owner: str) -> TensorParallelPlan | None:
    """Local. ``module``'s resolved plan (:func:`~lightning_parallel.distributed.tensor_parallel.resolve_plan`), or
    ``None`` when ``tensor_parallel_size`` is 1."""
    return resolve_plan(module, owner=owner) if tensor_parallel_size > 1 else None


def check_plan_early(module: nn.Module | None, tensor_parallel_size: int, *, owner: str) -> None:
    """Local, on every rank before the process group is joined: the plan of a module that already has its weights
    exists, names existing layers and splits whole heads (``ValueError`` otherwise). A module that creates its
    layers in ``configure_model`` is checked in ``setup`` instead (:func:`split_module`)."""
    if tensor_parallel_size == 1 or module is None or not any(True for _ in module.parameters()):
        return
    check_divisible(module, resolve_plan(module, owner=owner), tensor_parallel_size)


def split_module(module: nn.Module, mesh: DeviceMesh, device: torch.device, *, owner: str) -> TensorParallelPlan:
    """Collective (every rank): split ``module``'s layers over ``mesh``'s ``tensor`` axis from rank 0's weights."""
    plan = resolve_plan(module, owner=owner)
    apply_tensor_parallel(module, plan, mesh["tensor"], device)
    return plan
