"""The collective step of planning a split: one stage plan on every rank.

Torch-only. The local steps (resolving the layers, checking them against ``forward``, planning from an example)
run first on every rank, so a bad model raises everywhere before any of these collectives.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.distributed.pipeline.balance import UnevenStages
from lightning_parallel.distributed.pipeline.layer_costs import measure_layer_times
from lightning_parallel.distributed.pipeline.schedule import Placement
from lightning_parallel.distributed.pipeline.stage_plan import PartitionMethod, StagePlan, plan_for_example

__all__ = ["check_same_plan", "plan_on_every_rank"]


def plan_on_every_rank(
    layers: Sequence[nn.Module],
    example: tuple[tuple[Any, ...], dict[str, Any]] | None,
    *,
    partition: PartitionMethod | Sequence[int],
    num_stages: int,
    pipeline_parallel_size: int,
    global_rank: int,
    device: torch.device,
    placement: Placement = "loop",
    uneven: UnevenStages | None = None,
) -> StagePlan:
    """:func:`plan_for_example` with ``partition="measured"`` timed on rank 0 and shared (a collective then); stages
    laid on ranks by ``placement`` (the schedule's, ``schedule_spec(name).placement``), the first and last stage
    lightened by ``uneven``."""
    measured = None
    if partition == "measured" and example is not None:
        # Timings differ between ranks: rank 0 measures, every rank uses its numbers.
        if global_rank == 0:
            measured = measure_layer_times(layers, *example, device=device)
        box = [measured]
        dist.broadcast_object_list(box, src=0)
        measured = box[0]
    return plan_for_example(
        layers,
        example,
        partition=partition,
        num_stages=num_stages,
        pipeline_parallel_size=pipeline_parallel_size,
        measured=measured,
        # Every rank plans from the same layers and example shapes and warns the same: say it once.
        warn=warnings.warn if global_rank == 0 else _silent,
        placement=placement,
        uneven=uneven,
    )


def _silent(message: str) -> None:
    """A ``warn`` for ranks other than 0, whose warnings rank 0 has already given."""


def check_same_plan(plan: StagePlan, world_size: int) -> None:
    """Collective: every rank must have computed the same stage boundaries.

    Raises:
        RuntimeError: On every rank, listing each rank's boundaries, if they differ.
    """
    plans: list[Any] = [None] * world_size
    dist.all_gather_object(plans, plan.starts)
    if any(p != plan.starts for p in plans):
        raise RuntimeError(
            f"Ranks computed different stage splits {plans} (their example batches differ in shape). Pass an"
            " explicit `partition=[...]`."
        )
