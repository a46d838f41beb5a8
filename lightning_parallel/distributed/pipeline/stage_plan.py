"""Which layers each pipeline stage holds and which rank runs it: the :class:`StagePlan`, and planning one.

Torch-only: usable without a Trainer. :func:`plan_stages` cuts per-layer costs (:mod:`.layer_costs`) into balanced
contiguous stages (:mod:`.balance`) placed on ranks by the schedule's placement; :func:`plan_for_example` picks the
costs from the user's ``partition=``. The split (:mod:`.stage_split`) keeps the model one ``nn.Module`` tree: a rank
keeps the layers of its own stages and replaces the others by :class:`~.remote_layer.RemoteLayer` placeholders
(:mod:`.layer_registration`), so ``state_dict()`` keeps the model's original parameter names and ``parameters()``
(hence the optimizer) holds only the local stage's parameters.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from lightning_parallel.distributed.pipeline.balance import UnevenStages, balance_ranks, balanced_boundaries
from lightning_parallel.distributed.pipeline.layer_costs import (
    UncountableLayerError,
    layer_compute_costs,
    layer_parameter_costs,
)
from lightning_parallel.distributed.pipeline.schedule import PLACEMENTS, Placement

__all__ = [
    "PartitionMethod",
    "StagePlan",
    "plan_for_example",
    "plan_stages",
    "validate_partition",
]

PartitionMethod = Literal["flops", "compute", "measured", "parameters"]
"""How the automatic split weighs a layer: ``"flops"`` (its forward FLOPs for an example batch; ``"compute"`` is the
same, its older name), ``"measured"`` (its forward and backward timed), ``"parameters"`` (its parameter count)."""
_FLOPS = ("flops", "compute")


def validate_partition(partition: Any) -> None:
    """``partition`` must be a :data:`PartitionMethod` or a list of layer indices.

    Raises:
        ValueError: Quoting the bad value and the valid options.
    """
    is_int_list = isinstance(partition, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in partition
    )
    if not (partition in ("flops", "compute", "measured", "parameters") or is_int_list):
        raise ValueError(
            f"`partition={partition!r}` is invalid. Valid options: 'flops' (or its older name 'compute'), 'measured',"
            " 'parameters', or a list of the first layer index of every stage but the first."
        )


@dataclass(frozen=True)
class StagePlan:
    """Which layers form which stage, and which pipeline rank runs each stage.

    Every question "which rank holds stage ``s`` / layer ``i``" goes through :meth:`rank_of_stage` (and
    :meth:`stages_of`, its inverse), which follow :attr:`placement`; nothing else writes the placement out.
    """

    starts: tuple[int, ...]
    """Index of the first layer of each stage."""
    num_layers: int
    """Total number of layers."""
    pipeline_parallel_size: int
    """Number of pipeline ranks; :attr:`placement` says which of them runs each stage."""
    placement: Placement = "loop"
    """How stages are laid on ranks, as the schedule expects them (``ScheduleSpec.placement``): ``"loop"`` puts stage
    ``s`` on rank ``s % pipeline_parallel_size`` (every schedule with one stage per rank, and the interleaved/looped
    ones); ``"v"`` (two stages per rank) puts stage ``s`` on rank ``s`` for ``s < p`` and on ``2p - 1 - s`` after, so
    rank ``r`` holds stages ``r`` and ``2p - 1 - r`` and the first and last stage share rank 0 (torch's V-shaped
    schedules, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``)."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"`placement={self.placement!r}` is invalid. Valid placements: {', '.join(PLACEMENTS)}.")
        if self.placement == "v" and self.num_stages != 2 * self.pipeline_parallel_size:
            raise ValueError(
                f"`placement='v'` lays two stages on each rank, but the plan has {self.num_stages} stages for"
                f" `pipeline_parallel_size={self.pipeline_parallel_size}`. Use `stages_per_rank=2`."
            )

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def layers_of(self, stage: int) -> range:
        """Layer indices of ``stage``."""
        stop = self.starts[stage + 1] if stage + 1 < self.num_stages else self.num_layers
        return range(self.starts[stage], stop)

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that runs ``stage`` under :attr:`placement`."""
        if not 0 <= stage < self.num_stages:
            raise IndexError(f"Stage {stage} is not in this plan of {self.num_stages} stages.")
        p = self.pipeline_parallel_size
        if self.placement == "v" and stage >= p:
            return 2 * p - 1 - stage  # the way back up the V
        return stage % p

    def stages_of(self, pipeline_rank: int) -> list[int]:
        """Stages run by ``pipeline_rank``, ascending (the inverse of :meth:`rank_of_stage`)."""
        return [stage for stage in range(self.num_stages) if self.rank_of_stage(stage) == pipeline_rank]

    def stage_of_layer(self, layer: int) -> int:
        return max(s for s, start in enumerate(self.starts) if start <= layer)

    def rank_of_layer(self, layer: int) -> int:
        """The pipeline rank that runs ``layer`` (the rank of its stage)."""
        return self.rank_of_stage(self.stage_of_layer(layer))


def plan_stages(
    costs: Sequence[float],
    *,
    num_stages: int,
    pipeline_parallel_size: int,
    boundaries: Sequence[int] | None = None,
    placement: Placement = "loop",
    uneven: UnevenStages | None = None,
) -> StagePlan:
    """Plan stages from per-layer costs, or from explicit ``boundaries`` (start layer of every stage but the first),
    laid on ranks by ``placement`` (the schedule's: ``schedule_spec(name).placement``).

    From costs (:mod:`.balance`): the split minimising the heaviest stage, the first and last stage lightened by
    ``uneven``; where a rank holds several stages (``num_stages > pipeline_parallel_size``), refined so that the
    heaviest *rank* (the sum of its stages) is as light as a one-layer move of a boundary can make it.

    Raises:
        ValueError: If there are more stages than layers, the boundaries are not increasing in ``(0, num_layers)``,
            or ``uneven`` lightens a stage by more layers than there are.
    """
    n = len(costs)
    if boundaries is None:
        starts = _balanced_starts(costs, num_stages, pipeline_parallel_size, placement, uneven or UnevenStages())
    else:
        starts = [0, *boundaries]
        valid = all(a < b for a, b in zip(starts, [*starts[1:], n], strict=True))
        if len(starts) != num_stages or not valid:
            raise ValueError(
                f"`partition={list(boundaries)!r}` must list the first layer of stages 1..{num_stages - 1}"
                f" ({num_stages - 1} strictly increasing indices in 1..{n - 1}) for {num_stages} stages of {n} layers."
            )
    return StagePlan(
        starts=tuple(starts), num_layers=n, pipeline_parallel_size=pipeline_parallel_size, placement=placement
    )


def _balanced_starts(
    costs: Sequence[float], num_stages: int, pipeline_parallel_size: int, placement: Placement, uneven: UnevenStages
) -> list[int]:
    uneven.check_layer_count(len(costs))
    extra_first, extra_last = uneven.extra_costs(costs)
    starts = balanced_boundaries(costs, num_stages, extra_first=extra_first, extra_last=extra_last)
    if num_stages <= pipeline_parallel_size:
        return starts  # one stage per rank: the heaviest stage is the heaviest rank
    plan = StagePlan(
        starts=tuple(starts), num_layers=len(costs), pipeline_parallel_size=pipeline_parallel_size, placement=placement
    )
    return balance_ranks(
        costs,
        starts,
        rank_of_stage=plan.rank_of_stage,
        num_ranks=pipeline_parallel_size,
        extra_first=extra_first,
        extra_last=extra_last,
    )


def plan_for_example(
    layers: Sequence[nn.Module],
    example: tuple[tuple[Any, ...], dict[str, Any]] | None,
    *,
    partition: PartitionMethod | Sequence[int],
    num_stages: int,
    pipeline_parallel_size: int,
    measured: Sequence[float] | None = None,
    warn: Callable[[str], Any] = warnings.warn,
    placement: Placement = "loop",
    uneven: UnevenStages | None = None,
) -> StagePlan:
    """Plan stages for ``layers`` given example inputs of the first layer (``(args, kwargs)``, or ``None``), laid on
    ranks by ``placement`` (:attr:`StagePlan.placement`), the first and last stage lightened by ``uneven``
    (:class:`~.balance.UnevenStages`; not with an explicit list).

    Only ``"flops"`` (``"compute"``) runs the layers, to count their FLOPs (:func:`layer_compute_costs`, with fake
    parameters); ``"parameters"`` and an explicit list run nothing (the layers' outputs are checked by the layer check
    and at run time), ``"measured"`` uses ``measured`` (per-layer times from :func:`measure_layer_times`, the same on
    every rank). Without an example, or when a layer's FLOPs cannot be counted (``warn`` says which and why), the
    split follows parameter counts. Every rank sees the same layers and example shapes, so every rank takes the same
    decision and warns the same; pass a ``warn`` that is silent off rank 0.

    What each method weighs: ``"parameters"`` counts every parameter of a layer (a weight tied between the embedding
    and the head counts in both: each stage holding one keeps a copy), so it balances weights, gradients and
    optimizer state, not activations; ``"flops"`` counts the forward FLOPs (the head's projection to the vocabulary
    included), not the loss nor the optimizer step.
    """
    costs: Sequence[float] | None = None
    if partition in _FLOPS and example is not None:
        try:
            costs = layer_compute_costs(layers, *example)
        except UncountableLayerError as error:
            warn(
                f"{error}. `partition={partition!r}` splits by parameter counts instead. Pass `partition='measured'`"
                " to time the layers, or the first layer of every stage but the first (`partition=[...]`)."
            )
    elif partition == "measured":
        costs = measured
    if costs is None:
        costs = layer_parameter_costs(layers)
    boundaries = None if isinstance(partition, str) else list(partition)
    return plan_stages(
        costs,
        num_stages=num_stages,
        pipeline_parallel_size=pipeline_parallel_size,
        boundaries=boundaries,
        placement=placement,
        uneven=uneven,
    )
