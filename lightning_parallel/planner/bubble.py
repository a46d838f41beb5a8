"""The pipeline bubble of a schedule, from torch's own order of its actions rather than a textbook formula.

Every torch schedule computes, on construction, the list of compute actions each rank runs (``pipeline_order``:
forward ``F``, full backward ``B``, or backward split into input gradients ``I`` and weight gradients ``W``, and
DualPipeV's overlapped forward/backward pairs). :func:`simulated_bubble` builds that list for a pipeline of any size
without a process group or a model (stand-in stages that carry only the indices the schedule reads), then plays it:
each rank runs its actions in order, an action starting once the rank is free and what it needs is done (the
previous stage's forward of the micro-batch, the next stage's input gradient, its own input gradient for ``W``).
Costs are in units of one stage's forward: ``F = I = W = 1``, ``B = 2`` (a matrix product's input and weight
gradients each cost about its forward), communication free, equal stages. As torch runs it, the first stage computes no
input gradient (its input is the batch): its ``I`` costs nothing and its ``W`` is its whole backward.
:class:`ActionCosts` plays the same order with other costs: each stage's own ``F``, ``I`` and ``W`` (unequal stages, a
last stage that also computes the loss, input gradients dearer than weight gradients where attention has no weights)
and the time a monitor counts idle although the rank is not waiting: before every action (the schedule's own work and
its P2P calls), after each forward of the last stage (the loss) and at the step's edges (splitting the batch, the
outcome sent). The benchmark plays it with the costs it measured, which tells a plan's stage imbalance from its
overheads.

Why not the formulas: ``(p-1)/(m+p-1)`` and Megatron's interleaved ``(p-1)/(vm+p-1)`` describe 1F1B and one
interleaved order; zero-bubble and V-shaped schedules (``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``)
fill the bubble with weight gradients in orders no closed form covers, and torch changes those orders between
releases. Playing torch's order gives the formulas back where they hold (tested) and the right figure where they do
not. Only the order is read: torch's private ``_Action`` fields (``stage_index``, ``computation_type``,
``microbatch_index``, ``sub_actions``), checked on import by the tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_parallel.distributed.pipeline.schedule import schedule_spec

__all__ = [
    "ActionCosts",
    "Order",
    "ScheduleTimes",
    "action_needs",
    "schedule_order",
    "simulate_schedule",
    "simulated_bubble",
]

_KINDS = ("F", "I", "W", "B")


@dataclass(frozen=True, kw_only=True)
class ActionCosts:
    """What each action of a schedule costs, in any one unit: per stage, its forward, input gradient and weight
    gradient; a full backward ``B`` is ``I + W``. The first stage's input gradient is never computed (torch skips it:
    the first stage's input is the batch), so there ``I`` is free and ``W`` (or ``B``) costs its ``I + W``.
    The default is the planner's: every stage ``F = I = W = 1``, no overhead."""

    forward: tuple[float, ...] = ()
    """Per stage index; ``()``: 1 for every stage."""
    input_grad: tuple[float, ...] = ()
    """Per stage index; ``()``: 1 for every stage."""
    weight_grad: tuple[float, ...] = ()
    """Per stage index; ``()``: 1 for every stage."""
    per_action: float = 0.0
    """Added to every action, busy time included: work a chunk does that scales with the number of actions."""
    between_actions: float = 0.0
    """Time a rank spends before each action outside any chunk, idle as a monitor counts it (time outside the
    forward and backward chunks): the schedule's own work and its P2P calls (posting receives, issuing and waiting
    for sends) around a chunk."""
    loss: float = 0.0
    """Time after each forward of the last stage, idle as a monitor counts it: the loss, which torch computes outside
    the forward chunk (under ``PipelineParallelStrategy``, the step run on the micro-batch's output)."""
    edges: float = 0.0
    """Per step, time of the step's window outside the schedule's actions, idle on every rank: splitting the batch,
    the step's outcome sent from the last stage."""
    actions: tuple[tuple[tuple[str, int, int], float], ...] = ()
    """``((kind, stage, micro-batch), cost)`` of particular actions, replacing their stage's cost (busy time; the first
    stage's input gradient as given): one measured step played as it ran, each chunk with its own time."""

    def __post_init__(self) -> None:
        for name in ("forward", "input_grad", "weight_grad"):
            values = getattr(self, name)
            if any(not v >= 0 for v in values):  # `not >=` also catches NaN
                raise ValueError(f"`{name}={values}`: costs must be non-negative numbers.")
        for name in ("per_action", "between_actions", "loss", "edges"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"`{name}={getattr(self, name)}` must be a non-negative number.")
        if any(not cost >= 0 for _, cost in self.actions):
            raise ValueError(f"`actions={self.actions}`: costs must be non-negative numbers.")

    @functools.cached_property
    def _actions(self) -> dict[tuple[str, int, int | None], float]:
        return dict(self.actions)

    def of(self, kind: str, stage: int, microbatch: int | None = None) -> float:
        """The cost of one ``kind`` (``F``, ``I``, ``W``, ``B``) action of ``stage`` (of ``microbatch``, where
        :attr:`actions` gives it)."""
        if (kind, stage, microbatch) in self._actions:
            return self._actions[(kind, stage, microbatch)] + self.per_action
        if kind == "F":
            return self._stage(self.forward, stage) + self.per_action
        input_grad = self._stage(self.input_grad, stage)
        weight_grad = self._stage(self.weight_grad, stage)
        if stage == 0:  # no input gradient: the whole backward runs as the weight gradient's action
            input_grad, weight_grad = 0.0, input_grad + weight_grad
        return {"I": input_grad, "W": weight_grad, "B": input_grad + weight_grad}[kind] + self.per_action

    @staticmethod
    def _stage(values: tuple[float, ...], stage: int) -> float:
        if not values:
            return 1.0
        if stage >= len(values):
            raise ValueError(f"No cost for stage {stage}: {len(values)} given ({values}); give one per stage.")
        return values[stage]


