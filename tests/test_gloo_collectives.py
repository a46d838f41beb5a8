"""The broadcast-built all-gather (``distributed/gloo_collectives.py``) equals gloo's all-gather, bit for bit, at 2 and
4 forked ranks, on a whole group and on a subgroup (hybrid sharding's shard group), in fp32 and bf16."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from distributed_harness import run_distributed

from lightning_parallel.distributed.gloo_collectives import WorkGroup, all_gather_by_broadcasts

SHARD = 1001


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    pairs = [list(range(start, start + 2)) for start in range(0, world_size, 2)]
    subgroups = [dist.new_group(ranks) for ranks in pairs]  # every rank creates every group, in the same order
    mine = subgroups[rank // 2]
    results = {}
    for name, group in (("world", None), ("subgroup", mine)):
        for dtype in (torch.float32, torch.bfloat16):
            size, index = dist.get_world_size(group), dist.get_rank(group)
            shard = torch.randn(SHARD, generator=torch.Generator().manual_seed(rank)).to(dtype)
            expected = torch.empty(size * SHARD, dtype=dtype)
            dist.all_gather_into_tensor(expected, shard, group=group)
            output = torch.full((size * SHARD,), float("nan"), dtype=dtype)
            output[index * SHARD : (index + 1) * SHARD] = shard  # in place: this rank's slice holds its shard
            work = all_gather_by_broadcasts(output, group)
            assert isinstance(work, dist.Work) and isinstance(work, WorkGroup)
            work.wait()
            results[f"{name}-{dtype}"] = torch.equal(output, expected) and work.is_completed()
    return results


def test_all_gather_by_broadcasts_equals_gloo_all_gather() -> None:
    for world_size in (2, 4):
        for result in run_distributed(_rank, world_size, timeout=120):
            assert result and all(result.values()), result
