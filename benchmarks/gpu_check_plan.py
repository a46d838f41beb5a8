"""What ``make gpu-check`` runs: its rows in order of importance, each row's strategy and one-device reference.

One GPU *forces* the sharded code paths at world size 1 (``benchmarks/gpu_check_runs.py``): ZeRO 1/2/3 with flat
buckets / FSDP2, the overlapped parameter all-gather, fp32 masters under ``bf16-true``, hybrid sharding's
all-reduce across replicas (stages 1-2), data parallel's gradient compression hook, the pipeline engine (one stage,
two micro-batches), two torchft replica groups on the same device, and the CUDA-before-fork refusal. With two GPUs
or more, multi-rank rows follow. The most telling rows come first, so a short budget cuts the least telling ones.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

import torch
from lightning.pytorch.strategies import Strategy

from benchmarks.gpu_check_fit import FitPlan
from benchmarks.gpu_check_runs import (
    ForcedDataParallelStrategy,
    ForcedShardingStrategy,
    RoundedGradients,
    StaleForward,
)
from lightning_parallel.strategies import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy

__all__ = [
    "FORK",
    "NUM_MICROBATCHES",
    "REPEAT",
    "STALE",
    "TENSOR_PARALLEL",
    "TORCHFT",
    "Row",
    "fit_plan",
    "plan",
    "reference_plan",
]

REPEAT, STALE = "control: one device again", "control: stale forward"
"""The positive control (must pass) and the negative control (must be rejected)."""
TORCHFT = "torchft: 2 replica groups"
FORK = "fork refused after CUDA"
TENSOR_PARALLEL = "zero3 tp=2"
"""``ShardedOptimizerStrategy(stage=3, tensor_parallel_size=2)``: the demo GPT's own plan over pairs of GPUs."""
NUM_MICROBATCHES = 2
"""Micro-batches per step of the pipeline rows (and of their one-device reference)."""


@dataclass(frozen=True)
class Row:
    """One line of the table: a check (see :func:`fit_plan`) at a precision and world size."""

    name: str
    precision: str = "32-true"
    world_size: int = 1
    skip: str | None = None
    """Why this row cannot run here (then it is reported as skipped, with this reason)."""

    @property
    def resumes(self) -> bool:
        """Whether the row also resumes from its mid-run checkpoint (every strategy; not the controls)."""
        return not self.name.startswith("control") and self.name not in (TORCHFT, FORK)

    @property
    def reference_key(self) -> str | None:
        """Which one-device run this row is compared with (see :func:`reference_plan`); ``None``: none."""
        if self.name == FORK:
            return None
        if "compressed" in self.name:
            return f"{self.precision} rounded {self.name.split()[1].split('-')[0]}"
        if self.name.startswith("pipeline"):  # the same micro-batches, accumulated (see `_TOLERANCES`)
            return f"{self.precision} accumulate {NUM_MICROBATCHES}"
        if self.precision == "bf16-true":
            return "bf16-true masters"  # our fp32 masters at world size 1 (plain Lightning steps the bf16 weights)
        return self.precision


def _single_device_rows(device: str) -> list[Row]:
    """The one-rank rows, most telling first."""
    rows = [Row("zero2 forced"), Row("zero3 forced"), Row(STALE), Row("pipeline"), Row(FORK)]
    rows += [Row("zero3 forced", "bf16-true"), Row("zero2 forced", "bf16-mixed"), Row(REPEAT, "bf16-mixed")]
    rows += [Row(STALE, "bf16-mixed"), Row("pipeline", "bf16-mixed"), Row("zero2 hybrid forced"), Row(TORCHFT)]
    rows += [Row("zero1 forced"), Row("data_parallel bf16-compressed forced")]
    fp16_skip = "gloo has no fp16 all-reduce (runs on CUDA)" if device != "cuda" else None
    rows += [Row("data_parallel fp16-compressed forced", skip=fp16_skip), Row("zero3 forced", "bf16-mixed")]
    rows += [Row("zero2 forced", "bf16-true"), Row("zero1 hybrid forced"), Row("zero1 forced", "bf16-mixed")]
    rows += [Row("zero1 forced", "bf16-true"), Row("data_parallel bf16-compressed forced", "bf16-mixed")]
    return [*rows, Row(REPEAT)]


