"""Schedules and process groups of a pipeline: names, their constraints, and building torch's stages/schedules.

Torch-only. We use ``torch.distributed.pipelining``'s ``PipelineStage`` and schedule classes as they are; this
module only picks them, checks their constraints up front (so a bad configuration raises the same ``ValueError`` on
every rank instead of hanging) and lays ranks out as ``data-parallel replica x pipeline rank``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, ScheduleDualPipeV

from lightning_parallel.accounting import tensor_bytes
from lightning_parallel.distributed.pipeline import _compat
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.partition import Placement, StageModule, StagePlan
from lightning_parallel.distributed.pipeline.side_effects import preserved_state

__all__ = [
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "SCHEDULE_SPECS",
    "ChunkObserver",
    "P2PObserver",
    "PipelineRuntime",
    "ScheduleSpec",
    "SideEffectFreePipelineStage",
    "build_runtime",
    "check_count",
    "resolve_schedule",
    "schedule_spec",
    "validate_schedule_config",
]


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """What the rest of the pipeline needs to know of one schedule, as data: its torch class, how many stages a rank
    runs and where they are placed, its micro-batch rules and whether it splits backward.

    Adding a schedule is one entry in :data:`SCHEDULE_SPECS` (the V-shaped ones, torch's ``ScheduleZBVZeroBubble``
    and ``ScheduleDualPipeV``: ``default_stages_per_rank=2, runs_any_stages_per_rank=False, placement="v",
    splits_backward=True``); the stage plan takes the entry's placement, and :func:`build_runtime` evaluates
    (forward-only) with a schedule of the same placement.
    """

    name: str
    """torch's name, without the ``Schedule`` prefix (what users pass as ``schedule=``)."""
    torch_class: type[PipelineScheduleSingle] | type[PipelineScheduleMulti]
    """The class built for training; a subclass of ``PipelineScheduleMulti`` takes every stage of a rank."""
    default_stages_per_rank: int = 1
    """What ``stages_per_rank="auto"`` becomes on a pipeline of several ranks."""
    runs_any_stages_per_rank: bool = False
    """Whether any ``stages_per_rank >= 1`` runs (the looped schedules); else exactly the default."""
    placement: Placement = "loop"
    """Which rank holds each stage (:attr:`.StagePlan.placement`): the stage plan must be built with it."""
    needs_microbatch_per_rank: bool = False
    """At least ``pipeline_parallel_size`` micro-batches: 1F1B warms up one micro-batch per stage."""
    needs_microbatches_multiple_of_ranks: bool = False
    """``num_microbatches`` a multiple of ``pipeline_parallel_size``: torch's interleaved schedules run the
    micro-batches in rounds of ``p``."""
    needs_microbatch_per_stage: bool = False
    """At least as many micro-batches as stages (``p x stages_per_rank``): torch's ``ScheduleDualPipeV`` refuses
    fewer (its two halves of the batch each fill the V)."""
    splits_backward: bool = False
    """Backward split into input gradients and weight gradients (zero bubble): the weight gradients are computed
    outside autograd's backward, so hooks that reduce gradients as backward produces them (FSDP2's) miss them."""

    @property
    def is_multi_stage(self) -> bool:
        """Whether torch's class takes a list of stages (several per rank), rather than one stage."""
        return issubclass(self.torch_class, PipelineScheduleMulti)

    def config_error(self, *, pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> str | None:
        """Why torch cannot run this schedule with these counts (the bad values and the fix), or ``None``."""
        p, m = pipeline_parallel_size, num_microbatches
        if not self.runs_any_stages_per_rank and stages_per_rank != self.default_stages_per_rank:
            return self._stages_per_rank_error(stages_per_rank)
        if self.needs_microbatch_per_rank and m < p:
            return (
                f"`schedule={self.name!r}` needs at least as many micro-batches as pipeline ranks, but"
                f" `num_microbatches={m}` < {p} (1F1B warms up one micro-batch per stage). Use"
                f" `num_microbatches >= {p}` (more shrinks the bubble) or 'GPipe'."
            )
        if self.needs_microbatch_per_stage and m < p * stages_per_rank:
            return (
                f"`schedule={self.name!r}` needs at least as many micro-batches as stages, but `num_microbatches={m}`"
                f" < {p * stages_per_rank} ({p} ranks x {stages_per_rank} stages). Use"
                f" `num_microbatches >= {p * stages_per_rank}` or 'ZBVZeroBubble', which takes any count."
            )
        if self.needs_microbatches_multiple_of_ranks and m % p:
            return (
                f"`schedule={self.name!r}` needs `num_microbatches` to be a multiple of the pipeline size {p}, got {m}."
            )
        return None

    def check(self, *, pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> None:
        """Raise :meth:`config_error` as a ``ValueError``, if any."""
        error = self.config_error(
            pipeline_parallel_size=pipeline_parallel_size,
            stages_per_rank=stages_per_rank,
            num_microbatches=num_microbatches,
        )
        if error is not None:
            raise ValueError(error)

    def _stages_per_rank_error(self, stages_per_rank: int) -> str:
        looped = ", ".join(sorted(s.name for s in SCHEDULE_SPECS.values() if s.runs_any_stages_per_rank))
        if self.default_stages_per_rank == 1:
            return (
                f"`schedule={self.name!r}` runs one stage per rank, but `stages_per_rank={stages_per_rank}`. Use"
                f" `stages_per_rank=1` or a multi-stage schedule: {looped}."
            )
        return (
            f"`schedule={self.name!r}` runs exactly {self.default_stages_per_rank} stages per rank, but"
            f" `stages_per_rank={stages_per_rank}`. Use `stages_per_rank={self.default_stages_per_rank}` (or 'auto')"
            f" or a schedule that runs any number: {looped}."
        )


SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(name="GPipe", torch_class=ScheduleGPipe),
        ScheduleSpec(name="1F1B", torch_class=Schedule1F1B, needs_microbatch_per_rank=True),
        ScheduleSpec(
            name="Interleaved1F1B",
            torch_class=ScheduleInterleaved1F1B,
            default_stages_per_rank=2,
            runs_any_stages_per_rank=True,
            needs_microbatch_per_rank=True,
            needs_microbatches_multiple_of_ranks=True,
        ),
        ScheduleSpec(
            name="LoopedBFS", torch_class=ScheduleLoopedBFS, default_stages_per_rank=2, runs_any_stages_per_rank=True
        ),
        ScheduleSpec(
            name="InterleavedZeroBubble",
            torch_class=ScheduleInterleavedZeroBubble,
            default_stages_per_rank=2,
            runs_any_stages_per_rank=True,
            needs_microbatch_per_rank=True,
            needs_microbatches_multiple_of_ranks=True,
            splits_backward=True,
        ),
        ScheduleSpec(
            name="ZBVZeroBubble",
            torch_class=ScheduleZBVZeroBubble,
            default_stages_per_rank=2,
            placement="v",
            splits_backward=True,
        ),
        ScheduleSpec(
            name="DualPipeV",
            torch_class=ScheduleDualPipeV,
            default_stages_per_rank=2,
            placement="v",
            needs_microbatch_per_stage=True,
            splits_backward=True,
        ),
    )
}
"""The schedules we support, by their torch names, in the order error messages list them."""

