"""V-shaped zero-bubble schedules (issue 32, item 2): ``schedule="ZBVZeroBubble"`` and ``"DualPipeV"``.

Both run two stages per rank placed in a V (rank ``r`` holds stages ``r`` and ``2p - 1 - r``, so the first and last
stage share rank 0) and split backward into input and weight gradients. One forked run of 4 gloo ranks trains
``model_zoo.TiedGPT`` (embedding on stage 0 and the head on stage 3 tied: both on pipeline rank 0) with each on
2 x 2 ranks, at ``zero_stage=0`` with validation during fit and at ``zero_stage=2``; each is checked against
single-device Lightning on the same global batches: the weights, the tied copies bitwise equal, the validation loss,
and the consolidated checkpoint (the single-device one). Fast checks: the schedules' descriptors, the micro-batch
rule torch enforces for DualPipeV, and ``zero_stage=3`` refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import test_pipeline_random_draws as draws
import torch
from distributed_harness import run_distributed
from torch import nn
from torch.utils.data import DataLoader
from training_helpers import assert_checkpoint_is_single_devices, assert_weights_close

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.distributed.pipeline.config import PipelineConfig
from lightning_parallel.distributed.pipeline.schedule import schedule_spec, validate_schedule_config
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.planner.cli import _parser
from lightning_parallel.planner.plan import pipeline_schedule

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)

ADAM_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # as tests/test_pipeline_zero.py
TIED = ("embedding.weight", "head.weight")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
RUNS = [(schedule, zero_stage) for schedule in V_SCHEDULES for zero_stage in (0, 2)]


class _EvaluatedTiedGPT(zoo.TiedGPT):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("val_loss", loss, sync_dist=True)  # the mean over the replicas: one device's mean


class _TiedCopies(pl.Callback):
    """This rank's tied copies while the module is still split."""

    def __init__(self) -> None:
        self.copies: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        named = pl_module.named_parameters(remove_duplicate=False)
        self.copies = {name: param.detach().clone() for name, param in named if name in TIED}


