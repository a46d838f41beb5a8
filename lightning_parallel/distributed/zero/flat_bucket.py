"""The records of one flat ZeRO-1/2 bucket (:class:`FlatBucket`), one parameter's place in it and this rank's piece of
it (:class:`ShardView`): plain data that :mod:`.buckets` fills and :mod:`.accumulation` reads, in a module of their
own so that neither of those imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["FlatBucket", "Segment", "ShardView"]


@dataclass
class Segment:
    """One parameter's place in a bucket."""

    param: nn.Parameter
    name: str
    offset: int  # first element within the bucket
    numel: int
    index: int = 0  # position in the per-parameter "got a gradient" flags


@dataclass
class ShardView:
    """The piece of one parameter that this rank owns: ``param.view(-1)[start:stop]``."""

    name: str
    param: nn.Parameter
    start: int
    stop: int
    tensor: Tensor  # view into the bucket's fp32 master shard if it has one, else its flat parameters; stepped
    grad: Tensor  # view into the bucket's reduced gradient shard
    grad_offset: int = 0  # where `grad` starts in that shard


@dataclass
class FlatBucket:
    """One flat bucket's tensors and sync state (a record of :class:`ShardedParameterBuckets`; the fields from
    ``pending_shard`` to ``carried`` that keep views' ``.grad`` as torch's are handled by ``zero_accumulation``)."""

    segments: list[Segment]
    numel: int  # padded to a multiple of the world size
    shard_numel: int
    flat_params: Tensor
    shard_grads: Tensor
    full_grads: Tensor | None = None
    pending_shard: Tensor | None = None  # reduce-scatter output to add to `shard_grads` (accumulating syncs)
    ready: int = 0
    expected: int = 0  # gradients this backward will produce: segments whose parameter requires grad
    launched: bool = False
    work: dist.Work | None = None
    views: list[ShardView] = field(default_factory=list)
    master: Tensor | None = None  # fp32 copy of this rank's shard of `flat_params` (16-bit parameters)
    send: Tensor | None = None  # fp32 copy of `full_grads` for the reduce-scatter while it is in flight
    reduces_in_place: bool = False  # stage 1 without a master: `shard_grads` is this rank's slice of `full_grads`
    holds_reduced: bool = False  # in place: the owned slice holds the last sync's averages, not a new accumulation
    carried: Tensor | None = None  # in place: gradients the views kept through a sync (no `zero_grad`), re-added after
    owned_segments: list[Segment] = field(default_factory=list)  # segments overlapping this rank's shard
    copy_after: tuple[Tensor, Tensor] | None = None  # all-reduce: (output, source) to copy once `work` completes
