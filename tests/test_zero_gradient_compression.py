"""``ShardedOptimizerStrategy(gradient_compression="bf16"|"fp16")``: gradients reduced in 16 bits into fp32 shards.

Real 2-rank (and 4-rank hybrid) Trainers on gloo train :class:`ResidualMLP` under ``32-true`` at stages 1, 2 and 3
(stage 3: FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)``), with and without gradient accumulation, and end within
the 16-bit dtype's rounding of single-device fp32 training; the same fits uncompressed end within fp32 rounding, so the
difference is the compression's. ``ParallelismMonitor`` counts the gradient reductions' bytes: exactly half of the
uncompressed fit's, parameter all-gathers unchanged. A bad value is refused before any collective, naming the values
accepted.

All 2-rank fits share one pair of forked ranks (each Trainer costs seconds).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from distributed_harness import run_distributed
from model_zoo import ResidualMLP, fit_in_rank, single_device

from lightning_parallel import ShardedOptimizerStrategy
from lightning_parallel.monitor import ParallelismMonitor

STEPS = 4
BUCKET_CAP_MB = 0.002  # 2 KiB: the model's 1,612 elements fill several buckets at stage 1 (stage 2: 16 at least)
NUM_PARAMETER_TENSORS = 8  # ZeRO-1/2's "got a gradient" flags: one byte each per sync, never compressed
NUMEL = 1612  # elements of ResidualMLP (even: no padding at 2 ranks, at any stage)
# 4 SGD steps (lr 0.1): measured max |difference| from one fp32 device 3.0e-8 uncompressed, 1.8e-4 (bf16) and 2.3e-5
# (fp16) compressed (each rank's gradient and their sum rounded to 8 or 11 significant bits); 1.2e-4 (bf16) with 2
# accumulated micro-batches. Every stage's compressed weights are bit-identical (the same arithmetic).
FP32_CLOSE = {"rtol": 0.0, "atol": 1e-6}
COMPRESSED_CLOSE = {"bf16": {"rtol": 0.0, "atol": 1e-3}, "fp16": {"rtol": 0.0, "atol": 1e-4}}

CASES: dict[str, dict[str, Any]] = {
    **{f"zero{stage}": {"stage": stage} for stage in (1, 2, 3)},
    **{f"zero{stage}_bf16": {"stage": stage, "gradient_compression": "bf16"} for stage in (1, 2, 3)},
    **{f"zero{stage}_fp16": {"stage": stage, "gradient_compression": "fp16"} for stage in (2, 3)},
}
ACCUMULATE = {"accumulate_grad_batches": 2}
ACCUMULATED_CASES = {f"zero{stage}_bf16_accumulate": stage for stage in (1, 2, 3)}
BF16_TRUE = {"precision": "bf16-true"}  # bf16 parameters, fp32 masters in the shard: reduced in fp32 by default
# bf16-true weights, bf16 against fp32 reduction: measured max |difference| 9.8e-4, one bf16 ulp (2^-10 in [1/8, 1/4)).
BF16_WEIGHTS_CLOSE = {"rtol": 2**-7, "atol": 1e-3}


def _fit(case_options: dict[str, Any], world_size: int, **kwargs: Any) -> dict[str, Any]:
    """Collective: fit under a monitor; the consolidated weights (rank 0) and this rank's bytes of each step."""
    monitor = ParallelismMonitor(figure_path=False, summary_path=None)
    strategy = ShardedOptimizerStrategy(bucket_cap_mb=BUCKET_CAP_MB, **case_options)
    weights = fit_in_rank(ResidualMLP, strategy, world_size, steps=STEPS, callbacks=[monitor], **kwargs)
    return {"weights": weights, "bytes": [record.communication for record in monitor.steps]}


