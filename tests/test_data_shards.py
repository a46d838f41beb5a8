"""``tell_data_parallel_rank`` (``distributed/data_shards.py``, issue 43) in one process: what it changes on a LitData
``StreamingDataset`` and what it leaves alone. The runs that depend on it: tests/test_pipeline_data.py (the pipeline),
tests/test_torchft.py (replica groups), tests/test_ray_train.py (Ray Train)."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed_harness import run_distributed
from streamed_data import STREAMED_SAMPLES
from torch.utils.data import DataLoader

from lightning_parallel.distributed.data_shards import tell_data_parallel_rank

litdata = pytest.importorskip("litdata")


class IndexedSamples(litdata.StreamingDataset):
    """A user's subclass (its own ``__getitem__``), as LitData's docs suggest for transforms."""

    def __getitem__(self, index):
        return int(super().__getitem__(index)["index"])


def _shares(rank: int, world_size: int, data_dir: Path) -> dict:
    """One process (a replica group of one): the samples each of 3 replicas reads, as told; and what is left alone."""
    shares, told = [], []
    for replica in range(3):
        dataset = IndexedSamples(str(data_dir))
        told.append((dataset.drop_last, tell_data_parallel_rank(DataLoader(dataset), rank=replica, size=3)))
        shares.append(sorted(dataset))
    configured = IndexedSamples(str(data_dir))
    configured.distributed_env = type(configured.distributed_env)(world_size=2, global_rank=1, num_nodes=1)
    plain = DataLoader(list(range(4)))
    parts = [IndexedSamples(str(data_dir)) for _ in range(2)]
    combined = litdata.CombinedStreamingDataset(parts, iterate_over_all=True)
    combined_told = tell_data_parallel_rank(DataLoader(combined), rank=1, size=3)
    return {
        "combined": (combined_told, [(p.distributed_env.world_size, p.distributed_env.global_rank) for p in parts]),
        "combined_length": len(combined),
        "shares": shares,
        "told": told,
        "drop_last": dataset.drop_last,
        "configured": tell_data_parallel_rank(DataLoader(configured), rank=0, size=3),
        "configured_env": (configured.distributed_env.world_size, configured.distributed_env.global_rank),
        "plain": tell_data_parallel_rank(plain, rank=0, size=3),
    }


def test_a_subclassed_streaming_dataset_reads_the_told_share_with_drop_last(streamed_chunks: Path):
    """Rank ``r`` of 3 in a one-process job: equal, disjoint shares (16 samples: 15 read, LitData's drop-last), and
    ``drop_last`` turned on as LitData does in a distributed run; a dataset the user gave another rank is left alone,
    and a loader of another dataset too; each dataset of a ``CombinedStreamingDataset`` is told."""
    [result] = run_distributed(_shares, 1, args=(streamed_chunks,), timeout=120)
    assert result["told"] == [(False, True)] * 3 and result["drop_last"] is True
    shares = result["shares"]
    assert [len(share) for share in shares] == [STREAMED_SAMPLES // 3] * 3
    assert len(set(shares[0]) | set(shares[1]) | set(shares[2])) == 3 * (STREAMED_SAMPLES // 3)
    assert (result["configured"], result["configured_env"]) == (False, (2, 1))
    assert result["plain"] is False
    # A `CombinedStreamingDataset`: each of its datasets told, so it reads two shares of 5.
    assert result["combined"] == (True, [(3, 1), (3, 1)]) and result["combined_length"] == 2 * (STREAMED_SAMPLES // 3)
