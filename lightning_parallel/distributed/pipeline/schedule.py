"""The schedules a pipeline runs, as data: one :class:`ScheduleSpec` per torch schedule, and their constraints.

Torch-only. We use ``torch.distributed.pipelining``'s schedule classes as they are; this module only names them and
checks their constraints up front (so a bad configuration raises the same ``ValueError`` on every rank instead of
hanging). :mod:`.torch_schedule` builds torch's stages and schedule from a spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, ScheduleDualPipeV

__all__ = [
    "MULTI_STAGE_SCHEDULES",
    "PLACEMENTS",
    "SCHEDULES",
    "SCHEDULE_SPECS",
    "Placement",
    "ScheduleSpec",
    "resolve_schedule",
    "schedule_spec",
    "validate_schedule_config",
]


Placement = Literal["loop", "v"]
"""Which pipeline rank holds each stage: ``"loop"`` (stage ``s`` on rank ``s % p``) or ``"v"`` (down the ranks and
back up); a schedule's :attr:`ScheduleSpec.placement`, which a :class:`~.stage_plan.StagePlan` must be built with."""
PLACEMENTS: tuple[Placement, ...] = ("loop", "v")


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """What the rest of the pipeline needs to know of one schedule, as data: its torch class, how many stages a rank
    runs and where they are placed, its micro-batch rules and whether it splits backward.

    Adding a schedule is one entry in :data:`SCHEDULE_SPECS` (the V-shaped ones, torch's ``ScheduleZBVZeroBubble``
    and ``ScheduleDualPipeV``: ``default_stages_per_rank=2, runs_any_stages_per_rank=False, placement="v",
    splits_backward=True``); the stage plan takes the entry's placement, and :func:`.build_torch_schedule` evaluates
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


_interleaved = partial(
    ScheduleSpec,
    default_stages_per_rank=2,
    runs_any_stages_per_rank=True,
    needs_microbatch_per_rank=True,
    needs_microbatches_multiple_of_ranks=True,
)
"""torch's interleaved schedules (``ScheduleInterleaved1F1B`` and its zero-bubble variant): the same rules."""

SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(name="GPipe", torch_class=ScheduleGPipe),
        ScheduleSpec(name="1F1B", torch_class=Schedule1F1B, needs_microbatch_per_rank=True),
        _interleaved(name="Interleaved1F1B", torch_class=ScheduleInterleaved1F1B),
        ScheduleSpec(
            name="LoopedBFS", torch_class=ScheduleLoopedBFS, default_stages_per_rank=2, runs_any_stages_per_rank=True
        ),
        _interleaved(name="InterleavedZeroBubble", torch_class=ScheduleInterleavedZeroBubble, splits_backward=True),
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
