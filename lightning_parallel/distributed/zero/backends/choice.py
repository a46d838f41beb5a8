"""Which ZeRO backend holds a model, or one pipeline stage of it: chosen once, here, from the stage and whether there
are ranks to shard over. ``ShardedOptimizerStrategy`` (a whole model), ``PipelineParallelStrategy`` (each stage, over
its data-parallel replicas) and the planner's dry run all ask this one function."""

from __future__ import annotations

from lightning_parallel.distributed.zero.backends.flat_buckets import FlatBucketBackend
from lightning_parallel.distributed.zero.backends.fully_shard import FullyShardBackend
from lightning_parallel.distributed.zero.backends.master_weights import MasterWeightBackend
from lightning_parallel.distributed.zero.backends.protocol import ZeroBackend
from lightning_parallel.distributed.zero.backends.replicated import ReplicatedBackend

__all__ = ["backend_type"]


def backend_type(stage: int, *, is_sharding: bool, keeps_masters: bool = False) -> type[ZeroBackend]:
    """The backend for ZeRO ``stage``: 1-2 flat buckets, 3 fully-shard.

    Nothing to shard over (``is_sharding=False``: world size 1, or a pipeline stage without data parallelism) shards
    nothing at any stage: the model is held plainly, or its 16-bit parameters stepped through fp32 master weights when
    ``keeps_masters`` (stages 1-3). ``stage=0`` (``PipelineParallelStrategy(zero_stage=0)``) shards nothing either: each
    replica holds the model whole and :class:`ReplicatedBackend` averages the gradients over the replicas
    (``ZeroContext.data_parallel_group``), as DDP does.
    """
    if not is_sharding or stage == 0:
        return MasterWeightBackend if keeps_masters and stage else ReplicatedBackend
    return FullyShardBackend if stage == 3 else FlatBucketBackend
