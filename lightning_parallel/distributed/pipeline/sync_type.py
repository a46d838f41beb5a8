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


def pipeline_sync_type(zero_stage: int, *, data_parallel_size: int) -> type[PipelineSync]:
    """The :class:`~.sync.PipelineSync` for ``PipelineParallelStrategy(zero_stage=...)``: replicated at stage 0 and
    without data parallelism (nothing to shard over), flat buckets at stages 1-2, fully-shard at stage 3."""
    if data_parallel_size == 1:
        return ReplicatedSync
    return _BY_ZERO_STAGE[zero_stage]
