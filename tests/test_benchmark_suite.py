"""Integration: the whole benchmark suite (``python -m benchmarks.run_all``) at its tiny preset, in this process.

One run of the suite (every benchmark, every configuration, 1-2 forked CPU ranks per run, gloo) is shared by all
tests of this module; it writes RESULTS.md and the figures into a temporary folder, never into ``benchmarks/``.
The ZeRO benchmark's own facts (bytes communicated and held) are checked on the same run.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported before forking so the ranks inherit it)
import pytest
import torch

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `benchmarks` is a folder at the repository root, not an installed package
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks import data_parallel, run_all, scaling, summary  # noqa: E402
from benchmarks import pipeline as pipeline_bench  # noqa: E402
from benchmarks import zero as zero_bench  # noqa: E402
from benchmarks.zero_report import render_markdown as render_zero  # noqa: E402

# The suite forks ~35 short runs; a hung rank fails the module instead of blocking CI.
pytestmark = pytest.mark.timeout(300)

_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[run_all.SuiteResults, Path]:
    real_results = _REPO_ROOT / "benchmarks" / "RESULTS.md"
    before = real_results.read_bytes() if real_results.exists() else None
    path = tmp_path_factory.mktemp("bench") / "RESULTS.md"
    torch.set_num_threads(1)
    results = run_all.run_suite(run_all.SuiteConfig(preset="tiny", results_path=path))
    after = real_results.read_bytes() if real_results.exists() else None
    assert before == after, "the test run must not write benchmarks/RESULTS.md"
    return results, path


@pytest.fixture(scope="module")
def zero(suite: tuple[run_all.SuiteResults, Path]) -> zero_bench.ZeroResults:
    return suite[0].benchmarks["zero"]


def test_every_benchmark_and_configuration_ran(suite: tuple[run_all.SuiteResults, Path]) -> None:
    results, _ = suite
    assert results.failed == {}
    assert list(results.benchmarks) == ["data_parallel", "zero", "pipeline"]
    dp = results.benchmarks["data_parallel"]
    assert set(dp.runs) == set(data_parallel.CONFIGS)
    assert all(len(runs) == 1 and runs[0]["tokens_per_s"] > 0 for runs in dp.runs.values())
    assert dp.bytes_ratio == 0.5  # fp16 compression sends exactly half of fp32's all-reduce bytes
    pipe = results.benchmarks["pipeline"]
    assert len(pipe.ours_step_s) == len(pipe.raw_step_s) == 1
    assert {schedule for schedule, _ in pipe.timelines} == set(_SCHEDULES)


def test_every_comparison_has_a_row_and_unavailable_anchors_say_why(suite: tuple[run_all.SuiteResults, Path]) -> None:
    rows = summary.comparisons(suite[0].benchmarks)
    pairs = {(row.ours, row.anchor) for row in rows}
    assert ("DataParallelStrategy", "Lightning DDPStrategy") in pairs
    for stage in (1, 2, 3):
        for anchor in ("Lightning DDPStrategy", "Lightning DDP + ZeroRedundancyOptimizer"):
            assert (f"ShardedOptimizerStrategy(stage={stage})", anchor) in pairs
    assert any(row.ours.startswith("PipelineParallelStrategy") and "pipelining" in row.anchor for row in rows)
    optional = {row.anchor: row for row in rows if "FSDP" in row.anchor or "DeepSpeed" in row.anchor}
    assert len(optional) == 3
    # Lightning refuses FSDP on CPU before starting any process; DeepSpeed is not installed (or refuses CPU).
    assert "requires a GPU accelerator" in optional["Lightning FSDPStrategy(SHARD_GRAD_OP)"].error
    for row in optional.values():
        assert row.error and not row.throughput
    for row in rows:
        if row.error is None:
            assert len(row.throughput) == 1 and all(math.isfinite(r) and r > 0 for r in row.throughput)


def test_results_md_has_the_summary_first_and_every_figure(suite: tuple[run_all.SuiteResults, Path]) -> None:
    _, path = suite
    text = path.read_text()
    starts = [text.index(f"<!-- begin {name} -->") for name in ("summary", "data_parallel", "zero", "pipeline")]
    assert starts[0] == min(starts)
    assert "throughput ours/anchor (>1 better)" in text and "no: `` " in text
    figures = path.parent / "figures"
    for name in ("throughput_ratios", "memory_per_rank", "communication", "scaling", "pipeline_timeline"):
        png = figures / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"(figures/{name}.png)" in text, name
    assert (figures / "pipeline_timeline.json").exists()


def test_measured_scaling_is_the_sharding_arithmetic(zero: zero_bench.ZeroResults) -> None:
    measured = scaling.measured_scaling(zero)
    assert set(measured) == {*zero_bench.OURS, zero_bench.DDP}
    ddp = measured[zero_bench.DDP]
    assert ddp.world_sizes == (1, 2)
    assert ddp.held_bytes[0] == ddp.held_bytes[1]  # DDP replicates everything
    for series in measured.values():
        assert series.comm_bytes[0] == 0 and series.comm_bytes[1] > 0  # nothing to exchange alone
        assert series.held_bytes[0] == ddp.held_bytes[0]  # one rank holds the whole model and state
    # Each stage shards one more kind of state: held bytes at world size 2 strictly fall with the stage.
    at_two = [measured[name].held_bytes[1] for name in (zero_bench.DDP, *zero_bench.OURS)]
    assert at_two == sorted(at_two, reverse=True) and len(set(at_two)) == 4


def test_planner_predicts_the_measured_bytes(zero: zero_bench.ZeroResults) -> None:
    measured = scaling.measured_scaling(zero)
    predicted = scaling.predicted_scaling(zero.config.memory, world_sizes=(1, 2, 8))
    assert predicted is not None, "lightning_parallel.planner.plan is missing"
    assert predicted[zero_bench.DDP].world_sizes == (1, 2, 8)
    assert predicted["zero3"].world_sizes == (2, 8)  # ZeRO needs two ranks
    # Held bytes equal exactly; received bytes up to our 8-byte non-finite-loss all-reduce per step.
    agreement = scaling.planner_agreement(measured, predicted)
    assert agreement is not None and agreement < 1e-4
    for name, series in measured.items():
        assert predicted[name].held_bytes[-2] == series.held_bytes[-1], name


def test_scaling_seam_draws_and_tabulates_predicted_series(zero: zero_bench.ZeroResults, tmp_path: Path) -> None:
    measured = scaling.measured_scaling(zero)
    sizes = scaling.PREDICTED_WORLD_SIZES
    predicted = {
        name: scaling.ScalingSeries(name, sizes, tuple(1e6 / ws for ws in sizes), tuple(1e6 for _ in sizes))
        for name in measured
    }
    scaling.save_scaling_chart(measured, predicted, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    table = scaling.scaling_table(measured, predicted)
    assert "ws 1024 (planner)" in table and "ws 2 |" in table
    with pytest.raises(ValueError, match="one value per world size"):
        scaling.ScalingSeries("bad", (1, 2), (1.0,), (1.0, 2.0))


def test_stages_1_and_2_communicate_what_ddp_does(zero: zero_bench.ZeroResults) -> None:
    ddp = zero.comm(zero_bench.DDP)
    assert ddp > 0 and zero.comm(zero_bench.DDP, "all_reduce_bytes") > 0
    for name in ("zero1", "zero2"):
        # Reduce-scatter + all-gather of the (padded) buckets = DDP's all-reduce.
        assert zero.comm(name) == pytest.approx(ddp, rel=1e-3), name
        # The only all-reduces are the one-integer non-finite-loss check (`nonfinite_loss="skip"`: 8 bytes a step)
        # and the "got a gradient" flags that keep unused parameters from being stepped (one byte per parameter
        # tensor; the tiny GPT has fewer than 100).
        assert zero.comm(name, "all_reduce_bytes") <= 8 + 100, name
    # ZeroRedundancyOptimizer broadcasts the updated parameters on top of DDP's all-reduce.
    assert zero.comm(zero_bench.ZERO_REDUNDANCY) > ddp


def test_held_bytes_are_sharded_by_stage(zero: zero_bench.ZeroResults) -> None:
    def held(name: str, field: str) -> float:
        return zero.throughput[name][0].held(field)

    ddp_state = held(zero_bench.DDP, "optimizer_state_bytes")
    for name in ("zero1", "zero2", "zero3", zero_bench.ZERO_REDUNDANCY):
        assert held(name, "optimizer_state_bytes") < 0.6 * ddp_state, name
    assert held("zero2", "gradient_bytes") < 0.6 * held(zero_bench.DDP, "gradient_bytes")
    assert held("zero3", "parameter_bytes") < 0.6 * held(zero_bench.DDP, "parameter_bytes")


def test_zero_report_has_the_tables_and_goals(zero: zero_bench.ZeroResults) -> None:
    text = render_zero(zero, command="pytest")
    for heading in ("### Throughput and communication", "### Memory per rank", "### Goals", "fsdp_shard_grad_op"):
        assert heading in text
    assert "stage 2 throughput / Lightning DDPStrategy" in text


def test_presets_and_arguments_are_validated() -> None:
    for module in (data_parallel, zero_bench, pipeline_bench):
        assert set(run_all.PRESET_NAMES) <= set(module.PRESETS), module.NAME
        with pytest.raises(ValueError, match="huge"):
            module.configure("huge")
    assert pipeline_bench.configure("small", repeats=1, steps=2).warmup_steps == 1
    assert zero_bench.configure("small", steps=2).throughput.steps == 2
    with pytest.raises(ValueError, match="nope"):
        run_all.SuiteConfig(only=("nope",))
    with pytest.raises(ValueError, match="repeats=0"):
        run_all.SuiteConfig(repeats=0)
    with pytest.raises(SystemExit):
        run_all.main(["--preset", "huge"])
