"""Which parameters share a ZeRO-1/2 flat bucket: one pure function for the buckets themselves
(:class:`~lightning_parallel.distributed.zero.buckets.ShardedParameterBuckets`) and for the planner's arithmetic
(:mod:`lightning_parallel.planner.estimate`), so a prediction cannot drift from what is built."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

__all__ = ["BucketMember", "bucket_layout", "padded_numel"]


class BucketMember(NamedTuple):
    """What the layout needs to know of one parameter."""

    numel: int
    element_size: int
    """Bytes per element."""
    kind: Hashable
    """Parameters of different kinds never share a bucket (a flat buffer has one dtype and one device): the real
    buckets pass ``(dtype, device)``, the planner the dtype the parameter is trained in."""


def bucket_layout(members: Sequence[BucketMember], *, bucket_cap_mb: float) -> list[list[int]]:
    """Indices into ``members`` of each bucket, in bucket order.

    ``members`` come in the order buckets are filled (the caller's choice: reverse registration order, roughly the
    order backward produces gradients). A bucket is closed before a member of another kind, or before one that would
    take it over ``bucket_cap_mb`` MiB; a member larger than the cap gets a bucket of its own.
    """
    cap = bucket_cap_mb * 2**20
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index, member in enumerate(members):
        size = member.numel * member.element_size
        differs = current and member.kind != members[current[0]].kind
        if current and (differs or current_bytes + size > cap):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def padded_numel(numel: int, world_size: int) -> int:
    """Elements of a bucket of ``numel`` once padded to equal shards on ``world_size`` ranks."""
    return -(-numel // world_size) * world_size
