"""The pipeline's settings as one frozen record, resolved from the user's arguments once the world size is known.

Torch-only (no Lightning). ``PipelineParallelStrategy`` resolves it in ``connect`` (every rank, before any
collective) and reads every count from it; :meth:`PipelineConfig.validate` raises the same ``ValueError`` on every
rank for a layout torch's schedules cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_parallel.distributed.pipeline.schedule import ScheduleSpec, schedule_spec, validate_schedule_config

__all__ = ["Count", "PipelineConfig", "check_count"]

Count = int | Literal["auto"]
"""A count the user gives: a positive integer, or ``"auto"`` (resolved once the world size is known)."""


def check_count(name: str, value: Any) -> None:
    """``value`` must be a positive integer or ``"auto"``.

    Raises:
        ValueError: Naming the argument and the bad value.
    """
    if value == "auto" and isinstance(value, str):
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}={value!r}` is invalid: use a positive integer or 'auto'.")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How many ranks, stages and micro-batches a pipeline has, with every ``"auto"`` resolved."""

    world_size: int
    """Ranks in the job (pipelines x replicas)."""
    pipeline_parallel_size: int
    """Ranks per pipeline; the other factor of the world size is the number of data-parallel replicas."""
    schedule: str
    """The schedule the user asked for (canonical torch name)."""
    stages_per_rank: int
    """Virtual stages per rank: by default the schedule's (``ScheduleSpec.default_stages_per_rank``: 2 for the
    multi-stage schedules, else 1; the V-shaped ones run exactly 2); always 1 on a one-rank pipeline."""
    num_microbatches: int
    """Micro-batches per batch (by default the number of stages: the minimum for 1F1B and DualPipeV)."""

    @classmethod
    def resolve(
        cls,
        *,
        world_size: int,
        pipeline_parallel_size: Count,
        schedule: str,
        stages_per_rank: Count,
        num_microbatches: Count,
        tensor_parallel_size: int = 1,
    ) -> PipelineConfig:
        """Replace every ``"auto"``: ``pipeline_parallel_size`` = the world size over ``tensor_parallel_size`` (every
        rank of one tensor rank in the pipeline), ``stages_per_rank`` = the schedule's default (2 for the multi-stage
        schedules, else 1), ``num_microbatches`` = the number of stages. Does not validate the counts."""
        automatic = max(1, world_size // tensor_parallel_size)  # a size that does not divide: the mesh names it
        p = automatic if pipeline_parallel_size == "auto" else int(pipeline_parallel_size)
        if p == 1:
            per_rank = 1
        elif stages_per_rank == "auto":
            per_rank = schedule_spec(schedule).default_stages_per_rank
        else:
            per_rank = int(stages_per_rank)
        microbatches = p * per_rank if num_microbatches == "auto" else int(num_microbatches)
        return cls(
            world_size=world_size,
            pipeline_parallel_size=p,
            schedule=schedule,
            stages_per_rank=per_rank,
            num_microbatches=microbatches,
        )

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def effective_schedule(self) -> str:
        """The schedule that runs: :attr:`schedule`, or ``"1F1B"`` on a one-rank pipeline (a single stage, where
        every schedule degenerates to forward and backward per micro-batch; torch's multi-stage runtimes also
        mishandle several stages on one rank in forward-only runs)."""
        return "1F1B" if self.pipeline_parallel_size == 1 else self.schedule

    @property
    def spec(self) -> ScheduleSpec:
        """The descriptor of :attr:`effective_schedule`: its stage placement (build the stage plan with
        ``placement=config.spec.placement``), micro-batch rules, whether it splits backward."""
        return schedule_spec(self.effective_schedule)

    def validate(self) -> None:
        """Raise ``ValueError`` (the bad values and the fix) for a layout the world size or torch cannot run."""
        p = self.pipeline_parallel_size
        if self.world_size % p:
            raise ValueError(
                f"The world size ({self.world_size}) is not divisible by `pipeline_parallel_size={p}`; the remaining"
                f" ranks form data-parallel replicas of the pipeline. Use a divisor of {self.world_size}."
            )
        validate_schedule_config(
            self.effective_schedule,
            pipeline_parallel_size=p,
            stages_per_rank=self.stages_per_rank,
            num_microbatches=self.num_microbatches,
        )
