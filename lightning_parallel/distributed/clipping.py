"""Clipping by a global gradient norm when the gradients are spread over ranks (ZeRO shards, pipeline stages).

One function for every strategy: each rank takes the norm of the gradients it holds with torch's
``get_total_norm``, the per-rank norms are combined over the process groups that split the gradients (the p-th
powers summed, or the maximum for ``inf``), and torch's ``clip_grads_with_norm_`` scales every gradient with that
norm. The result is ``torch.nn.utils.clip_grad_norm_`` over the whole model, as torchtitan's ``clip_grad_norm_``
over its device mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["clip_grad_norm_over_ranks_", "grad_norm_over_ranks", "norm_over_ranks"]


@torch.no_grad()
def grad_norm_over_ranks(
    parameters: Sequence[Tensor],
    *,
    norm_type: float = 2.0,
    groups: Sequence[dist.ProcessGroup | None] = (None,),
    device: torch.device,
) -> Tensor:
    """Collective over each of ``groups``. The ``norm_type`` norm of the gradients of ``parameters`` on all ranks,
    as if they were one vector (fp32; tensors without ``.grad`` count as none, as torch skips them).

    Args:
        parameters: this rank's tensors whose ``.grad`` is counted; every gradient element must be held by exactly
            one rank of the groups (disjoint shards, or one stage per pipeline rank).
        norm_type: any p > 0, or ``inf``.
        groups: the process groups that split the gradients, reduced over one after the other (``None``: the
            default group); a group of one rank is skipped.
        device: where the norm is computed and communicated (the backend's device).

    Raises:
        ValueError: for a ``norm_type`` that is neither positive nor ``inf`` (on every rank, before a collective).
    """
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    return norm_over_ranks(grads, norm_type=norm_type, groups=groups, device=device)


@torch.no_grad()
def norm_over_ranks(
    grads: Sequence[Tensor],
    *,
    norm_type: float = 2.0,
    groups: Sequence[dist.ProcessGroup | None] = (None,),
    device: torch.device,
) -> Tensor:
    """Collective over each of ``groups``: :func:`grad_norm_over_ranks` of the gradient tensors themselves (plain
    tensors; each element held by exactly one rank of the groups)."""
    norm_type = float(norm_type)
    if not (norm_type == math.inf or 0 < norm_type < math.inf):
        raise ValueError(f"`norm_type={norm_type!r}` cannot be combined over ranks: use a p > 0 or `inf`.")
    # 16-bit gradients are normed in fp32, as the reduction over ranks is (torch would round each norm to 16 bits).
    wide = [g for g in grads if g.dtype.itemsize >= 4]
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads if g.dtype.itemsize < 4]
    if wide:
        norms.append(torch.nn.utils.get_total_norm(wide, norm_type).to(device, torch.float32))
    local = torch.nn.utils.get_total_norm(norms, norm_type).to(device) if norms else torch.zeros((), device=device)
    is_max = norm_type == math.inf
    combined = local if is_max else local.pow(norm_type)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(combined, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM, group=group)
    return combined if is_max else combined.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_over_ranks_(
    parameters: Sequence[Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    groups: Sequence[dist.ProcessGroup | None] = (None,),
    device: torch.device,
    copies: Sequence[Tensor] = (),
) -> Tensor:
    """Collective. ``torch.nn.utils.clip_grad_norm_`` over the gradients that ``groups`` hold together; returns the
    global norm (:func:`grad_norm_over_ranks`, same arguments).

    ``copies``: tensors whose ``.grad`` is scaled like the others but left out of the norm, because another rank
    counts it (the copies of a tied parameter on several pipeline stages are counted once). The scaling is torch's
    ``clip_grads_with_norm_``: ``max_norm / (norm + 1e-6)`` clamped to 1.
    """
    total_norm = grad_norm_over_ranks(parameters, norm_type=norm_type, groups=groups, device=device)
    torch.nn.utils.clip_grads_with_norm_([*parameters, *copies], max_norm, total_norm)
    return total_norm
