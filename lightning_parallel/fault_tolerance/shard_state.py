"""What a restarted replica group's rank ``i`` receives from rank ``i`` of a live one under hybrid sharding.

Torch-only. :class:`OwnedShardState` holds that rank's shard of every bucket (the fp32 master where there is one), the
module's buffers and the optimizer's own (sharded) state dict. The two ranks shard alike (same model, ``shard_size``
and bucket size), so no layout is translated; the rest of each parameter arrives with the group's all-gather after
its next step (or :meth:`OwnedShardState.settle`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["OwnedShardState"]


class OwnedShardState:
    """What one rank of a replica group sends a restarted group's same rank, and how that rank loads it.

    Args:
        buckets: this rank's :class:`~lightning_parallel.distributed.zero.buckets.ShardedParameterBuckets`.
        module: the module whose buffers travel too (parameters travel as the buckets' shards).
        optimizer: the user's optimizer, stepping this rank's shard views (its own ``state_dict`` is sharded).
    """

    def __init__(self, buckets: Any, module: nn.Module, optimizer: Optimizer) -> None:
        self.buckets = buckets
        self.module = module
        self.optimizer = optimizer
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        """Local. This rank's shard of every bucket (the fp32 master where there is one), the buffers and the sharded
        optimizer state: views of the live tensors, which the caller copies before the next optimizer step (torchft's
        quorum thread reads it only between a step's start and its commit: ``ReplicaGroupSync``)."""
        shards = []
        for bucket in self.buckets.buckets:
            if bucket.master is not None:
                shards.append(bucket.master.detach())
            else:
                start = self.buckets.rank * bucket.shard_numel
                shards.append(bucket.flat_params[start : start + bucket.shard_numel].detach())
        return {
            "layout": self._layout(),
            "shards": shards,
            "buffers": {name: buffer.detach() for name, buffer in self.module.named_buffers()},
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Local. Take over a peer's shard, buffers and optimizer state; the other ranks' pieces of each parameter
        arrive with the group's next all-gather (after the step, or :meth:`settle`)."""
        if state["layout"] != self._layout():
            raise RuntimeError(
                "ShardedOptimizerStrategy(fault_tolerance=...): the live replica group shards differently"
                f" ({state['layout']} against this group's {self._layout()}: bucket sizes per rank and ranks per"
                " group). Run every group with the same model, `shard_size`, `bucket_cap_mb` and processes per group."
            )
        for bucket, shard in zip(self.buckets.buckets, state["shards"], strict=True):
            start = self.buckets.rank * bucket.shard_numel
            owned = bucket.flat_params[start : start + bucket.shard_numel]
            if bucket.master is not None:
                bucket.master.copy_(shard)
            owned.copy_(shard)  # rounded to the parameters' dtype beside a master
        buffers = dict(self.module.named_buffers())
        for name, value in state["buffers"].items():
            buffers[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.loaded = True

    def zero_gradients(self) -> tuple[list[Tensor], Tensor | None]:
        """Local. Zeros shaped as what the buckets hand their ``ReplicaReduction`` in a step: each bucket's reduced
        gradient shard and the "got a gradient" flags (``None`` without bucketed parameters)."""
        shards = [torch.zeros_like(bucket.shard_grads) for bucket in self.buckets.buckets]
        count = len(self.buckets.parameters)
        used = torch.zeros(count, dtype=torch.uint8, device=self.buckets.device) if count else None
        return shards, used

    def settle(self) -> None:
        """Collective in the group, once, after joining: if a peer's state was loaded outside a step, all-gather the
        parameters (each rank holds only its own shard of them); otherwise start the masters from the parameters
        (which may have been replaced by the first group's)."""
        if self.loaded:
            self.buckets.all_gather_parameters()
        else:
            self.buckets.reset_master_weights()

    def _layout(self) -> list[int]:
        return [self.buckets.world_size, *(bucket.shard_numel for bucket in self.buckets.buckets)]
