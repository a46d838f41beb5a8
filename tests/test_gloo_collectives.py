"""The broadcast-built all-gather (``distributed/gloo_collectives.py``) equals gloo's all-gather, bit for bit, at 2 and
4 forked ranks, on a whole group and on a subgroup (hybrid sharding's shard group), in fp32 and bf16; the exchange-built
reduce-scatter equals the sum of every rank's slice in rank order, bit for bit, there too, with two exchanges in flight
at once and a user's own sends on the same group beside them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from distributed_harness import run_distributed

from lightning_parallel.distributed.gloo_collectives import (
    WorkGroup,
    all_gather_by_broadcasts,
    reduce_scatter_by_exchange,
)

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


def _reduce_scatter_rank(rank: int, world_size: int) -> dict[str, Any]:
    pairs = [list(range(start, start + 2)) for start in range(0, world_size, 2)]
    subgroups = [dist.new_group(ranks) for ranks in pairs]
    mine = subgroups[rank // 2]
    results = {}
    for name, group in (("world", None), ("subgroup", mine)):
        for dtype in (torch.float32, torch.bfloat16):
            size, index = dist.get_world_size(group), dist.get_rank(group)
            wholes = [torch.randn(size * SHARD, generator=torch.Generator().manual_seed(100 * rank)).to(dtype)]
            wholes.append(torch.randn(size * SHARD, generator=torch.Generator().manual_seed(100 * rank + 50)).to(dtype))
            everyone = [[torch.empty_like(w) for _ in range(size)] for w in wholes]
            for gathered, whole in zip(everyone, wholes, strict=True):
                dist.all_gather(gathered, whole, group=group)
            expected = []
            for gathered in everyone:
                total = gathered[0][index * SHARD : (index + 1) * SHARD].clone()
                for other in gathered[1:]:
                    total += other[index * SHARD : (index + 1) * SHARD]
                expected.append(total)
            outputs = [torch.full((SHARD,), float("nan"), dtype=dtype) for _ in wholes]
            exchanges = [reduce_scatter_by_exchange(o, w, group) for o, w in zip(outputs, wholes, strict=True)]
            # A user's message on the same group, with the default tag, sent while the exchanges are in flight.
            peer = index ^ 1
            note, heard = torch.full((3,), float(rank)), torch.empty(3)
            sent = dist.isend(note, group=group, group_dst=peer)
            dist.recv(heard, group=group, group_src=peer)
            sent.wait()
            for exchange in exchanges[::-1]:  # finished in any order
                exchange.finish()
            peer_rank = dist.get_global_rank(group, peer) if group is not None else peer
            results[f"{name}-{dtype}"] = all(
                torch.equal(o, e) for o, e in zip(outputs, expected, strict=True)
            ) and torch.equal(heard, torch.full((3,), float(peer_rank)))
    return results


def test_reduce_scatter_by_exchange_sums_every_ranks_slice() -> None:
    for world_size in (2, 4):
        for result in run_distributed(_reduce_scatter_rank, world_size, timeout=120):
            assert result and all(result.values()), result
