"""One batch per pipeline replica, whatever the loader does: the first pipeline rank's batch sent to the others.

Torch only. Every rank of a pipeline runs the same batch: the first stage embeds its inputs, the last stage scores
the output against its targets, middle stages take its side inputs. Loaders do not guarantee that the ranks of one
pipeline load the same batch:

* a data library that shards by ``torch.distributed``'s global rank (LitData's ``StreamingDataset``, Hugging Face's
  ``split_dataset_by_node(ds, rank=dist.get_rank(), ...)``, WebDataset's ``split_by_node``) gives the two ranks of a
  pipeline two different shares: the first stage embeds samples 0-7, the last one scores against samples 32-39;
* randomness in the collate function or the loader's workers (Hugging Face's ``DataCollatorForLanguageModeling``
  draws the masked-LM masks while collating; augmentation in workers seeded per global rank) draws differently on
  each rank.

So :class:`ReplicaBatches` lets every rank iterate its own loader (each one advances as it would alone: samplers,
workers, a stateful loader's position), and replaces each batch by the one of the pipeline's first rank
(:func:`broadcast_batch`: a tree of tensors and plain Python values). Before every batch the ranks tell each other
whether their loader still had one (a small all-gather), and before every epoch how long their loaders are; loaders
of different lengths would leave one rank waiting in a collective the others never reach, so they raise
:class:`InconsistentBatchesError` on every rank instead, naming the ranks, the lengths and the fix.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.distributed.pipeline.microbatch import ForwardsLoaderState, saves_state
from lightning_parallel.distributed.pipeline.transfer import Flattened, TensorSlot, flatten_tensors

__all__ = [
    "BatchBroadcast",
    "InconsistentBatchesError",
    "ReplicaBatches",
    "StatefulReplicaBatches",
    "broadcast_batch",
    "replica_batches",
]

_FIX = (
    " Every rank of a pipeline iterates its own loader and trains on the first pipeline rank's batches, so the"
    " loaders of one pipeline must yield the same number of batches. A loader that shards by torch.distributed's"
    " global rank gives each rank of a pipeline a different share: give it the data-parallel rank and size instead,"
    " `trainer.distributed_sampler_kwargs['rank']` and `['num_replicas']` (e.g."
    " `split_dataset_by_node(ds, rank=..., world_size=...)`; LitData's `StreamingDataset` is told by the strategy"
    " itself), or use a map-style dataset with Lightning's distributed sampler."
)


class InconsistentBatchesError(RuntimeError):
    """The ranks of one pipeline cannot train on the same batches: their loaders yield different numbers of them."""


@dataclass(frozen=True)
class BatchBroadcast:
    """How a pipeline's ranks exchange their batches: the pipeline's group, its first rank and the device the
    backend communicates from (the rank's GPU for NCCL, the CPU for gloo)."""

    group: Any
    """The process group of one pipeline (the ranks of one replica)."""
    src: int
    """Global rank whose batches every rank of the pipeline trains on (the first stage's)."""
    device: torch.device

    @property
    def ranks(self) -> list[int]:
        return list(dist.get_process_group_ranks(self.group))


def broadcast_batch(batch: Any, exchange: BatchBroadcast) -> tuple[Any, int]:
    """Collective over ``exchange.group``: every rank gets global rank ``exchange.src``'s ``batch``.

    ``batch`` is walked as Lightning walks batches (tuples, lists, namedtuples, mappings such as Hugging Face's
    ``BatchEncoding``, dataclasses); every other value (strings, numbers, ``None``) travels pickled with the tree's
    description. Tensors travel as one flat buffer per dtype and come back on the device they had on the source (the
    CPU for a loader's batch). The source keeps its own objects. Returns the batch and the bytes of its tensors
    (what the ledger counts: the description, pickled, is a control message).
    """
    tensors, description = _described(batch) if dist.get_rank() == exchange.src else (None, b"")
    size = torch.tensor([len(description)], dtype=torch.int64, device=exchange.device)
    dist.broadcast(size, src=exchange.src, group=exchange.group)
    return _send(batch, tensors, description, int(size.item()), exchange)


def _described(batch: Any) -> tuple[list[Tensor], bytes]:
    """The source's side of a broadcast batch: its tensors, and the tree without them (slots instead), pickled."""
    flat = flatten_tensors(batch)
    return [tensor.detach() for tensor in flat.tensors], pickle.dumps(flat.without_tensors())


def _send(
    batch: Any, tensors: list[Tensor] | None, description: bytes, size: int, exchange: BatchBroadcast
) -> tuple[Any, int]:
    """Collective: the description (``size`` bytes, known to every rank: the tree without its tensors, pickled),
    then the tensors, one buffer per dtype. ``tensors`` are the source's (``None`` elsewhere)."""
    buffer = torch.empty(size, dtype=torch.uint8, device=exchange.device)
    if tensors is not None:
        buffer.copy_(torch.frombuffer(bytearray(description), dtype=torch.uint8))
    dist.broadcast(buffer, src=exchange.src, group=exchange.group)
    skeleton: Flattened = pickle.loads(buffer.cpu().numpy().tobytes())
    received = _broadcast_tensors(tensors or [], skeleton.slots, exchange, is_source=tensors is not None)
    payload = sum(s.dtype.itemsize * math.prod(s.shape) for s in skeleton.slots)
    if tensors is not None:
        return batch, payload
    return skeleton.fill([received[s.index] for s in skeleton.slots]), payload


def _broadcast_tensors(
    tensors: list[Tensor], slots: list[TensorSlot], exchange: BatchBroadcast, *, is_source: bool
) -> dict[int, Tensor]:
    """One broadcast per dtype of the tensors' flattened values (skipped where the dtype has no element)."""
    by_dtype: dict[torch.dtype, list[TensorSlot]] = {}
    for s in sorted(slots, key=lambda s: s.index):
        by_dtype.setdefault(s.dtype, []).append(s)
    received: dict[int, Tensor] = {}
    for dtype, group in by_dtype.items():
        counts = [math.prod(s.shape) for s in group]
        if is_source:
            flat = torch.cat([tensors[s.index].reshape(-1).to(exchange.device) for s in group])
        else:
            flat = torch.empty(sum(counts), dtype=dtype, device=exchange.device)
        if flat.numel():
            dist.broadcast(flat, src=exchange.src, group=exchange.group)
        for s, chunk in zip(group, flat.split(counts), strict=True):
            value = chunk.view(s.shape)
            received[s.index] = value.cpu() if s.on_cpu else value
    return received


class ReplicaBatches:
    """A loader of one pipeline rank whose batches are the pipeline's first rank's (:func:`broadcast_batch`).

    Every rank iterates ``loader`` (samplers, workers and a stateful loader's position advance as without the
    pipeline); at the start of every epoch the ranks compare the loaders' lengths, and before every batch whether
    each loader still had one. Attributes (``sampler``, ``batch_size``, ``dataset``, ...) are the wrapped loader's.

    Args:
        loader: This rank's loader.
        exchange: The pipeline's group, its first rank and the communication device.
        on_batch: Called with the tensor bytes of every batch received or sent (the ledger's ``"broadcast"``).

    Raises:
        InconsistentBatchesError: On every rank of the pipeline, at the start of an epoch whose loaders report
            different lengths, or at the batch where one loader ends and another goes on.
    """

    def __init__(self, loader: Any, exchange: BatchBroadcast, on_batch: Callable[[int], None] | None = None) -> None:
        self.loader = loader
        self.exchange = exchange
        self.on_batch = on_batch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self._check_lengths()
        iterator = iter(self.loader)
        is_source, source = dist.get_rank() == self.exchange.src, self.exchange.ranks.index(self.exchange.src)
        count = 0
        while True:
            batch = next(iterator, _END)
            tensors, description = _described(batch) if is_source and batch is not _END else (None, b"")
            # One all-gather per batch: whether each loader still had one, and the size of the source's description.
            gathered = self._gather(0 if batch is _END else 1, len(description))
            going_on = [more for more, _ in gathered]
            if not any(going_on):
                return
            if not all(going_on):
                ended = [rank for rank, more in zip(self.exchange.ranks, going_on, strict=True) if not more]
                raise InconsistentBatchesError(
                    f"The loader of global rank(s) {ended} ended after {count} batches while the loaders of"
                    f" the other ranks of the same pipeline ({self.exchange.ranks}) went on: the stages of one"
                    f" pipeline would train on different batches.{_FIX}"
                )
            batch, payload = _send(batch, tensors, description, gathered[source][1], self.exchange)
            if self.on_batch is not None:
                self.on_batch(payload)
            count += 1
            yield batch

    def _check_lengths(self) -> None:
        try:
            length = len(self.loader)
        except TypeError:  # an iterable without a length: checked batch by batch
            length = -1
        lengths = [n for n, _ in self._gather(length, 0)]
        if len(set(lengths)) > 1:
            described = ", ".join(
                f"rank {rank}: {'no length' if n < 0 else n}"
                for rank, n in zip(self.exchange.ranks, lengths, strict=True)
            )
            raise InconsistentBatchesError(
                f"The loaders of the ranks of one pipeline have different lengths ({described}): the stages of one"
                f" pipeline would train on different batches, and a rank would wait for a batch the others never"
                f" load.{_FIX}"
            )

    def _gather(self, *values: int) -> list[tuple[int, ...]]:
        """Collective over the pipeline: every rank's ``values`` (8 bytes each; a control message, not counted)."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.exchange.device)
        out = [torch.empty_like(mine) for _ in self.exchange.ranks]
        dist.all_gather(out, mine, group=self.exchange.group)
        return [tuple(int(v) for v in t) for t in torch.stack(out).cpu()]

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class StatefulReplicaBatches(ForwardsLoaderState, ReplicaBatches):
    """:class:`ReplicaBatches` of a loader that saves its position (LitData's ``StreamingDataLoader``)."""


def replica_batches(
    loader: Any, exchange: BatchBroadcast, on_batch: Callable[[int], None] | None = None
) -> ReplicaBatches:
    """``loader`` wrapped in :class:`ReplicaBatches`, or :class:`StatefulReplicaBatches` where it saves its state."""
    return (StatefulReplicaBatches if saves_state(loader) else ReplicaBatches)(loader, exchange, on_batch)


_END = object()
