"""Unit: the planner's bubble played with per-stage, per-kind action costs (``planner.bubble.ActionCosts``).

Exact facts: hand-played small schedules, the unit costs' formulas unchanged, torch's first stage (no input gradient).
"""

from __future__ import annotations

import pytest

from lightning_parallel.planner.bubble import (
    UNIT_COSTS,
    ActionCosts,
    schedule_order,
    simulate_schedule,
    simulated_bubble,
)

SCHEDULES = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}
"""Every schedule and its stages per rank."""


def test_the_first_stage_has_no_input_gradient_its_weight_gradient_is_its_whole_backward() -> None:
    costs = ActionCosts(forward=(1.0, 2.0), input_grad=(3.0, 4.0), weight_grad=(5.0, 6.0), per_action=0.5)
    assert [costs.of(kind, 0) for kind in "FIWB"] == [1.5, 0.5, 8.5, 8.5]  # torch skips the first stage's I
    assert [costs.of(kind, 1) for kind in "FIWB"] == [2.5, 4.5, 6.5, 10.5]
    assert [UNIT_COSTS.of(kind, 3) for kind in "FIWB"] == [1.0, 1.0, 1.0, 2.0]


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES.items())
def test_equal_stages_of_unit_cost_give_the_planners_bubble(schedule: str, v: int) -> None:
    p, m = 2, 8
    equal = ActionCosts(forward=(1.0,) * (p * v), input_grad=(1.0,) * (p * v), weight_grad=(1.0,) * (p * v))
    kwargs = {"pipeline_parallel_size": p, "num_microbatches": m, "stages_per_rank": v}
    assert simulated_bubble(schedule, **kwargs, costs=equal) == simulated_bubble(schedule, **kwargs)
    doubled = ActionCosts(forward=(2.0,) * (p * v), input_grad=(2.0,) * (p * v), weight_grad=(2.0,) * (p * v))
    assert simulated_bubble(schedule, **kwargs, costs=doubled) == pytest.approx(simulated_bubble(schedule, **kwargs))


def test_a_slower_second_stage_played_by_hand() -> None:
    # 1F1B, p=2, m=2; stage 1 twice as slow. Rank 0: F0.0 [0,1], F0.1 [1,2], B0.0 [7,9] (waits for stage 1's input
    # gradient of micro-batch 0), B0.1 [13,15]; rank 1: F1.0 [1,3], B1.0 [3,7], F1.1 [7,9], B1.1 [9,13].
    costs = ActionCosts(forward=(1.0, 2.0), input_grad=(1.0, 2.0), weight_grad=(1.0, 2.0))
    times = simulate_schedule(schedule_order("1F1B", 2, 2, 1), costs)
    assert times.makespan == 15.0
    assert times.busy == (6.0, 12.0)
    assert times.bubble == pytest.approx(((1 - 6 / 15) + (1 - 12 / 15)) / 2)


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES.items())
def test_a_cost_per_action_is_busy_time_on_every_action(schedule: str, v: int) -> None:
    order = schedule_order(schedule, 2, 4, v)
    actions = [sum(len(action) for action in rank) for rank in order]
    plain, with_overhead = simulate_schedule(order), simulate_schedule(order, ActionCosts(per_action=0.25))
    assert with_overhead.busy == tuple(b + 0.25 * n for b, n in zip(plain.busy, actions, strict=True))
    assert with_overhead.makespan >= plain.makespan


def test_time_outside_chunks_played_by_hand() -> None:
    # 1F1B, p=2, m=2, unit chunks (a backward costs 2), 0.5 before every action, 0.25 of loss after each forward of the
    # last stage, 1.0 at the step's edges. Rank 0: F0.0 [0.5, 1.5], F0.1 [2, 3], B0.0 [5.25, 7.25] (waits for stage 1's
    # input gradient), B0.1 [9.5, 11.5]; rank 1: F1.0 [1.5, 2.5] + loss, B1.0 [3.25, 5.25], F1.1 [5.75, 6.75] + loss,
    # B1.1 [7.5, 9.5]. Busy time is the chunks only: the rest is idle, as a monitor counts it.
    costs = ActionCosts(between_actions=0.5, loss=0.25, edges=1.0)
    times = simulate_schedule(schedule_order("1F1B", 2, 2, 1), costs)
    assert times.makespan == 12.5
    assert times.busy == (6.0, 6.0)
    assert times.starts == (0.5, 1.5)
    assert times.ends == (11.5, 9.5)


def test_a_measured_step_played_as_it_ran() -> None:
    # 1F1B, p=2, m=2, unit chunks but micro-batch 0's forward on stage 0 took 3: every later action waits 2 more.
    order = schedule_order("1F1B", 2, 2, 1)
    slow = ActionCosts(actions=((("F", 0, 0), 3.0),))
    assert [slow.of("F", 0, 0), slow.of("F", 0, 1), slow.of("F", 0)] == [3.0, 1.0, 1.0]
    plain, played = simulate_schedule(order), simulate_schedule(order, slow)
    assert played.makespan == plain.makespan + 2.0
    assert played.busy == (plain.busy[0] + 2.0, plain.busy[1])


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES.items())
def test_time_outside_chunks_is_idle_and_never_shortens_a_step(schedule: str, v: int) -> None:
    order = schedule_order(schedule, 2, 4, v)
    plain = simulate_schedule(order)
    for costs in (ActionCosts(between_actions=0.25), ActionCosts(loss=0.5)):
        times = simulate_schedule(order, costs)
        assert times.busy == plain.busy
        assert times.makespan > plain.makespan
    assert simulate_schedule(order, ActionCosts(edges=2.0)).makespan == plain.makespan + 2.0


def test_bad_costs_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"`forward=\(1.0, -1.0\)`: costs must be non-negative"):
        ActionCosts(forward=(1.0, -1.0))
    with pytest.raises(ValueError, match="`per_action=nan`"):
        ActionCosts(per_action=float("nan"))
    for name in ("between_actions", "loss", "edges"):
        with pytest.raises(ValueError, match=f"`{name}=-1.0` must be a non-negative number"):
            ActionCosts(**{name: -1.0})
    with pytest.raises(ValueError, match=r"`actions=\(\(\('F', 0, 0\), -1.0\),\)`: costs must be non-negative"):
        ActionCosts(actions=((("F", 0, 0), -1.0),))
    with pytest.raises(ValueError, match=r"No cost for stage 2: 2 given \(\(1.0, 1.0\)\); give one per stage"):
        simulate_schedule(schedule_order("1F1B", 3, 3, 1), ActionCosts(forward=(1.0, 1.0)))