def _fit(strategy: Any, devices: int, checkpoint: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    copies = _TiedCopies()
    trainer = zoo.trainer(strategy, devices, callbacks=[copies], val_check_interval=2, limit_val_batches=2)
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    module = _EvaluatedTiedGPT()
    loader = zoo.loader(sampler["num_replicas"], sampler["rank"], kind="tokens")
    trainer.fit(module, loader, loader)
    trainer.save_checkpoint(checkpoint)  # a collective: every rank calls it
    validated = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
    return {
        "weights": zoo.state_of(module),
        "is_tied": module.head.weight is module.embedding.weight,
        "copies": copies.copies,
        "validated": validated,
    }


def _reference(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    return _fit("auto", 1, f"{directory}/single.ckpt")


def _v_runs(rank: int, world_size: int, directory: str) -> dict[str, dict[str, Any]]:
    return {
        f"{schedule}-{zero_stage}": _fit(
            PipelineParallelStrategy(pipeline_parallel_size=2, schedule=schedule, zero_stage=zero_stage, timeout=120),
            world_size,
            f"{directory}/{schedule}-{zero_stage}.ckpt",
        )
        for schedule, zero_stage in RUNS
    }


def test_v_schedules_train_validate_and_checkpoint_like_one_device(tmp_path: Path) -> None:
    directory = str(tmp_path)
    (single,) = run_distributed(_reference, 1, args=(directory,), init_process_group=False, timeout=120)
    results = run_distributed(_v_runs, 4, args=(directory,), init_process_group=False, timeout=400)
    expected = torch.load(tmp_path / "single.ckpt", weights_only=True)
    for schedule, zero_stage in RUNS:
        name = f"{schedule}-{zero_stage}"
        runs = [result[name] for result in results]
        for run in runs:
            assert_weights_close(run["weights"], single["weights"], **ADAM_TOLERANCE)
            assert run["is_tied"]  # the module is whole after fit, the tie intact
            torch.testing.assert_close(run["validated"], single["validated"], **ADAM_TOLERANCE)
        # Pipeline rank 0 (global ranks 0 and 2) holds both the first and the last stage: both tied copies.
        copies = [value for run in runs for value in run["copies"].values()]
        assert len(copies) == 4, name
        for copy in copies[1:]:
            assert torch.equal(copy, copies[0]), name
        saved = torch.load(tmp_path / f"{name}.ckpt", weights_only=True)
        assert_checkpoint_is_single_devices(saved, expected, **ADAM_TOLERANCE)


# ---------------------------------------------------------------------------------------------------- fast checks
@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedules_run_two_stages_per_rank_in_a_v(schedule: str) -> None:
    spec = schedule_spec(schedule.lower())
    assert (spec.name, spec.placement, spec.default_stages_per_rank) == (schedule, "v", 2)
    assert spec.splits_backward and spec.is_multi_stage and not spec.runs_any_stages_per_rank
    config = PipelineConfig.resolve(
        world_size=4, pipeline_parallel_size="auto", schedule=schedule, stages_per_rank="auto", num_microbatches="auto"
    )
    config.validate()
    assert (config.stages_per_rank, config.num_microbatches, config.spec.placement) == (2, 8, "v")
    plan = StagePlan(starts=tuple(range(8)), num_layers=8, pipeline_parallel_size=4, placement=config.spec.placement)
    assert [plan.stages_of(rank) for rank in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("stages_per_rank", [1, 3])
def test_v_schedules_refuse_other_stage_counts_with_the_fix(schedule: str, stages_per_rank: int) -> None:
    with pytest.raises(ValueError, match=r"runs exactly 2 stages per rank.*Use `stages_per_rank=2`"):
        validate_schedule_config(
            schedule, pipeline_parallel_size=2, stages_per_rank=stages_per_rank, num_microbatches=4
        )


def test_dualpipev_refuses_fewer_microbatches_than_stages_with_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"'DualPipeV'.*`num_microbatches=3` < 4 \(2 ranks x 2 stages\).*`num_microbatches >= 4`"
    ):
        validate_schedule_config("DualPipeV", pipeline_parallel_size=2, stages_per_rank=2, num_microbatches=3)
    validate_schedule_config("DualPipeV", pipeline_parallel_size=2, stages_per_rank=2, num_microbatches=4)
    # ZBV takes any count (torch pads its plan with micro-batches it then drops).
    validate_schedule_config("ZBVZeroBubble", pipeline_parallel_size=2, stages_per_rank=2, num_microbatches=1)


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_zero3_refuses_v_schedules_naming_the_fix(schedule: str) -> None:
    with pytest.raises(ValueError, match=rf"`zero_stage=3` with `schedule='{schedule}'`.*`zero_stage=2`"):
        PipelineParallelStrategy(zero_stage=3, schedule=schedule)


def test_planner_plans_v_schedules_with_two_stages_per_rank_and_offers_them_on_the_command_line() -> None:
    assert pipeline_schedule("DualPipeV", batch_size=8, pipeline_parallel_size=2, num_microbatches=None) == (
        8,
        "DualPipeV",
        2,
    )
    for schedule in V_SCHEDULES:
        assert _parser().parse_args(["--world-size", "2", "--schedule", schedule, "gpt"]).schedule == schedule


# ---------------------------------------------------------------------------------------------------- random draws
def _denoise(rank: int, world_size: int) -> dict[str, Any]:
    """``test_pipeline_random_draws``'s denoiser (noise drawn in the step, dropout inside the layers) under ZBV: the
    rank of the last stage, which replays the step's draws per micro-batch, is pipeline rank 0, the first stage's."""
    pl.seed_everything(draws.SEED, verbose=False)
    module = draws.Denoiser()
    loader = DataLoader(draws.TRAIN, batch_size=draws.BATCH, shuffle=False)
    strategy = PipelineParallelStrategy(schedule="ZBVZeroBubble", num_microbatches=2, timeout=60)
    trainer = zoo.trainer(strategy, world_size, max_steps=draws.STEPS)
    trainer.fit(module, train_dataloaders=loader)
    return {"score": draws._score(module), "noises": module.noises}


def test_v_schedule_replays_the_steps_draws_on_rank_0_which_holds_the_first_and_last_stage() -> None:
    last, first = run_distributed(_denoise, 2, init_process_group=False, timeout=180)
    assert first["score"] == last["score"] < 0.2  # learned (predicting no noise scores 1.0), the same on both ranks
    draws._assert_noise_is_consistent(first, last, len(draws.RECORDED_BATCHES))


@pytest.mark.parametrize("schedule", ["DualPipeV", "ZBVZeroBubble"])
@pytest.mark.parametrize("p", [2, 4])
def test_an_overlapped_pairs_forward_output_is_sent_before_its_backward_runs(schedule: str, p: int) -> None:
    """DualPipeV's runtime ran an overlapped forward/backward pair's sends after both; the rewrite runs the pair as its
    forward, its send, its backward, its send: the same compute in the same order, the same sends, none of them later
    than before. A schedule without pairs (ZBV) is unchanged."""
    from torch.distributed.pipelining.schedules import _ComputationType

    from lightning_parallel.distributed.pipeline import _compat
    from lightning_parallel.planner.bubble import _StandInStage

    stages = [_StandInStage(i, 2 * p, p, 0, nn.Identity()) for i in (0, 2 * p - 1)]
    built: Any = schedule_spec(schedule).torch_class(stages, 2 * p)
    before = {rank: list(actions) for rank, actions in built.pipeline_order_with_comms.items()}
    _compat.send_between_overlapped_actions(built)
    sends = (_ComputationType.SEND_F, _ComputationType.SEND_B)

    def compute(actions: list[Any]) -> list[str]:
        flat = [sub for a in actions for sub in (a.sub_actions or (a,))]
        return [str(a) for a in flat if a.computation_type not in sends]

    for rank, after in built.pipeline_order_with_comms.items():
        assert compute(after) == compute(before[rank])
        assert sorted(str(a) for a in after if a.computation_type in sends) == sorted(
            str(a) for a in before[rank] if a.computation_type in sends
        )
        paired = [a for a in before[rank] if a.computation_type == _ComputationType.OVERLAP_F_B]
        assert (schedule == "DualPipeV") == bool(paired)
        for pair in paired:
            forward = pair.sub_actions[0]
            send = f"{forward.stage_index}SEND_F{forward.microbatch_index}"
            if send in [str(a) for a in after]:  # not where the next stage is on this rank (the V's tip)
                assert [str(a) for a in after].index(send) == [str(a) for a in after].index(str(forward)) + 1
        if not paired:
            assert after == before[rank]
