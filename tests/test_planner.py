"""The planner: unit tests of its arithmetic and CLI, and the check that makes it trustworthy: for every strategy at
world sizes 2 and 4 its predicted bytes held per rank and bytes per step EQUAL what ParallelismMonitor measures in a
real fork-launched Trainer run of the tiny GPT."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from test_activation_checkpointing import BATCH as AC_BATCH
from test_activation_checkpointing import SEQ as AC_SEQ
from test_activation_checkpointing import _gpt, measure_gpt_saved_bytes
from torch.utils.data import DataLoader
from training_helpers import assert_monitor_equals_plan, make_trainer

from lightning_parallel import PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.monitor import ParallelismMonitor, ring_wire_bytes
from lightning_parallel.planner import main, parse_memory, pipeline_bubble, plan
from lightning_parallel.planner.activations import activation_bytes
from lightning_parallel.planner.bubble import simulate_schedule
from lightning_parallel.planner.estimate import (
    OPTIMIZER_STATES,
    PRECISION_BYTES,
    EstimateContext,
    estimate_pipeline,
    zero_buckets,
)
from lightning_parallel.planner.spec import model_spec

BATCH, SEQ = 4, 16
STEPS = 2


def _module() -> GPTLightningModule:
    """126,790 parameters (not a multiple of 4: ZeRO-1/2 pad at world size 4) with 17-row position embeddings and
    62-wide LayerNorms (FSDP2 pads their dim-0 shards at world sizes 2 and 4)."""
    pl.seed_everything(0, verbose=False)
    return GPTLightningModule("tiny", block_size=17, n_embd=62, bias=True)


# ---------------------------------------------------------------------------------------------- the equality check
CASES = {
    # name: (strategy factory, planner configuration name, extra planner arguments); precision "32-true" unless
    # PRECISION names another
    "data_parallel": (lambda ws: "data_parallel_notebook", lambda ws: "data_parallel", {}),
    "zero1": (lambda ws: "zero1_notebook", lambda ws: "zero1", {}),
    "zero2": (lambda ws: "zero2_notebook", lambda ws: "zero2", {}),
    # Several 100 KiB buckets, each padded to a multiple of the world size.
    "zero2_small_buckets": (
        lambda ws: ShardedOptimizerStrategy(stage=2, bucket_cap_mb=0.1, start_method="fork"),
        lambda ws: "zero2",
        {"bucket_cap_mb": 0.1},
    ),
    "zero3": (lambda ws: "zero3_notebook", lambda ws: "zero3", {}),
    # bf16-true: bf16 parameters, fp32 master weights in the shard, gradients reduced in fp32 (the default).
    "zero1_bf16_true": (lambda ws: "zero1_notebook", lambda ws: "zero1", {"precision": "bf16-true"}),
    "zero2_bf16_true": (lambda ws: "zero2_notebook", lambda ws: "zero2", {"precision": "bf16-true"}),
    "zero3_bf16_true": (lambda ws: "zero3_notebook", lambda ws: "zero3", {"precision": "bf16-true"}),
    "pipeline": (
        lambda ws: PipelineParallelStrategy(pipeline_parallel_size=2, start_method="fork"),
        lambda ws: f"pipeline pp=2, dp={ws // 2}",
        {},
    ),
    # bf16 autocast: parameters, gradients and the residual stream sent between stages stay fp32.
    "pipeline_bf16_mixed": (
        lambda ws: PipelineParallelStrategy(pipeline_parallel_size=2, start_method="fork"),
        lambda ws: f"pipeline pp=2, dp={ws // 2}",
        {"precision": "bf16-mixed"},
    ),
    # Two stages per rank (4 stages, 4 micro-batches): every rank sends at two boundaries each way.
    "pipeline_interleaved": (
        lambda ws: PipelineParallelStrategy(pipeline_parallel_size=2, schedule="Interleaved1F1B", start_method="fork"),
        lambda ws: f"pipeline pp=2, dp={ws // 2}, v=2",
        {"schedule": "Interleaved1F1B"},
    ),
    # V placement (4 stages): rank 0 holds the first and last stage, rank 1 the middle two (their boundary local).
    "pipeline_zbv": (
        lambda ws: PipelineParallelStrategy(pipeline_parallel_size=2, schedule="ZBVZeroBubble", start_method="fork"),
        lambda ws: f"pipeline pp=2, dp={ws // 2}, v=2",
        {"schedule": "ZBVZeroBubble"},
    ),
}
# Hybrid sharding at world size 4 only: 2 shard groups of 2 ranks ("two nodes": the planner lists these layouts for
# `num_nodes > 1`), the gradient shards and flags all-reduced across the groups.
HYBRID_CASES = {
    f"zero{stage}_shard2": (
        lambda ws, stage=stage: ShardedOptimizerStrategy(stage=stage, shard_size=2, start_method="fork"),
        lambda ws, stage=stage: f"zero{stage} shard=2",
        {"num_nodes": 2},
    )
    for stage in (1, 2, 3)
} | {
    # bf16-true: the replicas all-reduce the fp32 gradient shards beside the fp32 masters.
    f"zero{stage}_shard2_bf16_true": (
        lambda ws, stage=stage: ShardedOptimizerStrategy(stage=stage, shard_size=2, start_method="fork"),
        lambda ws, stage=stage: f"zero{stage} shard=2",
        {"num_nodes": 2, "precision": "bf16-true"},
    )
    for stage in (2, 3)
}


def _measure(rank: int, world_size: int, case: str, devices: int) -> dict:
    """In an isolated process: fit with the monitor on `devices` fork-launched ranks, return its JSON summary."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    strategy = {**CASES, **HYBRID_CASES}[case][0](devices)
    with tempfile.TemporaryDirectory() as tmp:
        monitor = ParallelismMonitor(summary_path=Path(tmp, "summary.json"), figure_path=False)
        precision = {**CASES, **HYBRID_CASES}[case][2].get("precision", "32-true")
        trainer = make_trainer(strategy, devices=devices, max_steps=STEPS, callbacks=[monitor], precision=precision)
        loader = DataLoader(RandomTokenDataset(64, SEQ, seed=3), batch_size=BATCH)
        trainer.fit(_module(), train_dataloaders=loader)
        return json.loads(Path(tmp, "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "world_size"), [(case, ws) for case in CASES for ws in (2, 4)] + [(case, 4) for case in HYBRID_CASES]
)
def test_planner_equals_monitor(case: str, world_size: int) -> None:
    (summary,) = run_distributed(
        _measure, world_size=1, args=(case, world_size), init_process_group=False, launcher_env=False, timeout=240
    )
    _, config_name, planner_args = {**CASES, **HYBRID_CASES}[case]
    # Measured on gloo, where ZeRO-1/2 all-reduce their buckets (faster there than a reduce-scatter).
    predicted = plan(
        _module(), world_size=world_size, batch_size=BATCH, seq_len=SEQ, process_group_backend="gloo", **planner_args
    )
    predicted = predicted.configuration(config_name(world_size))
    assert len(summary["ranks"]) == world_size == len(predicted.ranks)
    # Under the pipeline the first rank's batch, (inputs, targets) of int64 tokens, goes to the other rank.
    batch_broadcast = 2 * BATCH * SEQ * 8 if case.startswith("pipeline") else None
    assert_monitor_equals_plan(summary["ranks"], predicted.ranks, batch_broadcast=batch_broadcast)
    for measured in summary["ranks"]:
        assert measured["communication_measured"]
        assert len(measured["steps"]) == STEPS
        _check_step_facts(case, world_size, measured["steps"])


def _check_step_facts(case: str, world_size: int, steps: list[dict]) -> None:
    """The monitor's other per-step facts for the same runs: batch sizes, what is measurable, the pipeline's chunks."""
    is_pipeline = case.startswith("pipeline")
    replicas = world_size // 2 if is_pipeline else world_size
    for step in steps:
        assert (step["samples"], step["tokens"]) == (BATCH * replicas, BATCH * replicas * SEQ)
        assert step["step_time_s"] > 0 and step["compute_s"] >= 0
        measurable = case.startswith(("zero1", "zero2")) or is_pipeline
        assert (step["exposed_communication_s"] is not None) == measurable
        assert (step["pipeline_idle_s"] is not None) == is_pipeline
    if case == "pipeline":  # 1F1B, 2 micro-batches, one stage per rank: 2 forward and 2 backward chunks per step
        kinds = sorted(kind for kind, *_ in steps[-1]["timeline"])
        assert kinds == ["B", "B", "F", "F"]
        assert 0.0 <= steps[-1]["bubble_fraction"] < 1.0
    if case == "pipeline_interleaved":  # 4 micro-batches through each of the rank's 2 stages
        kinds = sorted(kind for kind, *_ in steps[-1]["timeline"])
        assert kinds == ["B"] * 8 + ["F"] * 8


def _measure_pipeline_zero(rank: int, world_size: int, zero_stage: int, devices: int) -> dict:
    """As :func:`_measure`, for ``PipelineParallelStrategy(pipeline_parallel_size=2, zero_stage=...)``."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, zero_stage=zero_stage, start_method="fork")
    with tempfile.TemporaryDirectory() as tmp:
        monitor = ParallelismMonitor(summary_path=Path(tmp, "summary.json"), figure_path=False)
        trainer = make_trainer(strategy, devices=devices, max_steps=STEPS, callbacks=[monitor])
        loader = DataLoader(RandomTokenDataset(64, SEQ, seed=3), batch_size=BATCH)
        trainer.fit(_module(), train_dataloaders=loader)
        return json.loads(Path(tmp, "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_planner_equals_monitor_for_zero_inside_the_pipeline(zero_stage: int) -> None:
    """2 x 2: each stage's bucket (63,860 and 62,930 parameters) sharded over its 2 replicas, to the byte; at
    zero_stage=3 every parameter's rows (FSDP2's padded shards; the optimizer state of the unpadded local rows)."""
    world_size = 4
    (summary,) = run_distributed(
        _measure_pipeline_zero,
        world_size=1,
        args=(zero_stage, world_size),
        init_process_group=False,
        launcher_env=False,
        timeout=240,
    )
    spec = model_spec(_module())
    element, activation = PRECISION_BYTES["32-true"]
    ctx = EstimateContext(
        spec, world_size, OPTIMIZER_STATES["adamw"], element, activation, BATCH, SEQ, gradient_reduction="all_reduce"
    )  # gloo: the replicas all-reduce their buckets (faster there than a reduce-scatter)
    predicted = estimate_pipeline(
        ctx, pipeline_parallel_size=2, num_microbatches=None, schedule="1F1B", stages_per_rank=1, zero_stage=zero_stage
    )
    assert predicted.name == f"pipeline pp=2, dp=2, zero{zero_stage}"
    plain = plan(_module(), world_size=world_size, batch_size=BATCH, seq_len=SEQ).configuration("pipeline pp=2, dp=2")
    batch = 2 * BATCH * SEQ * 8  # the first rank's (inputs, targets) of int64 tokens, sent to the other rank
    for measured, expected, unsharded in zip(summary["ranks"], predicted.ranks, plain.ranks, strict=True):
        assert measured["memory"] == {
            "parameters": expected.parameters,
            "gradients": expected.gradients,
            "optimizer_state": expected.optimizer_state,
        }, f"rank {measured['rank']}"
        assert expected.optimizer_state < unsharded.optimizer_state  # half the stage's, up to the padding
        if zero_stage == 3:
            assert expected.parameters < unsharded.parameters and expected.gradients < unsharded.gradients
            # FSDP2's all-gathers and reduce-scatters are predicted, but the monitor does not count them under the
            # pipeline (its collective tap is the pipeline's own): the stage boundaries' bytes are compared.
            assert set(expected.communication) == {"send", "recv", "all_gather", "reduce_scatter"}
            p2p = {k: v for k, v in expected.communication.items() if k in ("send", "recv")}
            assert measured["steps"][-1]["communication"] == {**p2p, "broadcast": batch}, f"rank {measured['rank']}"
            continue
        assert measured["steps"][-1]["communication"] == {**expected.communication, "broadcast": batch}
        assert set(expected.communication) == {"send", "recv", "all_reduce", "all_gather"}


# ---------------------------------------------------------------------------------------------- arithmetic
def test_zero_padding_and_sharding_arithmetic() -> None:
    spec = model_spec(_module())
    assert spec.num_parameters == 126_790
    assert zero_buckets(spec, element_bytes=4, bucket_cap_mb=25.0, stage=1) == [126_790]
    # Stage 2: at most a thirty-second of the model per bucket (parameters larger than that alone): 19 buckets here.
    assert len(zero_buckets(spec, element_bytes=4, bucket_cap_mb=25.0, stage=2)) == 19
    zero1 = plan(spec.module, world_size=4, batch_size=BATCH, seq_len=SEQ).configuration("zero1")
    padded = 126_792  # the next multiple of 4
    assert [r.parameters for r in zero1.ranks] == [padded * 4] * 4
    assert [r.gradients for r in zero1.ranks] == [padded * 4] * 4  # the reduced shard is a slice of the bucket
    # Adam(W): 2 states for the owned real elements; the last rank's shard holds the 2 padding elements.
    assert [r.optimizer_state for r in zero1.ranks] == [2 * 4 * 31_698] * 3 + [2 * 4 * 31_696]
    # Plus the "got a gradient" flags: one byte per parameter tensor (29), all-reduced at every sync.
    flags = len(spec.params)
    assert flags == 29
    assert zero1.ranks[0].communication == {"reduce_scatter": padded * 4, "all_gather": padded * 4, "all_reduce": flags}
    on_gloo = plan(spec.module, world_size=4, batch_size=BATCH, seq_len=SEQ, process_group_backend="gloo")
    # Zero-2's 19 buckets are padded one by one.
    padded2 = sum(-(-n // 4) * 4 for n in zero_buckets(spec, element_bytes=4, bucket_cap_mb=25.0, stage=2))
    assert padded2 > padded
    assert on_gloo.configuration("zero2").ranks[0].communication == {
        "all_reduce": padded2 * 4 + flags,
        "all_gather": padded2 * 4,
    }


def test_fsdp_units_and_roots_match_apply_fully_shard() -> None:
    spec = model_spec(_module())
    assert spec.units is not None
    # Two blocks, then the GPT holding the rest and every block: the LightningModule (the root) holds no parameter,
    # so the GPT it wraps stays gathered from forward to backward (as FSDP2's root would); the blocks reshard.
    assert [u.stays_gathered for u in spec.units] == [False, False, True]
    covered = sorted(i for u in spec.units for i in u.params)
    assert covered == list(range(len(spec.params)))


def test_an_order_that_cannot_finish_is_an_error_not_a_hang() -> None:
    # Rank 0 waits for stage 1's input gradient before its forward was ever sent to stage 1.
    order = (((("B", 0, 0),), (("F", 0, 0),)), ((("F", 1, 0),), (("B", 1, 0),)))
    with pytest.raises(RuntimeError, match="cannot finish"):
        simulate_schedule(order)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [8, 16, 32])
def test_pipeline_bubble_plays_torchs_order_and_finds_the_formulas_where_they_hold(p: int, m: int) -> None:
    def bubble(schedule: str, v: int = 1) -> float:
        return pipeline_bubble(schedule, pipeline_parallel_size=p, num_microbatches=m, stages_per_rank=v)

    assert bubble("GPipe") == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert bubble("1F1B") == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    for looped in ("Interleaved1F1B", "LoopedBFS"):  # Megatron's interleaved formula
        assert bubble(looped, 2) == pytest.approx((p - 1) / (2 * m + p - 1), abs=1e-12), looped
    # Zero bubble: the split weight gradients fill most of it (unit costs F = I = W); no textbook formula covers
    # torch's orders, this is what playing them gives.
    # ZBV and DualPipeV only from a micro-batch per stage on (DualPipeV refuses fewer; ZBV's V then runs half empty).
    for zero_bubble in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        if m < 2 * p and zero_bubble != "InterleavedZeroBubble":
            continue
        assert bubble(zero_bubble, 2) == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12), zero_bubble
        assert bubble(zero_bubble, 2) < bubble("Interleaved1F1B", 2)
    if m < 2 * p:
        assert (p - 1) / (6 * m + p - 1) < bubble("ZBVZeroBubble", 2) < bubble("1F1B")
    assert pipeline_bubble("1F1B", pipeline_parallel_size=1, num_microbatches=4, stages_per_rank=1) == 0.0


def test_ring_wire_bytes() -> None:
    assert ring_wire_bytes("all_reduce", 1000, 4) == 1500.0
    assert ring_wire_bytes("reduce_scatter", 1000, 4) + ring_wire_bytes("all_gather", 1000, 4) == 1500.0
    assert ring_wire_bytes("send", 1000, 4) == 1000.0
    assert ring_wire_bytes("all_reduce", 1000, 1) == 0.0


def test_data_parallel_formula_and_optimizers() -> None:
    n = model_spec("tiny").num_parameters
    adam = plan("tiny", world_size=2).configuration("data_parallel").ranks[0]
    assert (adam.parameters, adam.gradients, adam.optimizer_state) == (4 * n, 4 * n, 8 * n)
    assert adam.communication == {"all_reduce": 4 * n}
    sgd = plan("tiny", world_size=2, optimizer="sgd_no_momentum", precision="bf16-true").configuration("data_parallel")
    assert (sgd.ranks[0].parameters, sgd.ranks[0].optimizer_state) == (2 * n, 0)
    assert plan("tiny", world_size=1).configuration("data_parallel").ranks[0].communication == {}


def test_recommendation_follows_memory() -> None:
    unlimited = plan("gpt-1.3b", world_size=8, precision="bf16-mixed")
    assert unlimited.recommended is not None and unlimited.recommended.name == "data_parallel"
    assert unlimited.trainer_line == "Trainer(devices=8, strategy=\"data_parallel\", precision='bf16-mixed')"
    tight = plan("gpt-1.3b", world_size=8, device_memory=16 * 2**30, precision="bf16-mixed", batch_size=8)
    assert tight.recommended is not None and tight.recommended.fits
    assert tight.recommended.name != "data_parallel"
    assert tight.recommended.max_total <= 16 * 2**30
    nothing = plan("gpt-1.3b", world_size=2, device_memory=2**30)
    assert nothing.recommended is not None and nothing.recommended.fits is False


def test_model_inputs() -> None:
    assert model_spec(350_000_000).num_parameters == 350_000_000
    assert model_spec("1.3B").num_parameters == 1_300_000_000
    by_path = model_spec("lightning_parallel.demos:GPTLightningModule")
    assert by_path.num_parameters == model_spec("tiny").num_parameters
    counted = plan("350M", world_size=4)
    assert not any(c.name.startswith("pipeline") for c in counted.configurations)  # no layers known
    with pytest.raises(ValueError, match="not a preset"):
        model_spec("no.such.module:Model")


def test_validation_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match="optimizer='lion'"):
        plan("tiny", world_size=2, optimizer="lion")
    with pytest.raises(ValueError, match="num_nodes=3"):
        plan("tiny", world_size=4, num_nodes=3)
    with pytest.raises(ValueError, match="precision='fp8'"):
        plan("tiny", world_size=2, precision="fp8")


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("24GB") == 24 * 10**9
    assert parse_memory("1024") == 1024
    with pytest.raises(ValueError, match="80GiB"):
        parse_memory("lots")
    code = main(["gpt-350m", "--world-size", "8", "--device-memory", "16GiB", "--precision", "bf16-mixed"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| zero3 |" in out and "| pipeline pp=2, dp=4 |" in out
    assert "Recommended:" in out and "Trainer(devices=8" in out
    assert main(["no.such:Model", "--world-size", "2"]) == 2
    assert "not a preset" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- activations
def test_activation_count_equals_saved_bytes() -> None:
    """The activation count against the bytes autograd saves for backward, counted exactly
    (tests/test_activation_checkpointing.py), for the demo GPT (2 blocks, h 64, 2 heads, V 256, fp32, batch 4 x 256;
    torch's fused CPU attention kernel, which stores no scores: ``attention="flash"``): equal, without and with
    checkpointing, up to 32 bytes: the measurement's token ids are a view of a ``(B, T + 1)`` tensor (8 bytes x 4
    extra tokens). One block's saved bytes are the block being recomputed in backward. More models, precisions and
    kernels: tests/test_planner_activations.py."""
    measured = measure_gpt_saved_bytes()
    shape = _gpt(block_size=AC_SEQ).transformer_shape()

    def count(checkpointing: str) -> object:
        return activation_bytes(
            shape, seq_len=AC_SEQ, samples=AC_BATCH, blocks=shape.num_layers, stream_bytes=4, compute_bytes=4,
            attention="flash", checkpointing=checkpointing,
        )  # fmt: skip

    without, with_checkpointing = count("none"), count("full")
    assert without.saved + 32 == measured["without"]
    assert with_checkpointing.saved + 32 == measured["with"]
    block_input = 4 * AC_BATCH * AC_SEQ * shape.hidden_size
    assert with_checkpointing.transient == measured["one_block"] - block_input  # beyond the input it kept
    # plan() reports the peak: what is saved plus the largest transient of backward.
    for checkpointing, expected in (("none", without), ("full", with_checkpointing)):
        planned = plan(
            _gpt(block_size=AC_SEQ),
            world_size=1,
            batch_size=AC_BATCH,
            seq_len=AC_SEQ,
            activation_checkpointing=checkpointing,
            attention="flash",
        )
        assert planned.configuration("data_parallel").ranks[0].activations == expected.peak  # type: ignore[attr-defined]


def test_activation_checkpointing_option(capsys: pytest.CaptureFixture[str]) -> None:
    kwargs = {"world_size": 2, "batch_size": 8, "precision": "bf16-mixed"}
    plain, checkpointed = plan("small", **kwargs), plan("small", **kwargs, activation_checkpointing=True)
    for config in plain.configurations:
        other = checkpointed.configuration(config.name)
        assert other.max_total < config.max_total
        assert [r.held for r in other.ranks] == [r.held for r in config.ranks]  # only activations change
    zero2 = checkpointed.configuration("zero2").strategy
    assert zero2 == "ShardedOptimizerStrategy(stage=2, activation_checkpointing=True)"
    assert checkpointed.configuration("data_parallel").strategy == "DataParallelStrategy(activation_checkpointing=True)"
    assert checkpointed.configuration("pipeline pp=2, dp=1").strategy.endswith(", activation_checkpointing=True)")
    # "small" (h 256, 4 heads, V 256, 4 blocks), 8 x 128 tokens, flash attention (nccl's default): each block keeps
    # its input in fp32 (the residual stream stays fp32 under autocast); the largest transient of backward is the
    # block being recomputed (in 16-bit, with its weights' 16-bit copies) or the loss's two fp32 gradients.
    shape = model_spec("small").shape
    assert shape is not None
    expected = activation_bytes(
        shape, seq_len=128, samples=8, blocks=4, stream_bytes=4, compute_bytes=2, checkpointing="full"
    )
    h, v, tokens = 256, 256, 8 * 128
    assert expected.saved == 4 * tokens * h * 4 + tokens * (8 + 4 * h + 8 + 2 * h + 4 * v + 8) + 8 * 128 + 4 + 2 * v * h
    assert checkpointed.configuration("zero3").ranks[0].activations == expected.peak
    with pytest.raises(TypeError, match="activation_checkpointing=1"):
        plan("tiny", world_size=2, activation_checkpointing=1)
    assert main(["tiny", "--world-size", "2", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "activation checkpointing. Per rank" in out and "activation_checkpointing=True)" in out


def test_world_size_one_lists_zero_with_fp32_masters_only_for_16bit_parameters() -> None:
    module = GPTLightningModule("tiny")
    psi = sum(p.numel() for p in module.parameters())
    fp32 = plan(module, world_size=1, batch_size=2, seq_len=16)
    assert [c.name for c in fp32.configurations] == ["data_parallel"]  # nothing for ZeRO to do
    bf16 = plan(module, world_size=1, batch_size=2, seq_len=16, precision="bf16-true")
    zero1, zero2 = bf16.configuration("zero1").ranks[0], bf16.configuration("zero2").ranks[0]
    # One rank: bf16 buckets, fp32 masters + AdamW moments of everything, no communication.
    assert (zero1.parameters, zero1.gradients, zero1.optimizer_state) == (2 * psi, 6 * psi, 12 * psi)
    assert (zero2.parameters, zero2.gradients, zero2.optimizer_state) == (2 * psi, 4 * psi, 12 * psi)
    assert zero1.communication == zero2.communication == {}
    assert bf16.recommended is not None and bf16.recommended.name == "data_parallel"


def test_micro_batches_follow_each_schedules_own_rule() -> None:
    """Issue 45: the planner asked every multi-stage schedule for a multiple of the pipeline size and a micro-batch
    per stage, which torch's V schedules do not: ``ScheduleZBVZeroBubble`` takes any count and ``ScheduleDualPipeV``
    needs only ``>= 2p`` (``n_microbatches < self._num_stages`` raises). The planner now asks each schedule's
    ``ScheduleSpec``, the rule ``PipelineParallelStrategy`` validates with; its counts are ones the strategy runs."""
    from lightning_parallel.distributed.pipeline.schedule import validate_schedule_config
    from lightning_parallel.planner.plan import default_microbatches, pipeline_schedule

    # Batch 5 over 2 ranks x 2 stages: no multiple of 2 divides 5; both V schedules run 5 micro-batches.
    assert pipeline_schedule("ZBVZeroBubble", batch_size=5, pipeline_parallel_size=2, num_microbatches=None) == (
        5, "ZBVZeroBubble", 2)  # fmt: skip
    assert pipeline_schedule("DualPipeV", batch_size=5, pipeline_parallel_size=2, num_microbatches=None) == (
        5, "DualPipeV", 2)  # fmt: skip
    # A batch smaller than the stages: ZBV still runs one micro-batch per sample; DualPipeV refuses, so GPipe.
    assert pipeline_schedule("ZBVZeroBubble", batch_size=2, pipeline_parallel_size=2, num_microbatches=None) == (
        2, "ZBVZeroBubble", 2)  # fmt: skip
    assert pipeline_schedule("DualPipeV", batch_size=3, pipeline_parallel_size=2, num_microbatches=None) == (
        3, "GPipe", 1)  # fmt: skip
    # The interleaved schedules keep their rounds of p (torch's `number_of_rounds`): 12 over 4 ranks, not 10 or 11.
    assert default_microbatches(60, 4, "Interleaved1F1B") == 20
    assert default_microbatches(33, 4, "Interleaved1F1B") is None
    assert default_microbatches(33, 4, "ZBVZeroBubble") == 11
    # Unchanged where the old rule was right: 1F1B and GPipe.
    assert default_microbatches(12, 2, "1F1B") == 6 and default_microbatches(3, 4, "1F1B") is None
    assert pipeline_schedule("1F1B", batch_size=3, pipeline_parallel_size=4, num_microbatches=None) == (3, "GPipe", 1)
    for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                     "DualPipeV"):  # fmt: skip
        for batch_size in range(1, 40):
            for p in (2, 3, 4):
                m, chosen, stages_per_rank = pipeline_schedule(
                    schedule, batch_size=batch_size, pipeline_parallel_size=p, num_microbatches=None
                ) or (0, "", 0)
                assert batch_size % m == 0
                validate_schedule_config(chosen, pipeline_parallel_size=p, stages_per_rank=stages_per_rank,
                                         num_microbatches=m)  # fmt: skip
