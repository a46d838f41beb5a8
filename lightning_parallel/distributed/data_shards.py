"""Each data-parallel replica reads its own share: data libraries that shard by ``torch.distributed``'s global rank.

Torch only (LitData is recognised by its attributes, never imported). Lightning's ``DistributedSampler`` is given the
data-parallel rank and size by the strategy (``distributed_sampler_kwargs``). Streaming libraries shard an
``IterableDataset`` themselves, by the global rank and world size they read from ``torch.distributed``. That is the
data-parallel rank wherever every rank of one job is its own replica and the job is the whole run
(``DataParallelStrategy``, ``ShardedOptimizerStrategy`` with or without ``shard_size``, both inside Ray Train), but
not:

* under the pipeline, where the ``pipeline_parallel_size`` ranks of one replica must read one share: with the global
  rank they read ``pipeline_parallel_size`` shares, and the replicas together only a ``1 / pipeline_parallel_size``
  part of the data (the first stage's);
* under fault-tolerant replica groups (``FaultTolerance``), where each group of ``K`` processes is its own
  torch.distributed job: every group sees ranks ``0..K-1`` of ``K``, so all ``N`` groups read the same samples. The
  data-parallel rank is ``replica_group * K + rank`` of ``N * K``.

* LitData's ``StreamingDataset`` reads them once, in its ``__init__`` (the attribute ``distributed_env``:
  ``world_size``, ``global_rank``, ``num_nodes``), and offers no argument to say "this rank is replica ``r`` of
  ``R``": :func:`tell_data_parallel_rank` replaces that record, on the dataset of a loader the strategy is handed
  (every strategy of this package calls it in ``process_dataloader`` with its ``distributed_sampler_kwargs``).
* Hugging Face's ``split_dataset_by_node(ds, rank=..., world_size=...)`` takes them as arguments: pass
  ``trainer.distributed_sampler_kwargs["rank"]`` and ``["num_replicas"]`` (docs/pipeline.md and
  docs/reliability.md, "Data").
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["tell_data_parallel_rank"]


def tell_data_parallel_rank(loader: Any, *, rank: int, size: int) -> bool:
    """Local. Make the LitData ``StreamingDataset`` of ``loader`` (if it is one; each of a ``CombinedStreamingDataset``)
    shard by data-parallel ``rank`` of ``size`` instead of ``torch.distributed``'s global rank; returns whether it did.

    Only a dataset whose record is still torch.distributed's (``world_size`` and ``global_rank`` equal to this
    process's) is changed: one the user configured otherwise is left alone. ``num_nodes`` becomes 1 (LitData uses it
    to group ranks by node for its cache; the replicas of one node need not be a block of ranks). A dataset built in a
    job of one process (a replica group of one) kept ``drop_last`` off; it is turned on, as LitData does for every
    dataset it sees in a distributed run, so that every replica reads as many samples (an explicit
    ``drop_last=False`` cannot be told from the default there, and is turned on too; in a job of several processes
    LitData already turned the default on, and an explicit ``False`` is kept).
    """
    dataset: Any = getattr(loader, "dataset", None)
    if not _is_litdata(dataset) or not dist.is_initialized():
        return False
    # LitData's `CombinedStreamingDataset` holds its `StreamingDataset`s in `_datasets` (no public accessor in 0.2.76)
    # and reads through theirs: each is told.
    parts = getattr(dataset, "_datasets", None) or [dataset]
    return any([_tell_streaming_dataset(part, rank=rank, size=size) for part in parts])


def _tell_streaming_dataset(dataset: Any, *, rank: int, size: int) -> bool:
    """One ``StreamingDataset``: its record replaced if it is still torch.distributed's and the size differs."""
    env = getattr(dataset, "distributed_env", None)
    if env is None or (env.world_size, env.global_rank) != (dist.get_world_size(), dist.get_rank()):
        return False
    if env.world_size == size:  # every rank its own replica: the record is right as it is
        return False
    # LitData's `_DistributedEnv(world_size, global_rank, num_nodes)`, built through the record's own class.
    dataset.distributed_env = type(env)(world_size=size, global_rank=rank, num_nodes=1)
    if env.world_size == 1 and size > 1 and not dataset.drop_last:  # LitData saw one process: its default stayed off
        dataset.set_drop_last(True)  # resets the shuffler, whose length depends on it
    return True


def _is_litdata(dataset: object) -> bool:
    """A LitData dataset, or a user's subclass of one (a ``StreamingDataset`` with its own ``__getitem__``)."""
    return any(cls.__module__.startswith("litdata.") for cls in type(dataset).__mro__)
