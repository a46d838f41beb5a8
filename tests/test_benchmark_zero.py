"""Integration: the ZeRO benchmark at its tiny preset, forking 1-2 CPU ranks per run from this process."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported before forking so the ranks inherit it)
import pytest
import torch

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:  # `benchmarks` is a folder at the repository root, not an installed package
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import zero as bench  # noqa: E402
from benchmarks.zero_report import render_markdown  # noqa: E402


@pytest.fixture(scope="module")
def results() -> bench.ZeroResults:
    torch.set_num_threads(1)
    return bench.measure(bench.PRESETS["tiny"])


def test_every_configuration_ran_and_unavailable_anchors_say_why(results: bench.ZeroResults) -> None:
    assert set(bench.CONTENDERS) <= set(results.throughput)
    for name, runs in results.throughput.items():
        assert len(runs) == 1, name
        assert math.isfinite(runs[0].summary["tokens_per_s"]) and runs[0].summary["tokens_per_s"] > 0, name
    # Lightning refuses FSDP on CPU before starting any process.
    assert "requires a GPU accelerator" in results.unavailable["fsdp_shard_grad_op"]
    for name in bench.OPTIONAL_ANCHORS:
        assert (name in results.unavailable) != (name in results.contenders)
    for name in bench.CONTENDERS:
        assert (name, 2) in results.memory
    for name in (*bench.OURS, bench.DDP):
        assert (name, 1) in results.memory


def test_stages_1_and_2_communicate_what_ddp_does(results: bench.ZeroResults) -> None:
    ddp = results.comm(bench.DDP)
    assert ddp > 0 and results.comm(bench.DDP, "all_reduce_bytes") > 0
    for name in ("zero1", "zero2"):
        # Reduce-scatter + all-gather of the (padded) buckets = DDP's all-reduce.
        assert results.comm(name) == pytest.approx(ddp, rel=1e-3), name
        # The only all-reduce is the one-integer non-finite-loss check (`nonfinite_loss="skip"`): 8 bytes a step.
        assert results.comm(name, "all_reduce_bytes") <= 8, name
    # ZeroRedundancyOptimizer broadcasts the updated parameters on top of DDP's all-reduce.
    assert results.comm(bench.ZERO_REDUNDANCY) > ddp


def test_held_bytes_are_sharded_by_stage(results: bench.ZeroResults) -> None:
    def held(name: str, field: str) -> float:
        return results.throughput[name][0].held(field)

    ddp_state = held(bench.DDP, "optimizer_state_bytes")
    for name in ("zero1", "zero2", "zero3", bench.ZERO_REDUNDANCY):
        assert held(name, "optimizer_state_bytes") < 0.6 * ddp_state, name
    assert held("zero2", "gradient_bytes") < 0.6 * held(bench.DDP, "gradient_bytes")
    assert held("zero3", "parameter_bytes") < 0.6 * held(bench.DDP, "parameter_bytes")


def test_report_has_the_tables_and_goals(results: bench.ZeroResults) -> None:
    text = render_markdown(results, command="pytest")
    for heading in ("### Throughput and communication", "### Memory per rank", "### Goals", "fsdp_shard_grad_op"):
        assert heading in text
    assert "stage 2 throughput / Lightning DDPStrategy" in text
