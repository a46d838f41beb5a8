"""The one choice of how a pipeline holds its stages over the replicas (:mod:`.sync`), made once per split."""

from __future__ import annotations

from lightning_parallel.distributed.pipeline.fully_shard import FullyShardSync
from lightning_parallel.distributed.pipeline.sync import PipelineSync, ReplicatedSync
from lightning_parallel.distributed.pipeline.zero import FlatBucketSync

__all__ = ["pipeline_sync_type"]

_BY_ZERO_STAGE: dict[int, type[PipelineSync]] = {
    0: ReplicatedSync,
    1: FlatBucketSync,
    2: FlatBucketSync,
    3: FullyShardSync,
}


def pipeline_sync_type(zero_stage: int, *, data_parallel_size: int, keeps_masters: bool = False) -> type[PipelineSync]:
    """The :class:`~.sync.PipelineSync` for ``PipelineParallelStrategy(zero_stage=...)``: replicated at stage 0 and
    without data parallelism (nothing to shard over), flat buckets at stages 1-2, fully-shard at stage 3. Without data
    parallelism 16-bit parameters with fp32 masters (``keeps_masters``) keep the flat buckets at every stage, as
    ``ShardedOptimizerStrategy`` keeps them at world size 1: a run moved between sizes keeps its arithmetic."""
    if data_parallel_size == 1:
        return FlatBucketSync if zero_stage and keeps_masters else ReplicatedSync
    return _BY_ZERO_STAGE[zero_stage]