def _multi_device_rows(num_gpus: int) -> list[Row]:
    names = ["data_parallel", "zero1", "zero2", "zero3", "zero2 hybrid", "zero3 hybrid", "pipeline"]
    names += ["pipeline zero_stage=1", "pipeline zero_stage=2", "pipeline zero_stage=3", TENSOR_PARALLEL]
    rows = [Row(name, precision, num_gpus) for precision in ("32-true", "bf16-mixed") for name in names]
    rows += [Row(name, "bf16-true", num_gpus) for name in names if name.startswith("zero")]
    if num_gpus % 2:
        odd = "tensor parallelism splits layers over pairs of GPUs: an even number is needed"
        rows = [replace(row, skip=odd) if row.name == TENSOR_PARALLEL else row for row in rows]
    return rows


def plan(device: str, *, num_gpus: int) -> list[Row]:
    """Every row, in the order they run: one rank first, then (two GPUs or more) the multi-rank rows."""
    has_torchft = importlib.util.find_spec("torchft") is not None
    rows = []
    for row in _single_device_rows(device):
        if row.name == TORCHFT and not has_torchft:
            row = Row(TORCHFT, skip="torchft not installed")
        if row.name == FORK and device != "cuda":
            row = Row(FORK, skip="CUDA is not initialised in this process (CPU stand-in)")
        rows.append(row)
    return rows + (_multi_device_rows(num_gpus) if num_gpus >= 2 else [])


def _pipeline_stages(name: str, world_size: int) -> int:
    """Stages of a pipeline row: 2 where the GPUs allow (ZeRO in a pipeline also needs replicas of each stage)."""
    stages = 1 if "zero_stage" in name and world_size < 4 else 2
    return min(stages, world_size)


def _strategy(name: str, world_size: int) -> Strategy | str:
    """The strategy of a fitted row (``"auto"``: Lightning's single device)."""
    start = "spawn" if world_size > 1 else "popen"  # spawn: CUDA is initialised here; popen with 1 rank: in-process
    if name in (REPEAT, STALE):
        return "auto"
    if name.endswith("forced"):
        if name.startswith("data_parallel"):
            return ForcedDataParallelStrategy(gradient_compression=name.split()[1].split("-")[0])  # type: ignore[arg-type]
        return ForcedShardingStrategy(int(name[4]), hybrid="hybrid" in name)  # type: ignore[arg-type]
    if name == "data_parallel":
        return DataParallelStrategy(start_method=start)
    if name.startswith("pipeline"):
        zero_stage = int(name[-1]) if "zero_stage" in name else 0
        return PipelineParallelStrategy(
            pipeline_parallel_size=_pipeline_stages(name, world_size),
            num_microbatches=NUM_MICROBATCHES,
            zero_stage=zero_stage,  # type: ignore[arg-type]
            start_method=start,
        )
    shard_size = max(world_size // 2, 1) if name.endswith("hybrid") else None  # 2 groups of world_size / 2 ranks
    return ShardedOptimizerStrategy(
        int(name[4]),  # type: ignore[arg-type]
        shard_size=shard_size,
        tensor_parallel_size=_tensor_parallel_size(name),
        overlap_param_gather=True,
        start_method=start,
    )


def _tensor_parallel_size(name: str) -> int:
    return 2 if name == TENSOR_PARALLEL else 1


def fit_plan(row: Row) -> FitPlan:
    """How ``row`` fits (not the torchft and fork rows, which run their own way)."""
    stages = _pipeline_stages(row.name, row.world_size) if row.name.startswith("pipeline") else 1
    return FitPlan(
        strategy=_strategy(row.name, row.world_size),
        precision=row.precision,
        devices=row.world_size,
        replicas=row.world_size // stages // _tensor_parallel_size(row.name),  # a tensor-parallel pair reads one batch
        extra=[StaleForward()] if row.name == STALE else [],
    )


def reference_plan(key: str) -> FitPlan:
    """The one-device run called ``key`` (:attr:`Row.reference_key`)."""
    precision, *kind = key.split()
    if kind == ["masters"]:
        return FitPlan(strategy=ShardedOptimizerStrategy(2), precision=precision)
    if kind[:1] == ["rounded"]:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[kind[1]]
        return FitPlan(strategy="auto", precision=precision, extra=[RoundedGradients(dtype)])
    if kind[:1] == ["accumulate"]:
        return FitPlan(strategy="auto", precision=precision, accumulate=int(kind[1]))
    return FitPlan(strategy="auto", precision=precision)