UNIT_COSTS = ActionCosts()


@dataclass
class _StandInStage:
    """What a torch schedule reads of its stages while computing its order: indices, no module, no group (it also
    writes the stage-to-rank mapping on them)."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    submod: nn.Module

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def _local_stages(name: str, rank: int, p: int, v: int) -> list[int]:
    if schedule_spec(name).placement == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(v)]


Order = tuple[tuple[tuple[tuple[str, int, int], ...], ...], ...]
"""Per rank, per action, the compute steps ``(kind, stage, micro-batch)`` (two for an overlapped pair)."""


@functools.lru_cache(maxsize=256)
def schedule_order(name: str, p: int, m: int, v: int) -> Order:
    """Per rank, the compute actions of torch's schedule ``name`` in order: ``(kind, stage, micro-batch)``, kind one
    of ``F``, ``B``, ``I``, ``W`` (an overlapped pair is its two actions, forward first).

    Multi-stage schedules: torch's own ``pipeline_order``, computed on construction. torch then also derives the
    send/receive actions, quadratic in the micro-batches (15 s for ZBV at p=32, m=256) and not needed here, so the
    class is built with that derivation skipped. Single-stage schedules (``GPipe``, ``1F1B``) execute without an
    order list (the one torch keeps for them is for display and numbers rank > 0's forwards from 1), so theirs is
    written out here: GPipe every forward then every backward; 1F1B ``p - 1 - rank`` forwards, then one forward and
    one backward in turn, then the remaining backwards.
    """
    spec = schedule_spec(name)
    if not spec.is_multi_stage:
        return tuple(_single_stage_order(name, rank, p, m) for rank in range(p))
    num_stages = p * v
    stand_in = nn.Identity()  # torch checks the stages' modules for compilation, nothing else
    stages = [
        _StandInStage(index, num_stages, p, 0, stand_in)  # rank 0's stages: every rank's order is computed from them
        for index in _local_stages(name, 0, p, v)
    ]
    order_only = type(
        f"_{spec.torch_class.__name__}OrderOnly", (spec.torch_class,), {"_prepare_schedule_with_comms": _skip}
    )
    built: Any = order_only(stages, m)
    order = built.pipeline_order
    return tuple(tuple(_flatten(action) for action in order[rank] if _computes(action)) for rank in range(p))


def _skip(*args: Any, **kwargs: Any) -> None:
    """Stands for torch's ``_prepare_schedule_with_comms`` (send/receive actions): not needed to time compute."""


def _computes(action: Any) -> bool:
    return action is not None and (action.sub_actions is not None or action.computation_type.value in _KINDS)


def _single_stage_order(name: str, rank: int, p: int, m: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    forwards = [(("F", rank, i),) for i in range(m)]
    backwards = [(("B", rank, i),) for i in range(m)]
    if name == "GPipe":
        return (*forwards, *backwards)
    warmup = min(p - 1 - rank, m)
    steady = [action for i in range(m - warmup) for action in (forwards[warmup + i], backwards[i])]
    return (*forwards[:warmup], *steady, *backwards[m - warmup :])


def _flatten(action: Any) -> tuple[tuple[str, int, int], ...]:
    if action.sub_actions is not None:
        return tuple(step for sub in action.sub_actions for step in _flatten(sub))
    return ((action.computation_type.value, action.stage_index, action.microbatch_index),)


@dataclass(frozen=True)
class ScheduleTimes:
    """One step of a schedule played with :class:`ActionCosts`."""

    busy: tuple[float, ...]
    """Per rank: the time it computes (its chunks)."""
    makespan: float
    """The step's length: the last action's end on any rank, plus :attr:`ActionCosts.edges`."""
    starts: tuple[float, ...] = ()
    """Per rank: its first chunk's start."""
    ends: tuple[float, ...] = ()
    """Per rank: its last chunk's end (with the last stage's loss where that is its last action)."""

    @property
    def bubble(self) -> float:
        """Mean over ranks of the idle share of the step."""
        return sum(1.0 - busy / self.makespan for busy in self.busy) / len(self.busy)


def simulate_schedule(order: Order, costs: ActionCosts = UNIT_COSTS) -> ScheduleTimes:
    """Play per-rank action lists (:func:`schedule_order`) with ``costs`` (default: the planner's unit costs); see the
    module docstring.

    Raises:
        RuntimeError: If the order cannot finish (an action waits for one that never runs before it).
    """
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(order)
    starts = [0.0] * len(order)
    busy = [0.0] * len(order)
    position = [0] * len(order)
    last_stage = max((stage for rank in order for action in rank for _, stage, _ in action), default=0)
    remaining = sum(len(rank) for rank in order)
    while remaining:
        progressed = False
        for rank, actions in enumerate(order):
            while position[rank] < len(actions):
                steps = actions[position[rank]]
                needed = [action_needs(step, last_stage) for step in steps]
                if any(need not in done for needs in needed for need in needs):
                    break
                for step, needs in zip(steps, needed, strict=True):
                    start = max([clock[rank] + costs.between_actions, *(done[need] for need in needs)])
                    if position[rank] == 0 and step is steps[0]:
                        starts[rank] = start
                    cost = costs.of(*step)
                    clock[rank] = start + cost
                    busy[rank] += cost
                    done[_event(step)] = clock[rank]
                    if step[0] == "B":  # a full backward is its weight gradients' end too
                        done[("W", step[1], step[2])] = clock[rank]
                    if step[0] == "F" and step[1] == last_stage:
                        clock[rank] += costs.loss
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {
                rank: actions[position[rank]] for rank, actions in enumerate(order) if position[rank] < len(actions)
            }
            raise RuntimeError(f"The schedule's order cannot finish: every rank waits ({stuck}).")
    return ScheduleTimes(tuple(busy), max(clock) + costs.edges, tuple(starts), tuple(clock))


def _event(step: tuple[str, int, int]) -> tuple[str, int, int]:
    """What an action makes available: ``F`` its output, ``I``/``B`` the input gradient (``G``), ``W`` itself."""
    kind, stage, microbatch = step
    return ("G" if kind in ("I", "B") else kind, stage, microbatch)


def action_needs(step: tuple[str, int, int], last_stage: int) -> list[tuple[str, int, int]]:
    """What ``step`` ``(kind, stage, micro-batch)`` waits for: ``("F", stage, mb)`` a forward's output, ``("G", stage,
    mb)`` an input gradient (of ``I`` or ``B``); nothing for the first stage's forwards."""
    kind, stage, microbatch = step
    if kind == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    if kind == "W":
        return [("G", stage, microbatch)]
    needs = [("F", stage, microbatch)]
    if stage < last_stage:
        needs.append(("G", stage + 1, microbatch))
    return needs


@functools.lru_cache(maxsize=1024)
def simulated_bubble(
    name: str,
    *,
    pipeline_parallel_size: int,
    num_microbatches: int,
    stages_per_rank: int,
    costs: ActionCosts = UNIT_COSTS,
) -> float:
    """The idle share of a step of torch's schedule ``name`` (mean over ranks), played with ``costs`` (default: unit
    costs, the planner's)."""
    if pipeline_parallel_size == 1:
        return 0.0
    order = schedule_order(name, pipeline_parallel_size, num_microbatches, stages_per_rank)
    return simulate_schedule(order, costs).bubble
