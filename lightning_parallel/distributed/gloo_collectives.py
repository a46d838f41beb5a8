"""An all-gather for gloo built from one broadcast per rank: the same result, about a third of the time.

Why our own, not ``all_gather_into_tensor``: gloo's all-gather is slow on CPU. Measured on this project's machine
(2 CPU cores, torch 2.13, gloo, 20.5M fp32 elements gathered, i.e. ZeRO-1/2's parameter all-gather of the 20.5M GPT;
medians of 5): 2 ranks, alone 84.6 ms for ``all_gather_into_tensor`` against 27.3 ms for one async broadcast from
each rank (CPU time per rank 64-71 ms against 17-19 ms), beside a fixed amount of compute 191.7 ms against 142.4 ms;
4 ranks, alone 164.3 against 74.7 ms, beside compute 281.9 against 183.2 ms. Each rank's slice is still sent once
to every other rank, so the bytes on the wire do not change and the ledgers keep counting it as an all-gather.
NCCL's all-gather is what NCCL does best: keep it there (:func:`default_parameter_gather`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

import torch.distributed as dist
from torch import Tensor

__all__ = ["ParameterGather", "WorkGroup", "all_gather_by_broadcasts", "default_parameter_gather"]

ParameterGather = Literal["all_gather", "broadcasts"]


def default_parameter_gather(group: dist.ProcessGroup | None) -> ParameterGather:
    """The faster way to all-gather parameter shards on ``group``'s backend: one broadcast per rank on gloo."""
    return "broadcasts" if dist.get_backend(group) == "gloo" else "all_gather"


class WorkGroup(dist.Work):
    """Several collectives' ``Work`` as one: :meth:`wait` waits for each, :meth:`is_completed` when all are.

    A ``dist.Work`` subclass, so that code that checks ``isinstance(work, dist.Work)`` before waiting (FSDP2) waits.
    """

    def __init__(self, works: Sequence[dist.Work]) -> None:
        super().__init__()
        self.works = list(works)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def all_gather_by_broadcasts(output: Tensor, group: dist.ProcessGroup | None) -> WorkGroup:
    """Collective (asynchronous). In place: ``output`` is the group's ``size`` equal slices, this rank's slice
    already holding its shard; rank ``i`` of the group broadcasts slice ``i`` to every other rank. Until the returned
    work completes, the other slices are stale. Every rank launches the same broadcasts in the same order."""
    size = dist.get_world_size(group)
    if output.numel() % size:
        raise ValueError(f"all_gather_by_broadcasts: {output.numel()} elements do not split into {size} slices.")
    slices = output.view(-1).chunk(size)
    works = [dist.broadcast(piece, group_src=index, group=group, async_op=True) for index, piece in enumerate(slices)]
    return WorkGroup([work for work in works if work is not None])
