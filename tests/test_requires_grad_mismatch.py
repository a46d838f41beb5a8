"""``requires_grad`` set differently on different ranks is named, on every rank, before any collective can hang.

User code that freezes a layer on rank 0 only (``if self.global_rank == 0: ...``) would make the ranks average
different gradients: DDP's re-wrap failed inside torch's cross-rank check, ZeRO-1/2 silently trained the frozen layer
on the other rank's gradients, FSDP2 reduce-scattered gradients of different layouts. Each case runs a real 2-rank
fit; both ranks must raise our error, naming the parameters and the ranks (a rank that waited for the other would
end in the collective's timeout error instead, not in ours).

All cases run in one pair of forked ranks, one Trainer per case.
"""

from __future__ import annotations

from typing import Any

import pytest
from distributed_harness import run_distributed
from model_zoo import FreezeScheduleModel, loader, trainer

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.distributed.trainable import disagreement_message

COLLECTIVE_TIMEOUT_S = 30


class _FrozenOnRankZero(FreezeScheduleModel):
    """``backbone.0`` is frozen on rank 0 only: from ``setup`` (``at_step=None``: before the strategy wraps or
    shards the model) or in ``on_train_batch_start`` from step ``at_step`` on."""

    def __init__(self, at_step: int | None) -> None:
        super().__init__()
        self.backbone.requires_grad_(True)
        self.at_step = at_step

    def setup(self, stage: str) -> None:
        if self.at_step is None and self.global_rank == 0:
            self.backbone[0].requires_grad_(False)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.at_step is not None and self.global_step >= self.at_step and self.global_rank == 0:
            self.backbone[0].requires_grad_(False)


CASES = {
    # name: (strategy factory, step at which rank 0 freezes; None: before the strategy's setup)
    "data_parallel-setup": (lambda: DataParallelStrategy(timeout=COLLECTIVE_TIMEOUT_S), None),
    "data_parallel-step1": (lambda: DataParallelStrategy(timeout=COLLECTIVE_TIMEOUT_S), 1),
    "zero1-step1": (lambda: ShardedOptimizerStrategy(stage=1, timeout=COLLECTIVE_TIMEOUT_S), 1),
    "zero2-setup": (lambda: ShardedOptimizerStrategy(stage=2, timeout=COLLECTIVE_TIMEOUT_S), None),
    "zero2-step1": (lambda: ShardedOptimizerStrategy(stage=2, timeout=COLLECTIVE_TIMEOUT_S), 1),
    "zero3-step1": (lambda: ShardedOptimizerStrategy(stage=3, timeout=COLLECTIVE_TIMEOUT_S), 1),
    # Two replicas of a one-rank pipeline: they average the stage's gradients.
    "pipeline-setup": (lambda: _pipeline(pipeline_parallel_size=1), None),
    "pipeline-step1": (lambda: _pipeline(pipeline_parallel_size=1), 1),
}


def _pipeline(**options: Any) -> PipelineParallelStrategy:
    return PipelineParallelStrategy(timeout=COLLECTIVE_TIMEOUT_S, verify_layers=False, **options)


def _strategy_name(case: str) -> str:
    if case.startswith("data_parallel"):
        return "DataParallelStrategy"
    if case.startswith("pipeline"):
        return "PipelineParallelStrategy"
    return f"ShardedOptimizerStrategy(stage={case[4]})"


def _fit_each_case(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    results = {}
    for name, (make_strategy, at_step) in CASES.items():
        try:
            trainer(make_strategy(), world_size).fit(_FrozenOnRankZero(at_step), loader(world_size, rank))
            outcome = ("no error", "")
        except Exception as error:
            outcome = (type(error).__name__, str(error))
        results[name] = outcome
    return results


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, tuple[str, str, float]]]:
    return run_distributed(_fit_each_case, 2, init_process_group=False, timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_rank_dependent_requires_grad_is_named_on_every_rank(outcomes, case) -> None:
    strategy = _strategy_name(case)
    for rank, results in enumerate(outcomes):
        kind, message = results[case]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
        assert message.startswith(f"{strategy}: the ranks disagree on which parameters require grad"), message
        assert "`backbone.0.weight`, `backbone.0.bias`: trainable on rank 1, frozen on rank 0" in message, message
        assert "the same way on every rank" in message, message


def _fit_two_by_two_pipeline(rank: int, world_size: int) -> tuple[str, str]:
    """2 replicas x 2 pipeline ranks: global ranks 0 and 2 hold stage 0 (``backbone.0``), 1 and 3 the rest."""
    strategy = _pipeline(pipeline_parallel_size=2, partition=[1])
    try:
        trainer(strategy, world_size).fit(_FrozenOnRankZero(1), loader(2, rank // 2))
    except Exception as error:
        return type(error).__name__, str(error)
    return "no error", ""


def test_a_pipeline_replica_freezing_alone_is_named_on_every_rank_of_every_stage() -> None:
    """Rank 0 freezes its stage's layer, its replica (rank 2) does not: the ranks of the other stage (1 and 3), which
    would otherwise wait in the schedule for stage 0, raise the same error."""
    outcomes = run_distributed(_fit_two_by_two_pipeline, 4, init_process_group=False, timeout=240)
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
        assert message.startswith("PipelineParallelStrategy: the ranks disagree on which parameters require grad")
        assert "`backbone.0.weight`, `backbone.0.bias`: trainable on rank 2, frozen on rank 0" in message, message


def test_the_message_groups_parameters_by_where_they_are_trainable() -> None:
    layouts = [
        [("a.weight", False), ("a.bias", False), ("b.weight", True)],
        [("a.weight", True), ("a.bias", True), ("b.weight", True), ("extra", True)],
        [("a.weight", True), ("a.bias", True), ("b.weight", False)],
    ]
    message = disagreement_message(layouts, owner="DataParallelStrategy")
    assert message.startswith(
        "DataParallelStrategy: the ranks disagree on which parameters require grad: `a.weight`, `a.bias`: trainable on"
        " ranks [1, 2], frozen on rank 0; `b.weight`: trainable on ranks [0, 1], frozen on rank 2; `extra`: trainable"
        " on rank 1, missing on ranks [0, 2]. "
    ), message
