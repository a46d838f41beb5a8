"""Which parameters share a ZeRO-1/2 flat bucket: one pure function for the buckets themselves
(:class:`~lightning_parallel.distributed.zero.buckets.ShardedParameterBuckets`) and for the planner's arithmetic
(:mod:`lightning_parallel.planner.estimate`), so a prediction cannot drift from what is built."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

__all__ = ["STAGE2_MIN_BUCKETS", "BucketMember", "bucket_layout", "min_buckets", "padded_numel"]

STAGE2_MIN_BUCKETS = 32
"""ZeRO-2 splits a model into at least this many buckets (fewer only where single parameters are larger): it holds
its gradient shards plus the whole buckets being filled or reduced (``max_buckets_in_flight``, 2 by default), while
ZeRO-1 holds one full gradient. With one bucket for a model under the cap (25 MiB), ZeRO-2 held a whole gradient
*and* its shard and peaked above ZeRO-1 (the demo: 117.6 vs 111.2 MiB). With a sixteenth of the model per bucket,
the two buckets alive whenever one is launched while the next fills (a sixteenth of the gradient each) decided the
peak wherever they met activations not yet freed: at 97.7M parameters on 2 ranks ZeRO-2 peaked 9.8 MiB above its
floor (ZeRO-1's peak less the gradient bytes it shards) on one rank and not on the other, by the collectives'
timing, and a run measured its RSS 6 MiB above the goal ``peak(zero1) - 0.9 (1 - 1/N) G`` (issue 46). A
thirty-second keeps the peak at that floor there (measured: 1271.5 MiB of tensors, RSS 1674.5, against 1281.3 and
1684.0). Models over 32 x the cap are unaffected (the cap decides), and a small model pays 32 small collectives
instead of one (latency only: the same bytes)."""


def min_buckets(stage: int) -> int:
    """The fewest buckets ZeRO ``stage`` (1 or 2) splits a model into (:data:`STAGE2_MIN_BUCKETS` at stage 2).
    Stage 1 keeps one persistent full gradient whatever the layout, so fewer, larger collectives are better."""
    return STAGE2_MIN_BUCKETS if stage == 2 else 1


class BucketMember(NamedTuple):
    """What the layout needs to know of one parameter."""

    numel: int
    element_size: int
    """Bytes per element."""
    kind: Hashable
    """Parameters of different kinds never share a bucket (a flat buffer has one dtype and one device): the real
    buckets pass ``(dtype, device)``, the planner the dtype the parameter is trained in."""


def bucket_layout(members: Sequence[BucketMember], *, bucket_cap_mb: float, min_buckets: int = 1) -> list[list[int]]:
    """Indices into ``members`` of each bucket, in bucket order.

    ``members`` come in the order buckets are filled (the caller's choice: reverse registration order, roughly the
    order backward produces gradients). A bucket is closed before a member of another kind, or before one that would
    take it over the cap: ``bucket_cap_mb`` MiB, or a ``min_buckets``-th of all members' bytes if that is smaller
    (:func:`min_buckets`); a member larger than the cap gets a bucket of its own.
    """
    total = sum(member.numel * member.element_size for member in members)
    cap = min(bucket_cap_mb * 2**20, -(-total // max(min_buckets, 1)))
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
