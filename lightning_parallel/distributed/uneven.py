"""Uneven inputs: keep every rank taking the same number of steps when ranks hold different numbers of batches.

Why not torch's ``Join`` directly: ``Join`` lets a rank that ran out of data leave the training loop and
*shadow* DDP's gradient all-reduces until the others finish. Under Lightning that rank also skips every other
collective the Trainer makes per batch (the SIGTERM broadcast before each batch, ``sync_dist`` logging,
checkpoint barriers) and its optimizer, scheduler and ``global_step`` fall behind, so the job still hangs or
diverges (Lightning#3325). Here the exhausted rank instead stays in lockstep: it *replays* its last batch with
the loss multiplied by zero. It runs exactly the collectives the other ranks run, contributes a zero gradient,
and DDP's average divides by the full world size, which is ``Join``'s default gradient semantics
(``divide_by_initial_world_size=True``). The epoch ends when every rank is exhausted.

Cost: one all-reduce of two integers per batch, and only when the ranks' lengths are not known to be equal
(:func:`needs_lockstep` decides once per epoch with one all-reduce).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LockstepBatches", "needs_lockstep"]


def _local_length(dataloader: Iterable) -> int | None:
    try:
        return len(dataloader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


def needs_lockstep(dataloader: Iterable, *, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ranks may hold different numbers of batches (collective: every rank must call it).

    ``False`` only when every rank's loader has a length and all lengths are equal.
    """
    length = _local_length(dataloader)
    # [has no length, -length, +length] reduced with MAX gives: any rank without length, min length, max length.
    stats = torch.tensor([int(length is None), -(length or 0), length or 0], dtype=torch.int64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    any_without_length, negative_min, maximum = stats.tolist()
    return bool(any_without_length) or -negative_min != maximum


class LockstepBatches:
    """Wraps a dataloader so every rank yields the same number of batches.

    While at least one rank still has data, an exhausted rank yields its last batch again and records that the
    step is *padding*; :meth:`pop_is_padding` returns these records in the order batches were yielded (Lightning
    pre-fetches one batch ahead, so the record is consumed when the step runs, not when the batch is fetched).

    ``len()`` is the maximum length over ranks when every rank's loader has one, so Lightning plans the same
    number of steps on every rank. Creating the wrapper is a collective.

    Args:
        dataloader: the rank's own loader.
        device: device for the small flag tensors (the rank's CUDA device under NCCL).
        group: process group of the data-parallel replicas (``None``: the default group).
    """

    def __init__(self, dataloader: Iterable, *, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.dataloader = dataloader
        self.device = device
        self.group = group
        self._padding_records: deque[bool] = deque()
        length = _local_length(dataloader)
        stats = torch.tensor([int(length is None), length or 0], dtype=torch.int64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        self._global_length = None if stats[0].item() else int(stats[1].item())

    def __len__(self) -> int:
        if self._global_length is None:
            raise TypeError("The wrapped dataloader has no length on at least one rank.")
        return self._global_length

    def __getattr__(self, name: str) -> Any:
        # Lightning reads attributes such as `sampler` and `batch_size` of the loader it is given.
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def pop_is_padding(self) -> bool:
        """Whether the batch of the step now running is a replayed padding batch (``False`` when unknown)."""
        return self._padding_records.popleft() if self._padding_records else False

    def __iter__(self) -> Iterator[Any]:
        self._padding_records.clear()
        iterator = iter(self.dataloader)
        last_batch: Any = None
        exhausted = False
        ever_had_batch = False
        while True:
            batch = None
            if not exhausted:
                try:
                    batch = next(iterator)
                    last_batch, ever_had_batch = batch, True
                except StopIteration:
                    exhausted = True
            # [some rank still has data, some rank never had any batch]
            flags = torch.tensor([int(not exhausted), int(not ever_had_batch)], dtype=torch.int64, device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            any_has_data, some_rank_empty = flags.tolist()
            if not any_has_data:
                return
            if some_rank_empty:
                # Every rank reaches this line in the same iteration, so all raise together (no hang).
                raise ValueError(
                    "At least one rank received no training batch at all while others did, so it has nothing to"
                    " replay for the uneven-input padding. Give every rank at least one batch (fewer ranks, a"
                    " smaller batch size, or a sampler that splits the data across `world_size` ranks)."
                )
            self._padding_records.append(exhausted)
            yield last_batch if exhausted else batch
