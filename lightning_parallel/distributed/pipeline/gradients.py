"""Gradient operations across the ranks of a pipeline: replica averaging (clipping: :mod:`..clipping`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.accounting import CommunicationStats

__all__ = ["average_across_replicas"]


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
