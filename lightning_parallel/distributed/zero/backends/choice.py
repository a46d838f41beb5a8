"""Which ZeRO backend a run gets: chosen once in the strategy's ``setup`` from the stage and the world size."""

from __future__ import annotations

from lightning_parallel.distributed.zero.backends.flat_buckets import FlatBucketBackend
from lightning_parallel.distributed.zero.backends.fully_shard import FullyShardBackend
from lightning_parallel.distributed.zero.backends.master_weights import MasterWeightBackend
from lightning_parallel.distributed.zero.backends.protocol import ZeroBackend
from lightning_parallel.distributed.zero.backends.replicated import ReplicatedBackend

__all__ = ["backend_type"]


def backend_type(stage: int, *, is_sharding: bool, keeps_masters: bool = False) -> type[ZeroBackend]:
    """The backend for ``stage`` (1, 2 or 3). World size 1 (``is_sharding=False``) shards nothing at any stage: it
    trains plainly, or steps fp32 master weights of 16-bit parameters when ``keeps_masters``."""
    if not is_sharding:
        return MasterWeightBackend if keeps_masters else ReplicatedBackend
    return FullyShardBackend if stage == 3 else FlatBucketBackend
