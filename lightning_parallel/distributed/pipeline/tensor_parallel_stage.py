"""Tensor parallelism inside a pipeline stage: the model's plan applied to this rank's layers after the split.

Torch-only. The plan is resolved on the whole module (``distributed/tensor_parallel/plan.py``: its
``tensor_parallel_plan()`` or a Hugging Face model's own plan), then each rank splits only the layers it kept
(entries under another rank's layers, now :class:`~.remote_layer.RemoteLayer` placeholders, are left out) over the
``tensor`` axis (:func:`split_stage`). Every tensor rank of a stage holds the same layers, so the split is a
collective over the tensor group only. The stages exchange whole activations: the plans split a block's matrices
column-wise then row-wise, whose output is replicated over the tensor ranks; each tensor rank sends to the same
tensor rank of the next stage (``ParallelDims.pipeline_group``).

Clipping counts each gradient element once: a split weight's local shard on every tensor rank, a weight the plan
leaves whole (a norm's) on tensor rank 0 only (:meth:`StageTensorParallel.replicated_names`). A consolidated
checkpoint gathers each ``DTensor`` with ``full_tensor()`` before the stage's state leaves the rank
(``transfer.py``); the reassembly after the run first makes the stage's layers plain and whole again
(:meth:`StageTensorParallel.gather`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_parallel.distributed.pipeline.remote_layer import RemoteLayer
from lightning_parallel.distributed.tensor_parallel import TensorParallelPlan
from lightning_parallel.distributed.tensor_parallel.apply import parallelize

__all__ = ["StageTensorParallel", "place_optimizer_state", "placed_like_parameters", "split_stage"]


@dataclass(frozen=True)
class StageTensorParallel:
    """What :func:`split_stage` did to this rank's layers, to undo it in :meth:`gather`."""

    plan: TensorParallelPlan
    """The plan's entries this rank applied (its kept layers')."""
    hooks: tuple[tuple[nn.Module, tuple[int, ...], tuple[int, ...]], ...]
    """``(module, forward pre-hook ids, forward hook ids)`` the split added (torch's styles redistribute the inputs
    and outputs in hooks)."""

    def replicated_names(self, module: nn.Module, tensor_rank: int) -> frozenset[str]:
        """Names of ``module``'s parameters that every tensor rank holds whole: left out of the clipping norm on
        tensor ranks other than 0 (each element counted once); empty on tensor rank 0."""
        if tensor_rank == 0:
            return frozenset()
        return frozenset(
            name
            for name, param in module.named_parameters(remove_duplicate=False)
            if not isinstance(param, DTensor) or all(placement.is_replicate() for placement in param.placements)
        )

    @torch.no_grad()
    def gather(self, module: nn.Module) -> None:
        """Collective over the tensor group (its ranks hold the same layers, walked in the same order): every
        ``DTensor`` parameter and buffer of ``module`` replaced by its whole tensor (``full_tensor()``; a tied weight
        stays one parameter), the styles' hooks removed: the layers are plain again."""
        done: dict[int, nn.Parameter] = {}
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if isinstance(param, DTensor):
                    if id(param) not in done:
                        done[id(param)] = nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad)
                    owner._parameters[name] = done[id(param)]
            for name, buffer in list(owner._buffers.items()):
                if isinstance(buffer, DTensor):
                    owner._buffers[name] = buffer.full_tensor()
        for owner, pre_hooks, hooks in self.hooks:
            for key in pre_hooks:
                owner._forward_pre_hooks.pop(key, None)
                owner._forward_pre_hooks_with_kwargs.pop(key, None)
            for key in hooks:
                owner._forward_hooks.pop(key, None)
                owner._forward_hooks_with_kwargs.pop(key, None)


def placed_like_parameters(params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Local. ``grads`` with every ``DTensor`` gradient on its parameter's placements: the backward of a
    vocabulary-parallel embedding (and of a gathered LM head) can leave a split weight's gradient ``Replicate``d, whole
    on every tensor rank; the optimizer and the clipping norm need the parameter's own shard (a local slice, no
    communication)."""
    return [
        grad.redistribute(param.device_mesh, param.placements)
        if isinstance(grad, DTensor)
        and isinstance(param, DTensor)
        and tuple(grad.placements) != tuple(param.placements)
        else grad
        for param, grad in zip(params, grads, strict=True)
    ]


@torch.no_grad()
def place_optimizer_state(optimizer: Optimizer) -> None:
    """Local. The state of each split parameter loaded whole (a single-device checkpoint's moments) cut into the
    parameter's own slice (``distribute_tensor`` without a source rank: every rank slices its copy)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not isinstance(param, DTensor) or not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                    state[key] = distribute_tensor(
                        value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
                    )


def split_stage(module: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh) -> StageTensorParallel:
    """Collective over ``mesh`` (the ``tensor`` sub-mesh; its ranks hold the same stage, from the same weights).
    Split the layers of ``plan`` that this rank kept after the pipeline split; returns the record to undo it."""
    kept = {name: layer for name, layer in module.named_modules() if not isinstance(layer, RemoteLayer)}
    styles = {name: style for name, style in plan.styles.items() if name in kept and not _is_meta(kept[name])}
    local = replace(plan, styles=styles)
    before = {name: _hook_ids(kept[name]) for name in styles}
    parallelize(module, local, mesh)
    hooks = tuple(
        (
            kept[name],
            tuple(set(kept[name]._forward_pre_hooks) - before[name][0]),
            tuple(set(kept[name]._forward_hooks) - before[name][1]),
        )
        for name in styles
    )
    return StageTensorParallel(local, hooks)


def _hook_ids(layer: nn.Module) -> tuple[set[int], set[int]]:
    return set(layer._forward_pre_hooks), set(layer._forward_hooks)


def _is_meta(layer: nn.Module) -> bool:
    return any(tensor.is_meta for tensor in layer.parameters())
