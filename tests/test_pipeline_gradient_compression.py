"""``PipelineParallelStrategy(zero_stage=1|2|3, gradient_compression="bf16")``: each stage's gradients reduced over its
replicas in 16 bits, as ``ShardedOptimizerStrategy(gradient_compression=...)`` reduces a whole model's.

Real 4-rank Trainers on gloo (``pipeline_parallel_size=2`` x 2 data-parallel replicas of each stage) train
:class:`ResidualMLP` under ``32-true`` at ZeRO stages 1, 2 and 3, with and without compression: compressed, the weights
end within bf16's rounding of single-device fp32 training, uncompressed within fp32's, so the difference is the
compression's. At stages 1-2 ``ParallelismMonitor`` counts each rank's gradient reductions: exactly half the
uncompressed fit's bytes, two per element of the rank's stage; the pipeline's point-to-point bytes are unchanged (at
stage 3 the monitor counts no FSDP2 collective inside a pipeline: ``stage_holder.py`` installs no tap; the weights'
distance from one device shows the 16-bit reduction there). ``zero_stage=0`` refuses
the option before any collective, naming ``zero_stage``.

All fits share one set of forked ranks (each Trainer costs seconds).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from model_zoo import ResidualMLP, fit_in_rank, single_device

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.monitor import ParallelismMonitor

STEPS = 4
WORLD_SIZE = 4  # 2 pipeline ranks x 2 replicas of each stage
STAGES = (1, 2, 3)
# 4 SGD steps (lr 0.1), as tests/test_zero_gradient_compression.py: fp32 reduction within 1e-6 of one device, bf16
# reduction within 1e-3 (each rank's gradient and their sum rounded to 8 significant bits) and more than 1e-6 away.
FP32_CLOSE = {"rtol": 0.0, "atol": 1e-6}
BF16_CLOSE = {"rtol": 0.0, "atol": 1e-3}
GRADIENT_OPS = ("all_reduce", "reduce_scatter")  # gloo: stages 1-2 all-reduce their buckets, FSDP2's reduction too


class _StageSize(pl.Callback):
    """This rank's stage: its elements and its parameter tensors (read while the module is still split)."""

    def __init__(self) -> None:
        self.numel = self.tensors = 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        parameters = list(pl_module.parameters())
        self.numel, self.tensors = sum(p.numel() for p in parameters), len(parameters)


def _fit(stage: int, compression: str | None) -> dict[str, Any]:
    """Collective: fit under a monitor; the consolidated weights (rank 0), this rank's bytes of each step and stage."""
    monitor, size = ParallelismMonitor(figure_path=False, summary_path=None), _StageSize()
    strategy = PipelineParallelStrategy(
        pipeline_parallel_size=2, zero_stage=stage, gradient_compression=compression, timeout=120
    )
    weights = fit_in_rank(ResidualMLP, strategy, WORLD_SIZE, steps=STEPS, callbacks=[monitor, size])
    steps = [record.communication for record in monitor.steps]
    return {"weights": weights, "bytes": steps, "numel": size.numel, "tensors": size.tensors}


def _in_ranks(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {(stage, compression): _fit(stage, compression) for stage in STAGES for compression in (None, "bf16")}


@cache
def _ranks() -> list[dict[Any, Any]]:
    return run_distributed(_in_ranks, WORLD_SIZE, init_process_group=False, timeout=600)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_reduction_in_the_pipeline_trains_like_one_device_within_bf16(stage: int) -> None:
    reference = single_device(ResidualMLP, steps=STEPS)
    plain, compressed = _ranks()[0][(stage, None)]["weights"], _ranks()[0][(stage, "bf16")]["weights"]
    torch.testing.assert_close(plain, reference, **FP32_CLOSE)
    torch.testing.assert_close(compressed, reference, **BF16_CLOSE)
    assert max((compressed[n] - t).abs().max().item() for n, t in reference.items()) > FP32_CLOSE["atol"]  # 16 bits
    assert all(tensor.dtype == torch.float32 for tensor in compressed.values())


@pytest.mark.parametrize("stage", [1, 2])  # stage 3: the monitor counts no FSDP2 collective in a pipeline (no tap)
def test_bf16_reduction_in_the_pipeline_halves_each_stages_gradient_bytes(stage: int) -> None:
    for rank, results in enumerate(_ranks()):
        plain, compressed = results[(stage, None)], results[(stage, "bf16")]
        assert len(plain["bytes"]) == len(compressed["bytes"]) == STEPS, f"rank {rank}"
        for before, after in zip(plain["bytes"], compressed["bytes"], strict=True):
            saved = sum(before.get(op, 0) for op in GRADIENT_OPS) - sum(after.get(op, 0) for op in GRADIENT_OPS)
            assert saved == 2 * plain["numel"], f"rank {rank}: {before} -> {after}"  # 4 -> 2 bytes per element
            others = {op: count for op, count in before.items() if op not in GRADIENT_OPS}
            assert others == {op: count for op, count in after.items() if op not in GRADIENT_OPS}, f"rank {rank}"


def test_gradient_compression_without_zero_is_refused_naming_zero_stage() -> None:
    with pytest.raises(ValueError, match=r"`gradient_compression='bf16'`.*`zero_stage=0`.*`zero_stage=1`, 2 or 3"):
        PipelineParallelStrategy(zero_stage=0, gradient_compression="bf16")
    with pytest.raises(ValueError, match=r"'powersgd'.* not supported by ZeRO"):  # ZeroConfig's own message
        PipelineParallelStrategy(zero_stage=2, gradient_compression="powersgd")  # type: ignore[arg-type]
    assert (
        PipelineParallelStrategy(zero_stage=2, gradient_compression="fp16").zero_config.gradient_compression == "fp16"
    )
