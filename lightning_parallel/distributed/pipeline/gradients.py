"""Gradient operations across the ranks of a pipeline: replica averaging and clipping by the global norm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.accounting import CommunicationStats

__all__ = ["average_across_replicas", "clip_by_global_norm"]


def average_across_replicas(
    grads: Sequence[Tensor], *, group: Any, size: int, stats: CommunicationStats | None = None
) -> None:
    """Average ``grads`` in place over the data-parallel replicas of a stage (one flat all-reduce, counted in
    ``stats`` when given)."""
    if size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if stats is not None:
        stats.record("all_reduce", flat.numel() * flat.element_size())
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_by_global_norm(
    grads: Sequence[Tensor],
    max_norm: float,
    *,
    group: Any,
    device: torch.device,
    copies: Sequence[Tensor] = (),
    shard_group: Any = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the gradients of every stage; returns the global norm.

    Each rank sums the squares of its stage's gradients; one all-reduce over the pipeline gives the global norm
    (replicas of a stage hold equal, already averaged gradients, so the pipeline group suffices). The scaling is
    torch's: ``max_norm / (norm + 1e-6)`` clamped to 1. ``copies`` are gradients of tied-parameter copies that
    another rank counts: scaled like the others, left out of the norm, so a tied parameter is counted once.
    ``shard_group``: the replicas of a stage hold disjoint shards of its gradients (ZeRO inside the pipeline), so
    their squares are summed over this group first, then over ``group``.
    """
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares += g.detach().float().pow(2).sum()
    for over in (shard_group, group):
        if over is not None and dist.get_world_size(over) > 1:
            dist.all_reduce(squares, group=over)
    norm = squares.sqrt()
    clip_coef = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)
    for g in [*grads, *copies]:
        g.detach().mul_(clip_coef.to(g.dtype))
    return norm
