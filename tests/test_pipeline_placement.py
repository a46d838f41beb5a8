"""Placement of stages on ranks (``StagePlan.placement``) and schedules as data (``ScheduleSpec``): unit tests, one
process, no process groups."""

from __future__ import annotations

import pytest
import torch  # noqa: F401  (imported first, as in every test module: forked children inherit it)
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import ScheduleDualPipeV

from lightning_parallel.distributed.pipeline import (
    SCHEDULE_SPECS,
    SCHEDULES,
    ScheduleSpec,
    StagePlan,
    plan_stages,
    resolve_schedule,
    schedule_spec,
    validate_schedule_config,
)
from lightning_parallel.distributed.pipeline.config import PipelineConfig
from lightning_parallel.distributed.pipeline.schedule import MULTI_STAGE_SCHEDULES
from lightning_parallel.distributed.pipeline.tied import TiedLayout, TiedParameter


def _plan(num_stages: int, p: int, placement: str = "loop") -> StagePlan:
    """One layer per stage."""
    return StagePlan(tuple(range(num_stages)), num_stages, p, placement)  # type: ignore[arg-type]


# ------------------------------------------------------------------ placement


def test_loop_placement_is_unchanged() -> None:
    plan = StagePlan((0, 1, 2, 3), 4, 2)  # positional, as before: placement defaults to the loop
    assert plan.placement == "loop"
    assert [plan.stages_of(r) for r in range(2)] == [[0, 2], [1, 3]]
    assert [plan.rank_of_stage(s) for s in range(4)] == [0, 1, 0, 1]
    for p in (1, 2, 3, 4):
        for num_stages in range(p, 3 * p + 2):  # also counts that are not a multiple of p (4 stages on 3 ranks)
            plan = _plan(num_stages, p)
            assert [plan.rank_of_stage(s) for s in range(num_stages)] == [s % p for s in range(num_stages)]
            assert [plan.stages_of(r) for r in range(p)] == [list(range(r, num_stages, p)) for r in range(p)]


