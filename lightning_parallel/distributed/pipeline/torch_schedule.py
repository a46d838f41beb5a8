"""torch's stages and schedule for one input shape and mode, built from a :class:`~.schedule.ScheduleSpec`.

Torch-only. :func:`build_torch_schedule` wraps this rank's stages (:class:`~.stage_module.StageModule`) in
:class:`~.torch_stage.SideEffectFreePipelineStage` objects and builds the spec's torch schedule over them; the
:class:`TorchSchedule` record holds both (:class:`~.engine.PipelineEngine` keeps one per input shape and mode).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from lightning_parallel.distributed.pipeline import _compat
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.schedule import schedule_spec
from lightning_parallel.distributed.pipeline.stage_module import StageModule
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.torch_stage import ChunkObserver, P2PObserver, SideEffectFreePipelineStage

__all__ = ["TorchSchedule", "build_torch_schedule"]


@dataclass
class TorchSchedule:
    """torch's stages and schedule for one input shape and mode (training or forward-only)."""

    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    stages: list[PipelineStage]

    @property
    def has_first_stage(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def last_stage_outputs(self) -> list[Any]:
        """Output of every micro-batch of the last stage after a step (only on the rank that holds it)."""
        (stage,) = [stage for stage in self.stages if stage.is_last]
        return list(stage.output_chunks)

    @property
    def backward_initialized(self) -> bool:
        """Whether torch finished its metadata inference (which calls the loss function once on a dummy output)."""
        return _compat.schedule_backward_initialized(self.schedule)


def build_torch_schedule(
    *,
    schedule: str,
    plan: StagePlan,
    layers: Sequence[torch.nn.Module],
    dims: ParallelDims,
    num_microbatches: int,
    device: torch.device,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    side_dtypes: Mapping[str, torch.dtype] | None = None,
    on_chunk: ChunkObserver | None = None,
    on_p2p: P2PObserver | None = None,
) -> TorchSchedule:
    """Wrap this rank's stages in ``PipelineStage`` objects and build the schedule.

    ``loss_fn=None`` builds a forward-only schedule (evaluation): GPipe's forward phase for one stage per rank,
    LoopedBFS's for several placed in a loop, and the V schedule itself for a V placement (torch has no forward-only
    schedule of that placement; its backward actions do nothing without a loss). Gradients are never scaled by torch
    (``scale_grads=False``): the caller's loss already divides by the number of micro-batches and accumulation steps
    (torch's scaling would also rescale gradients accumulated in earlier steps, pytorch/torchtitan#1733).
    ``side_dtypes``: the model call's side inputs (:mod:`.side_inputs`, name to dtype), which every stage carries
    along.
    ``on_chunk`` / ``on_p2p``: told of every chunk the stages run / P2P op they send or receive.
    """
    _compat.stage_inference_method(PipelineStage)  # this torch has the method the stages wrap (a clear error if not)
    built = [
        SideEffectFreePipelineStage(
            StageModule(
                [layers[i] for i in plan.layers_of(stage_index)],
                side_dtypes=side_dtypes,
                is_first=stage_index == 0,
                is_last=stage_index == plan.num_stages - 1,
            ),
            stage_index,
            plan.num_stages,
            device,
            group=dims.pipeline_group,
        )
        for stage_index in plan.stages_of(dims.pipeline_rank)
    ]
    for stage in built:
        stage.on_chunk, stage.on_p2p = on_chunk, on_p2p
    stages: list[PipelineStage] = list(built)
    spec = schedule_spec(schedule)
    if loss_fn is None and spec.placement == "loop":
        spec = schedule_spec("LoopedBFS" if len(stages) > 1 else "GPipe")
    # torch's schedules place stages by their own rule (`stage_index_to_group_rank`): the plan must agree with it.
    assert spec.placement == plan.placement, f"{spec.name} places stages {spec.placement!r}, the plan {plan.placement}"
    schedule_class = spec.torch_class
    torch_schedule: PipelineScheduleSingle | PipelineScheduleMulti
    if issubclass(schedule_class, PipelineScheduleMulti):  # spec.is_multi_stage, spelled so that mypy narrows it
        torch_schedule = schedule_class([*stages], num_microbatches, loss_fn=loss_fn, scale_grads=False)
        _compat.send_between_overlapped_actions(torch_schedule)  # DualPipeV: a pair's forward output sent before its B
    else:
        torch_schedule = schedule_class(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return TorchSchedule(schedule=torch_schedule, stages=stages)
