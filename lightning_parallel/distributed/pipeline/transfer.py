"""Moving a stage's state between pipeline ranks one tensor at a time, assembled on the host.

Torch-only. A consolidated checkpoint gathers every stage's state onto pipeline rank 0, and the reassembly after a
run gives every rank every layer; both move whole stages between ranks whose accelerators hold only their own stage.
An object collective (``gather_object``, ``broadcast_object_list``) would pickle the tensors into byte buffers on the
group's device, all of them at once: over NCCL, pipeline size x the largest stage on rank 0's GPU (torch documents
the object collectives as using ``torch.cuda.current_device()`` there). So here only the structure travels as an
object (names, shapes, dtypes, plain values; no tensor), and each tensor goes by itself through the device the group
communicates on, one rank after the other: the sender copies it into a buffer there, every other rank receives it
into a buffer there and, where it keeps it, copies it to its host before the next tensor. The device holds one tensor
in flight; the host holds what is assembled. torch's own consolidation works alike (``torch.distributed.checkpoint``'s
``get_model_state_dict`` with ``full_state_dict`` and ``cpu_offload``: one ``full_tensor()`` at a time, moved to the
CPU), as does ZeRO's (``distributed/zero/optimizer.py``: one gathered bucket at a time, through :func:`host_copy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_parallel.distributed.checkpoint import host_copy
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims

__all__ = ["Flattened", "TensorSlot", "broadcast_tensor", "flatten_tensors", "gather_to_pipeline_root"]


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor stood in a structure sent without its tensors."""

    index: int
    """Position of the tensor in :attr:`Flattened.tensors` (the same tensor twice: one slot)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool = True
    """Whether the tensor was on the host (a loader's batch comes back where it was)."""


@dataclass(frozen=True)
class Flattened:
    """A nested value split into its structure (what an object collective may carry) and its tensors."""

    structure: Any
    """The value with every tensor replaced by its :class:`TensorSlot`."""
    slots: list[TensorSlot]
    """One per tensor, in :attr:`tensors` order."""
    tensors: list[Tensor]

    def without_tensors(self) -> Flattened:
        """What another rank needs to receive the tensors: the structure and the slots."""
        return Flattened(self.structure, self.slots, [])

    def fill(self, tensors: list[Tensor]) -> Any:
        """The structure with each slot replaced by ``tensors[slot.index]``."""
        return apply_to_collection(self.structure, TensorSlot, lambda slot: tensors[slot.index], allow_frozen=True)


def flatten_tensors(value: Any) -> Flattened:
    """Local. ``value`` (nested dicts, lists, tuples, namedtuples, mappings, dataclasses: what Lightning walks in a
    batch) split into its structure and its tensors."""
    tensors: list[Tensor] = []
    slots: list[TensorSlot] = []
    index_of: dict[int, int] = {}

    def slot(tensor: Tensor) -> TensorSlot:
        if id(tensor) not in index_of:
            index_of[id(tensor)] = len(tensors)
            tensors.append(tensor)
            slots.append(TensorSlot(len(slots), tuple(tensor.shape), tensor.dtype, tensor.device.type == "cpu"))
        return slots[index_of[id(tensor)]]

    structure = apply_to_collection(value, Tensor, slot, allow_frozen=True)
    return Flattened(structure, slots, tensors)


def broadcast_tensor(
    tensor: Tensor | None,
    *,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    src: int,
    group: Any,
    device: torch.device,
    keep: bool,
) -> Tensor | None:
    """Collective over ``group``. ``tensor`` (given on global rank ``src`` only, ``None`` elsewhere) on every rank of
    ``group``, through ``device`` (the device the group's backend takes tensors on: NCCL's GPU, gloo's CPU).

    Every rank holds one buffer of ``shape`` and ``dtype`` on ``device`` for the length of the call: ``src`` copies
    ``tensor`` into it (from the host or the device), the others receive into it. Returns a host copy of the received
    tensor where ``keep`` (``None`` on ``src`` and where not kept); the buffer is dropped either way.
    """
    buffer = torch.empty(shape, dtype=dtype, device=device)
    if tensor is not None:
        buffer.copy_(tensor.detach())
    dist.broadcast(buffer, src=src, group=group)
    return host_copy(buffer) if keep and tensor is None else None


def gather_to_pipeline_root(value: Any, dims: ParallelDims) -> list[Any] | None:
    """Collective over the pipeline group (and the tensor group: ``DTensor``s are gathered whole first). ``value`` of
    every pipeline rank of this replica, in pipeline-rank order, on pipeline rank 0 with every tensor a host copy
    (``None`` elsewhere).

    ``value`` holds tensors anywhere (the device, the host) in nested dicts, lists, tuples and dataclasses. The
    structures go in one ``all_gather_object`` (no tensor in it); then rank 1's tensors one at a time
    (:func:`broadcast_tensor` over the pipeline group, through :attr:`ParallelDims.device`), rank 2's, and so on:
    pipeline rank 0 copies each to its host as it arrives, so no accelerator holds more than one tensor beyond what
    training holds. (A broadcast rather than a send: it runs on the group's own communicator, where point-to-point
    pairs of ranks that are not neighbours would each open one more; the other ranks drop what they receive.)
    """
    # Tensor parallelism: each split tensor whole first (a collective over the tensor group, whose ranks hold the same
    # stage and walk the same structure), as torch's consolidation gathers a `DTensor` (`full_tensor()`).
    value = apply_to_collection(value, DTensor, DTensor.full_tensor)
    own = apply_to_collection(value, Tensor, host_copy) if dims.pipeline_rank == 0 else None
    if dims.pipeline_parallel_size == 1:
        return [own]
    flat = flatten_tensors(value)
    structures: list[Any] = [None] * dims.pipeline_parallel_size
    dist.all_gather_object(structures, flat.without_tensors(), group=dims.pipeline_group)
    gathered: list[Any] | None = [own] if dims.pipeline_rank == 0 else None
    for rank in range(1, dims.pipeline_parallel_size):
        sender: Flattened = structures[rank]
        received: list[Any] = []
        for slot in sender.slots:
            mine = flat.tensors[slot.index] if rank == dims.pipeline_rank else None
            received.append(
                broadcast_tensor(
                    mine,
                    shape=slot.shape,
                    dtype=slot.dtype,
                    src=dims.pipeline_global_rank(rank),
                    group=dims.pipeline_group,
                    device=dims.device,
                    keep=gathered is not None,
                )
            )
        if gathered is not None:
            gathered.append(sender.fill(received))
    return gathered