def test_v_placement_puts_the_way_back_on_the_same_ranks() -> None:
    plan = _plan(4, 2, "v")
    assert plan.stages_of(0) == [0, 3]
    assert plan.stages_of(1) == [1, 2]
    assert [plan.rank_of_stage(s) for s in range(4)] == [0, 1, 1, 0]
    plan = _plan(8, 4, "v")
    assert [plan.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert _plan(2, 1, "v").stages_of(0) == [0, 1]


@pytest.mark.parametrize("placement", ["loop", "v"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_rank_of_stage_and_stages_of_are_inverse(placement: str, p: int) -> None:
    counts = [2 * p] if placement == "v" else [p, p + 1, 2 * p, 3 * p, 3 * p + 1]
    for num_stages in counts:
        plan = _plan(num_stages, p, placement)
        held = [plan.stages_of(r) for r in range(p)]
        assert sorted(s for stages in held for s in stages) == list(range(num_stages))  # each stage exactly once
        for rank, stages in enumerate(held):
            assert stages == sorted(stages)
            assert all(plan.rank_of_stage(s) == rank for s in stages)
        assert plan.stages_of(p) == []  # no such rank: no stages


@pytest.mark.parametrize(
    ("placement", "p", "num_stages"), [("loop", 2, 4), ("loop", 3, 6), ("loop", 4, 4), ("v", 2, 4), ("v", 4, 8)]
)
def test_placement_matches_torchs_mapping(placement: str, p: int, num_stages: int) -> None:
    """Our placement is the one torch's schedules compute for themselves (``stage_index_to_group_rank``)."""
    utils = pytest.importorskip("torch.distributed.pipelining._utils")
    mapping = getattr(utils, "generate_stage_to_rank_mapping", None)
    if mapping is None:
        pytest.skip("this torch has no generate_stage_to_rank_mapping")
    plan = _plan(num_stages, p, placement)
    assert {s: plan.rank_of_stage(s) for s in range(num_stages)} == mapping(p, num_stages, style=placement)


def test_rank_of_layer_follows_the_stage() -> None:
    plan = StagePlan((0, 2, 3, 5), 6, 2, "v")  # stages [0, 1] [2] [3, 4] [5]
    assert [plan.rank_of_layer(i) for i in range(6)] == [0, 0, 1, 1, 1, 0]
    loop = StagePlan((0, 2, 3, 5), 6, 2)
    assert [loop.rank_of_layer(i) for i in range(6)] == [0, 0, 1, 0, 0, 1]


def test_plan_refuses_a_bad_placement() -> None:
    with pytest.raises(ValueError, match=r"`placement='zigzag'` is invalid. Valid placements: loop, v"):
        _plan(4, 2, "zigzag")
    with pytest.raises(ValueError, match=r"`placement='v'` lays two stages on each rank, but the plan has 6 stages"):
        _plan(6, 2, "v")
    with pytest.raises(IndexError, match="Stage 4 is not in this plan of 4 stages"):
        _plan(4, 2).rank_of_stage(4)


def test_plan_stages_passes_the_placement_on() -> None:
    assert plan_stages([1.0] * 8, num_stages=4, pipeline_parallel_size=2).placement == "loop"
    plan = plan_stages([1.0] * 8, num_stages=4, pipeline_parallel_size=2, placement="v")
    assert (plan.starts, plan.placement, plan.stages_of(0)) == ((0, 2, 4, 6), "v", [0, 3])


def test_a_tie_between_first_and_last_stage_needs_no_copy_in_a_v() -> None:
    """The embedding tied to the head: two ranks under the loop, one rank (nothing to communicate) under a V."""
    tied = TiedParameter("embedding.weight", ((0, "weight"), (3, "weight")))
    assert TiedLayout((tied,), _plan(4, 2)).copied == {"embedding.weight": (0, 1)}
    assert TiedLayout((tied,), _plan(4, 2, "v")).copied == {}


# ------------------------------------------------------------------ schedule descriptors


def test_schedule_names_are_derived_from_the_descriptors_as_before() -> None:
    assert SCHEDULES == {
        "GPipe": ScheduleGPipe,
        "1F1B": Schedule1F1B,
        "Interleaved1F1B": ScheduleInterleaved1F1B,
        "LoopedBFS": ScheduleLoopedBFS,
        "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
        "ZBVZeroBubble": ScheduleZBVZeroBubble,
        "DualPipeV": ScheduleDualPipeV,
    }
    assert list(SCHEDULES) == [
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    ]
    assert (
        frozenset({"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
        == MULTI_STAGE_SCHEDULES
    )
    assert [name for name, spec in SCHEDULE_SPECS.items() if spec.placement == "v"] == ["ZBVZeroBubble", "DualPipeV"]
    assert [name for name, spec in SCHEDULE_SPECS.items() if spec.splits_backward] == [
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    ]
    assert {name: spec.default_stages_per_rank for name, spec in SCHEDULE_SPECS.items()} == {
        "GPipe": 1,
        "1F1B": 1,
        "Interleaved1F1B": 2,
        "LoopedBFS": 2,
        "InterleavedZeroBubble": 2,
        "ZBVZeroBubble": 2,
        "DualPipeV": 2,
    }


def test_schedule_spec_resolves_names_like_the_strategy() -> None:
    assert schedule_spec("interleaved1f1b") is SCHEDULE_SPECS["Interleaved1F1B"]
    assert schedule_spec("GPIPE").name == resolve_schedule("GPIPE") == "GPipe"
    assert schedule_spec("zbvzerobubble") is SCHEDULE_SPECS["ZBVZeroBubble"]
    assert schedule_spec("DUALPIPEV").name == "DualPipeV"
    with pytest.raises(ValueError, match=r"Unknown `schedule='DualPipe'`. Valid schedules.*ZBVZeroBubble, DualPipeV"):
        schedule_spec("DualPipe")


_ALL = set(range(1, 9))

# (schedule, pipeline_parallel_size) -> the micro-batch counts in 1..8 that it accepts at its default stages per rank,
# written out by hand from torch's rules as `validate_schedule_config` checked them before the descriptors.
ACCEPTED_MICROBATCHES = {
    ("GPipe", 2): _ALL,
    ("GPipe", 3): _ALL,
    ("GPipe", 4): _ALL,
    ("1F1B", 2): {2, 3, 4, 5, 6, 7, 8},
    ("1F1B", 3): {3, 4, 5, 6, 7, 8},
    ("1F1B", 4): {4, 5, 6, 7, 8},
    ("Interleaved1F1B", 2): {2, 4, 6, 8},
    ("Interleaved1F1B", 3): {3, 6},
    ("Interleaved1F1B", 4): {4, 8},
    ("LoopedBFS", 2): _ALL,
    ("LoopedBFS", 3): _ALL,
    ("LoopedBFS", 4): _ALL,
    ("InterleavedZeroBubble", 2): {2, 4, 6, 8},
    ("InterleavedZeroBubble", 3): {3, 6},
    ("InterleavedZeroBubble", 4): {4, 8},
    # The V schedules (two stages per rank): ZBV takes any count; DualPipeV at least one micro-batch per stage.
    ("ZBVZeroBubble", 2): _ALL,
    ("ZBVZeroBubble", 3): _ALL,
    ("ZBVZeroBubble", 4): _ALL,
    ("DualPipeV", 2): {4, 5, 6, 7, 8},
    ("DualPipeV", 3): {6, 7, 8},
    ("DualPipeV", 4): {8},
}


@pytest.mark.parametrize("num_microbatches", sorted(_ALL))
@pytest.mark.parametrize(("schedule", "p"), sorted(ACCEPTED_MICROBATCHES))
def test_microbatch_rules_give_the_verdicts_of_before(schedule: str, p: int, num_microbatches: int) -> None:
    spec = schedule_spec(schedule)
    counts = {"pipeline_parallel_size": p, "stages_per_rank": spec.default_stages_per_rank}
    error = spec.config_error(num_microbatches=num_microbatches, **counts)
    if num_microbatches in ACCEPTED_MICROBATCHES[schedule, p]:
        assert error is None
        validate_schedule_config(schedule, num_microbatches=num_microbatches, **counts)
    else:
        assert error is not None
        with pytest.raises(ValueError) as raised:
            validate_schedule_config(schedule, num_microbatches=num_microbatches, **counts)
        assert str(raised.value) == error


@pytest.mark.parametrize("stages_per_rank", [1, 2, 3])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_stages_per_rank_rules_give_the_verdicts_of_before(schedule: str, stages_per_rank: int) -> None:
    accepts_several = schedule in {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"}
    runs_exactly = 2 if schedule in {"ZBVZeroBubble", "DualPipeV"} else 1
    error = schedule_spec(schedule).config_error(
        pipeline_parallel_size=2, stages_per_rank=stages_per_rank, num_microbatches=4
    )
    assert (error is None) == (accepts_several or stages_per_rank == runs_exactly)


def test_error_messages_are_the_ones_of_before() -> None:
    def error(schedule: str, p: int, v: int, m: int) -> str | None:
        return schedule_spec(schedule).config_error(pipeline_parallel_size=p, stages_per_rank=v, num_microbatches=m)

    assert error("1F1B", 2, 2, 4) == (
        "`schedule='1F1B'` runs one stage per rank, but `stages_per_rank=2`. Use `stages_per_rank=1` or a multi-stage"
        " schedule: Interleaved1F1B, InterleavedZeroBubble, LoopedBFS."
    )
    assert error("1F1B", 4, 1, 2) == (
        "`schedule='1F1B'` needs at least as many micro-batches as pipeline ranks, but `num_microbatches=2` < 4"
        " (1F1B warms up one micro-batch per stage). Use `num_microbatches >= 4` (more shrinks the bubble) or 'GPipe'."
    )
    assert error("Interleaved1F1B", 2, 2, 3) == (
        "`schedule='Interleaved1F1B'` needs `num_microbatches` to be a multiple of the pipeline size 2, got 3."
    )


def test_the_config_defaults_come_from_the_descriptor() -> None:
    def resolved(schedule: str, world_size: int = 4) -> PipelineConfig:
        return PipelineConfig.resolve(
            world_size=world_size,
            pipeline_parallel_size="auto",
            schedule=schedule,
            stages_per_rank="auto",
            num_microbatches="auto",
        )

    assert [resolved(name).stages_per_rank for name in SCHEDULES] == [1, 1, 2, 2, 2, 2, 2]
    assert resolved("DualPipeV").num_microbatches == 8  # the number of stages: DualPipeV's minimum
    assert resolved("Interleaved1F1B").num_microbatches == 8
    assert resolved("Interleaved1F1B", world_size=1).stages_per_rank == 1  # one rank: one stage, whatever the schedule
    assert resolved("Interleaved1F1B").spec is SCHEDULE_SPECS["Interleaved1F1B"]
    assert resolved("Interleaved1F1B", world_size=1).spec is SCHEDULE_SPECS["1F1B"]


def test_a_v_schedule_is_one_descriptor() -> None:
    """What adding torch's ``ScheduleZBVZeroBubble`` took (issue 32, item 2): its descriptor, whose placement the plan
    follows."""
    zbv = ScheduleSpec(
        name="ZBVZeroBubble",
        torch_class=ScheduleZBVZeroBubble,
        default_stages_per_rank=2,
        placement="v",
        splits_backward=True,
    )
    assert SCHEDULE_SPECS["ZBVZeroBubble"] == zbv
    assert zbv.is_multi_stage
    assert zbv.config_error(pipeline_parallel_size=2, stages_per_rank=2, num_microbatches=4) is None
    error = zbv.config_error(pipeline_parallel_size=2, stages_per_rank=3, num_microbatches=4)
    assert error is not None and error.startswith(
        "`schedule='ZBVZeroBubble'` runs exactly 2 stages per rank, but `stages_per_rank=3`. Use `stages_per_rank=2`"
    )
    plan = plan_stages([1.0] * 4, num_stages=4, pipeline_parallel_size=2, placement=zbv.placement)
    assert (plan.stages_of(0), plan.stages_of(1)) == ([0, 3], [1, 2])
    assert SCHEDULES["ZBVZeroBubble"] is ScheduleZBVZeroBubble
