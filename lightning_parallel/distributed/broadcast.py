"""Rank 0's initial weights on every rank, for ZeRO-3 and the pipeline (stages 1-2 and DDP use Lightning's).

Under the re-launching start method each rank builds its own module; one built without a common seed (or with
weights loaded on rank 0 only) differs per rank, and sharding or splitting it as it is would train a mix of the
ranks' models: a model that exists nowhere. DDP and ZeRO-1/2 broadcast rank 0's weights for the same reason, with
Lightning's ``_sync_module_states`` (torch's ``torch.distributed.utils._sync_module_states``, a coalesced
broadcast). That one does not fit here: it sends every tensor as it lies, so under NCCL the whole module would have
to be on the GPU first (the pipeline broadcasts the whole model, still on the CPU, before its split; ZeRO-3 before
sharding), and it cannot skip meta tensors (ZeRO-3 initialises those shards itself) or already sharded ``DTensor``
parameters (a second ``fit``).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["broadcast_from_rank0"]


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, device: torch.device) -> None:
    """Collective over the default group. Every materialised parameter and buffer of ``module`` takes global rank
    0's value, one tensor at a time through ``device`` (the device the backend communicates from: the rank's GPU for
    NCCL), so at most one tensor's copy is on it at once.

    Meta tensors are skipped (every rank skips the same ones): ZeRO-3's ``materialize_meta_module`` initialises their
    shards from a seed drawn on rank 0, so those values do not depend on the other ranks' seeds either. ``DTensor``
    parameters (already sharded, a second ``fit``) are skipped. A tensor registered twice (tied) is sent once.
    """
    seen: set[int] = set()
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_meta or isinstance(tensor, DTensor) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        on_device = tensor.detach() if tensor.device == device else tensor.detach().to(device)
        dist.broadcast(on_device, src=0)
        if on_device.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(on_device)