def _in_ranks(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    results = {case: _fit(options, world_size) for case, options in CASES.items()}
    for case, stage in ACCUMULATED_CASES.items():
        results[case] = _fit({"stage": stage, "gradient_compression": "bf16"}, world_size, **ACCUMULATE)
    for stage in (1, 2, 3):
        for compression in (None, "bf16"):
            options = {"stage": stage, "gradient_compression": compression}
            results[f"zero{stage}_{compression}_bf16_true"] = _fit(options, world_size, **BF16_TRUE)
    return results


@cache
def _ranks() -> list[dict[str, Any]]:
    return run_distributed(_in_ranks, 2, init_process_group=False, timeout=600)


@cache
def _single_device(**kwargs: Any) -> dict[str, torch.Tensor]:
    return single_device(ResidualMLP, steps=STEPS, **kwargs)


def _max_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((actual[name] - tensor).abs().max().item() for name, tensor in expected.items())


COMPRESSED = [(options["stage"], options["gradient_compression"]) for options in CASES.values() if len(options) > 1]
"""(stage, compression) of the compressed cases: fp16 at stages 2 and 3 only (stage 1 shares stage 2's bucket code)."""


@pytest.mark.parametrize(("stage", "compression"), COMPRESSED)
def test_compressed_reduction_trains_like_one_device_within_the_dtype(stage: int, compression: str) -> None:
    reference = _single_device()
    plain = _ranks()[0][f"zero{stage}"]["weights"]
    compressed = _ranks()[0][f"zero{stage}_{compression}"]["weights"]
    torch.testing.assert_close(plain, reference, **FP32_CLOSE)
    torch.testing.assert_close(compressed, reference, **COMPRESSED_CLOSE[compression])
    assert _max_difference(compressed, reference) > FP32_CLOSE["atol"]  # guard: the reduction was 16-bit
    assert all(tensor.dtype == torch.float32 for tensor in compressed.values())
    # Stages 1-2 (our buckets) and 3 (FSDP2's reduce_dtype) do the same arithmetic: the same bits.
    stage2 = _ranks()[0][f"zero2_{compression}"]["weights"]
    torch.testing.assert_close(compressed, stage2, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_compressed_reduction_with_accumulation_trains_like_one_device(stage: int) -> None:
    """Two micro-batches per step: the unreduced sum stays fp32 at stages 1-2 (the bucket); FSDP2 keeps it in its
    ``reduce_dtype`` at stage 3 (torch's ``FSDPParam.to_accumulated_grad_if_needed``), within the same tolerance."""
    reference = _single_device(**ACCUMULATE)
    compressed = _ranks()[0][f"zero{stage}_bf16_accumulate"]["weights"]
    torch.testing.assert_close(compressed, reference, **COMPRESSED_CLOSE["bf16"])


def _gradient_bytes(step: dict[str, int], stage: int) -> int:
    """The bytes of one step's gradient reductions: on gloo every stage all-reduces (stage 3 through our
    reduction FSDP2 calls, ``stage3_gloo.py``); stages 1-2 all-reduce their one-byte flags beside."""
    flags = NUM_PARAMETER_TENSORS if stage in (1, 2) and "all_reduce" in step else 0
    return step.get("all_reduce", 0) + step.get("reduce_scatter", 0) - flags


@pytest.mark.parametrize(("stage", "compression"), COMPRESSED)
def test_compression_halves_the_gradient_bytes_exactly(stage: int, compression: str) -> None:
    case = f"zero{stage}_{compression}"
    for rank, results in enumerate(_ranks()):
        plain, compressed = results[f"zero{stage}"]["bytes"], results[case]["bytes"]
        assert len(plain) == len(compressed) == STEPS, f"rank {rank}"
        for before, after in zip(plain, compressed, strict=True):
            assert _gradient_bytes(before, stage) > 0
            assert 2 * _gradient_bytes(after, stage) == _gradient_bytes(before, stage), f"rank {rank}: {after}"
            assert _gradient_bytes(after, stage) == 2 * NUMEL  # every gradient element once, in 2 bytes
            assert after.get("all_gather") == before.get("all_gather")  # parameters travel in their own dtype


def test_accumulation_reduces_once_per_step_in_16_bits() -> None:
    """With 2 micro-batches a step only the second one reduces, the same bytes as a step without accumulation."""
    for results in _ranks():
        for stage in (1, 2, 3):
            plain = results[f"zero{stage}_bf16"]["bytes"]
            accumulated = results[f"zero{stage}_bf16_accumulate"]["bytes"]
            gradient_bytes = [_gradient_bytes(step, stage) for step in accumulated]
            assert gradient_bytes == [0, _gradient_bytes(plain[0], stage)] * (len(accumulated) // 2)


# ---------------------------------------------------------------------------------------------- hybrid sharding
HYBRID = {"world_size": 4, "shard_size": 2}


def _hybrid_in_ranks(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    results = {}
    for stage in (2, 3):
        for compression in (None, "bf16"):
            options = {"stage": stage, "shard_size": HYBRID["shard_size"], "gradient_compression": compression}
            results[f"zero{stage}_{compression}"] = _fit(options, world_size)
    return results


@cache
def _hybrid_ranks() -> list[dict[str, Any]]:
    return run_distributed(_hybrid_in_ranks, HYBRID["world_size"], init_process_group=False, timeout=600)


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_reduces_in_16_bits_within_and_across_the_groups(stage: int) -> None:
    """``shard_size=2`` of 4 ranks: the reduction in each shard group and the all-reduce of the shards across the
    groups both travel in bf16 (half the bytes), and training ends within bf16's rounding of one device."""
    reference = _single_device()
    ranks = _hybrid_ranks()
    torch.testing.assert_close(ranks[0][f"zero{stage}_bf16"]["weights"], reference, **COMPRESSED_CLOSE["bf16"])
    torch.testing.assert_close(ranks[0][f"zero{stage}_None"]["weights"], reference, **FP32_CLOSE)
    for results in ranks:
        plain, compressed = results[f"zero{stage}_None"]["bytes"], results[f"zero{stage}_bf16"]["bytes"]
        assert len(plain) == len(compressed) == STEPS
        for before, after in zip(plain, compressed, strict=True):
            assert 2 * _gradient_bytes(after, stage) == _gradient_bytes(before, stage), after
            assert _gradient_bytes(after, stage) == 2 * (NUMEL + NUMEL // 2)  # the group's buckets, then one shard
            assert after.get("all_gather") == before.get("all_gather")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_parameters_with_fp32_masters_reduce_in_bf16_when_asked(stage: int) -> None:
    """``bf16-true``: the bf16 gradients are reduced as they are (not upcast to fp32 first, half the bytes) into the
    fp32 shard beside the masters; the bf16 weights stay within a bf16 rounding of the fp32 reduction's."""
    for rank, results in enumerate(_ranks()):
        plain, compressed = results[f"zero{stage}_None_bf16_true"], results[f"zero{stage}_bf16_bf16_true"]
        for before, after in zip(plain["bytes"], compressed["bytes"], strict=True):
            assert 2 * _gradient_bytes(after, stage) == _gradient_bytes(before, stage) == 4 * NUMEL, f"rank {rank}"
    weights = _ranks()[0][f"zero{stage}_bf16_bf16_true"]["weights"]
    assert all(tensor.dtype == torch.bfloat16 for tensor in weights.values())
    reference = _ranks()[0][f"zero{stage}_None_bf16_true"]["weights"]
    torch.testing.assert_close(weights, reference, **BF16_WEIGHTS_CLOSE)
    stage2 = _ranks()[0]["zero2_bf16_bf16_true"]["weights"]
    torch.testing.assert_close(weights, stage2, rtol=0.0, atol=0.0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("fp8", r"`gradient_compression='fp8'` is invalid. Valid options: None \(.*\), 'bf16' \(.*\), 'fp16'"),
        (torch.bfloat16, r"`gradient_compression=torch.bfloat16` is invalid. Valid options: None .*'bf16'"),
        ("powersgd", r"`gradient_compression='powersgd'` is not supported by ZeRO.*'bf16' or 'fp16'"),
    ],
)
def test_a_bad_gradient_compression_is_refused_naming_the_accepted_values(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardedOptimizerStrategy(stage=2, gradient_compression=value)
