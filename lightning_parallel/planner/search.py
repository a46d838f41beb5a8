"""When nothing in the table fits: the options a user has, searched, and the cheapest one that fits.

:func:`search` enumerates, for every activation-checkpointing mode (``"none"``, ``"selective"``, ``"full"``; only
``"none"`` for a model without a transformer shape, whose activations are unknown):

* data parallel, ZeRO 1/2/3 over all ranks;
* hybrid ZeRO 1/2/3 (``shard_size``) for every shard group size that divides the world size and is node-aligned
  (divides the devices of a node, or is a multiple of them);
* a pipeline for every size ``p`` dividing the world size (``p <= `` the model's pipeline layers), plain and with its
  replicas under ZeRO-3 (``zero_stage=3``), with :func:`~.plan.default_microbatches` micro-batches (at batch sizes
  below ``p``: GPipe with as many micro-batches as samples, see :func:`~.plan.pipeline_schedule`).

:func:`cost_key` orders them, cheapest first, by the step time they cost relative to data parallel without
checkpointing, then by what they put on the wire:

1. ``(1 + r) / (1 - b)``: ``r`` the recomputation (:func:`~.activations.recompute_fraction`: ``"none"`` 0,
   ``"selective"`` the matrix products it reruns, about 9% of a Llama 3 8B step at 8k, ``"full"`` 1/3) and ``b`` the
   pipeline bubble (``(p-1)/(m+p-1)``; 0 without a pipeline). Communication overlapped with compute is not counted.
2. Fewer bytes on the wire per step and rank (:meth:`~.estimate.ConfigEstimate.wire_bytes`).
3. Less sharding (data parallel, ZeRO-1, 2, 3, pipeline): simpler, fewer collectives in flight; then less memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from lightning_parallel.planner.estimate import (
    ConfigEstimate,
    EstimateContext,
    estimate_data_parallel,
    estimate_zero3,
    estimate_zero12,
)

__all__ = ["cost_key", "search", "shard_sizes"]

_SHARDING_RANK = {"data_parallel": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def shard_sizes(world_size: int, num_nodes: int) -> list[int]:
    """Shard group sizes for hybrid ZeRO: divisors ``1 < d < world_size`` that divide a node's devices or are a
    multiple of them (a group never straddles part of a node)."""
    per_node = world_size // num_nodes
    return [d for d in range(2, world_size) if world_size % d == 0 and (per_node % d == 0 or d % per_node == 0)]


def search(
    contexts: Callable[[str], EstimateContext],
    *,
    modes: list[str],
    num_nodes: int,
    bucket_cap_mb: float,
    pipelines: Callable[[EstimateContext, int], list[ConfigEstimate]],
) -> list[ConfigEstimate]:
    """Every candidate layout for each checkpointing mode in ``modes``; ``contexts(mode)`` gives the mode's inputs,
    ``pipelines(ctx, zero_stage)`` its pipeline rows. Each candidate's :attr:`~.ConfigEstimate.checkpointing` is set."""
    candidates = []
    for mode in modes:
        ctx = contexts(mode)
        found = [estimate_data_parallel(ctx)]
        if ctx.world_size > 1:
            found += [estimate_zero12(ctx, stage=s, bucket_cap_mb=bucket_cap_mb) for s in (1, 2)]
            found.append(estimate_zero3(ctx))
            for size in shard_sizes(ctx.world_size, num_nodes):
                found += [estimate_zero12(ctx, stage=s, bucket_cap_mb=bucket_cap_mb, shard_size=size) for s in (1, 2)]
                found.append(estimate_zero3(ctx, shard_size=size))
            found += pipelines(ctx, 0) + pipelines(ctx, 3)
        for config in found:
            config.checkpointing = mode
        candidates += found
    return candidates


def cost_key(config: ConfigEstimate, world_size: int, recompute: Mapping[str, float]) -> tuple[float, ...]:
    """The order of the module docstring (a smaller key is cheaper); ``recompute`` maps each checkpointing mode to its
    :func:`~.activations.recompute_fraction`."""
    is_pipeline = config.name.startswith("pipeline")
    sharding = 4 if is_pipeline else _SHARDING_RANK[config.name.split(" ")[0]]
    time = (1 + recompute[config.checkpointing]) / (1 - (config.bubble or 0.0))
    return (round(time, 6), config.wire_bytes(world_size), sharding, config.max_total)