SCHEDULES: dict[str, type] = {name: spec.torch_class for name, spec in SCHEDULE_SPECS.items()}
"""The torch class of each supported schedule (from :data:`SCHEDULE_SPECS`)."""

MULTI_STAGE_SCHEDULES = frozenset(name for name, spec in SCHEDULE_SPECS.items() if spec.is_multi_stage)
"""Schedules that run several (virtual) stages per rank (from :data:`SCHEDULE_SPECS`)."""


def resolve_schedule(name: str) -> str:
    """The canonical spelling of a schedule name (case-insensitive).

    Raises:
        ValueError: For an unknown name, listing the valid ones.
    """
    by_lower = {key.lower(): key for key in SCHEDULE_SPECS}
    if not isinstance(name, str) or name.lower() not in by_lower:
        raise ValueError(
            f"Unknown `schedule={name!r}`. Valid schedules (case-insensitive): {', '.join(SCHEDULE_SPECS)}."
        )
    return by_lower[name.lower()]


def schedule_spec(name: str) -> ScheduleSpec:
    """The descriptor of schedule ``name`` (case-insensitive).

    Raises:
        ValueError: For an unknown name, listing the valid ones.
    """
    return SCHEDULE_SPECS[resolve_schedule(name)]


def validate_schedule_config(
    schedule: str, *, pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int
) -> None:
    """Check torch's constraints for ``schedule`` (its :class:`ScheduleSpec`'s rules) before anything runs.

    Raises:
        ValueError: With the bad values and the fix.
    """
    schedule_spec(schedule).check(
        pipeline_parallel_size=pipeline_parallel_size,
        stages_per_rank=stages_per_rank,
        num_microbatches=num_microbatches,
    )


