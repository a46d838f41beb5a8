"""A split parameter's local shard: what ZeRO-1/2's flat buckets hold of a tensor-parallel weight.

Under ``ShardedOptimizerStrategy(stage=1 or 2, tensor_parallel_size=T)`` the plan first splits the layers over the
mesh's ``tensor`` axis (each split weight a ``DTensor`` on the ``tensor`` sub-mesh, :mod:`.apply`); the flat buckets
(``distributed/zero/buckets.py``) then hold each parameter's *local* tensor (for a ``DTensor``, the tensor it wraps,
whose ``.data`` is pointed into the bucket as a plain parameter's is) and shard the buckets over the data axes only.
The functions here are the few places where a bucket meets a ``DTensor``: the local tensor of a parameter or of its
gradient, a bucket slice given back as the parameter's gradient, and the whole tensor over the tensor ranks (what a
checkpoint holds and a hook reads: the single-device values) and the way back. A plain parameter passes through all
of them unchanged.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_parallel.distributed.zero.stage3_compat import wrapped_local_tensor

__all__ = ["as_placed", "local_gradient_of", "local_piece", "local_tensor", "whole_tensor"]


def local_tensor(tensor: Tensor) -> Tensor:
    """Local. ``tensor`` itself, or a ``DTensor``'s local tensor: the very tensor it wraps, not a view
    (:func:`~.stage3_compat.wrapped_local_tensor`), so that setting its ``.data`` moves the parameter's storage."""
    return wrapped_local_tensor(tensor) if isinstance(tensor, DTensor) else tensor


def local_gradient_of(param: Tensor) -> Tensor | None:
    """The local tensor of ``param.grad`` on ``param``'s placements: the backward of a vocabulary-parallel embedding
    (or of a gathered LM head) can leave a split weight's gradient ``Replicate``d, whole on every tensor rank; the
    bucket holds the parameter's own slice of it (a local slice, no communication; a gradient left ``Partial`` would
    be summed over the tensor ranks, every rank reaching the same parameter in the same backward order)."""
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return None if grad is None else local_tensor(grad)


def as_placed(param: Tensor, piece: Tensor) -> Tensor:
    """Local. ``piece`` (a flat bucket slice of ``param``'s local numel) in ``param``'s local shape, wrapped as a
    ``DTensor`` of ``param``'s mesh and placements when ``param`` is one (so it can be ``param.grad``); the same
    storage either way."""
    local = piece.view(local_tensor(param).shape)
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def whole_tensor(param: Tensor, local: Tensor) -> Tensor:
    """Collective over ``param``'s mesh when it is a ``DTensor`` (every rank of it, the same parameters in the same
    order), else local. ``local`` (``param``'s local numel, flat or in its local shape: a gradient, an optimizer
    moment, a master weight) gathered whole over the tensor ranks, as one device holds it; on ``local``'s device."""
    if not isinstance(param, DTensor):
        return local.view(param.shape)
    own = local_tensor(param)
    placed = DTensor.from_local(
        local.to(own.device).view(own.shape),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    return placed.full_tensor().to(local.device)


def local_piece(param: Tensor, whole: Tensor) -> Tensor:
    """Local. This rank's slice of ``whole`` (a tensor of ``param``'s whole shape, the same on every tensor rank: a
    single-device checkpoint's moment, a gradient a hook set), in ``param``'s local shape (``distribute_tensor``
    without a source rank: every rank slices its own copy, no communication). ``whole`` itself for a plain
    parameter."""
    if not isinstance(param, DTensor):
        return whole
    device = local_tensor(param).device
    return distribute_tensor(whole.to(device), param.device_mesh, param.placements, src_data_rank=None).to_local()