def check_count(name: str, value: Any) -> None:
    """``value`` must be a positive integer or ``"auto"``.

    Raises:
        ValueError: Naming the argument and the bad value.
    """
    if value == "auto" and isinstance(value, str):
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}={value!r}` is invalid: use a positive integer or 'auto'.")


@dataclass
class PipelineRuntime:
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


ChunkObserver = Callable[[str, int], AbstractContextManager[Any]]
"""``fn(kind, stage_index)``: a context the stage runs one ``"F"``/``"B"``/``"W"`` chunk in (the observer marks its
start and end with its own clock: CUDA events on a GPU, where the host's clock would time kernel launches)."""

P2PObserver = Callable[[str, int], None]
"""``fn("send" | "recv", num_bytes)``: a stage handed the schedule one P2P op of ``num_bytes`` to send or receive."""


class SideEffectFreePipelineStage(PipelineStage):
    """``PipelineStage`` whose metadata inference leaves the stage's buffers and the RNG streams as they were, and
    which reports the time of every chunk it runs to :attr:`on_chunk` and every P2P op it sends or receives to
    :attr:`on_p2p`.

    torch infers shapes by running each stage's forward once more before the first micro-batch: the first stage on
    micro-batch 0, the others on uninitialised tensors. In training mode that updated BatchNorm's running statistics
    with garbage on the later stages and ``num_batches_tracked`` one too high (issue 10, item 7). torch has no public
    hook around that run, so this fixed class overrides the private method that runs it, whose name depends on the
    torch version (:func:`._compat.stage_inference_method`); the other name passes through unchanged. (Recent torch's
    static mode, every stage's ``input_args``/``output_args`` given up front, would skip the run: it needs each
    stage's shapes for every batch shape before its first step.)

    Chunk times (a monitor's busy time and timeline) come from overriding the schedule-facing methods that run one
    micro-batch (``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``): every torch schedule
    drives a stage through them. P2P bytes come from the methods that build the activations' and gradients' send and
    receive ops (``get_{fwd,bwd}_{send,recv}_ops``), which the schedules hand to ``batch_isend_irecv`` as they are:
    each op's tensor is what is sent or received (torch's one-off neighbour warm-up at the first step is not counted).
    """

    on_chunk: ChunkObserver | None = None
    """Runs each chunk inside ``on_chunk(kind, stage_index)``; ``None``: nothing is timed."""
    on_p2p: P2PObserver | None = None
    """Told the kind and bytes of each P2P op; ``None``: nothing is counted."""

    def get_fwd_send_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
        return self._counted("send", super().get_fwd_send_ops(*args, **kwargs))

    def get_bwd_send_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
        return self._counted("send", super().get_bwd_send_ops(*args, **kwargs))

    def get_fwd_recv_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
        return self._counted("recv", super().get_fwd_recv_ops(*args, **kwargs))

    def get_bwd_recv_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
        return self._counted("recv", super().get_bwd_recv_ops(*args, **kwargs))

    def _counted(self, kind: str, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        if self.on_p2p is not None:
            for op in ops:
                self.on_p2p(kind, tensor_bytes(op.tensor))
        return ops

    # A V schedule built without a loss (evaluation) still runs its backward actions: torch skips each one's compute
    # and P2P ops (``has_backward`` is false), but hands the input gradient of the stage that follows on the same rank
    # (stages p-1 and p share the V's tip) to its neighbour unconditionally, which raises without a backward. With
    # nothing to hand over, these two pass nothing.
    def get_local_bwd_output(self, mb_index: int) -> Any:
        if not self.has_backward:
            return ()
        return super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if not self.has_backward:
            return
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    # torch <= 2.11 warms up the P2P channels to both neighbouring stages at the first step, also to a neighbour on
    # this same rank (a V placement's tip: stages p-1 and p), which gloo refuses ("Pair is not connected"; the
    # ZBVZeroBubble and DualPipeV schedules failed at their first step). Same-rank stages hand tensors over locally,
    # so their warm-up is dropped; later torch replaced this warm-up by a vote that skips them.
    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if _compat.p2p_peer(op) != self.group_rank]

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._observed("F", super().forward_one_chunk, args, kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._observed("B", super().backward_one_chunk, args, kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._observed("W", super().backward_weight_one_chunk, args, kwargs)

    def _observed(self, kind: str, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        observer = self.on_chunk
        if observer is None:
            return run(*args, **kwargs)
        with observer(kind, self.stage_index):
            return run(*args, **kwargs)

    def _compute_outputs(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_inference("_compute_outputs", args, kwargs)

    def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_inference("_shape_inference", args, kwargs)

    def _run_inference(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inference = getattr(super(), name)
        if name != _compat.stage_inference_method(PipelineStage):
            return inference(*args, **kwargs)
        with preserved_state(self.submod, devices=[self.device]):
            return inference(*args, **kwargs)


def build_runtime(
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
) -> PipelineRuntime:
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
    else:
        torch_schedule = schedule_class(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return PipelineRuntime(schedule=torch_schedule, stages=stages)
