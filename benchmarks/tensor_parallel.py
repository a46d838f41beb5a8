"""ZeRO-3 x tensor parallelism against Lightning's own TP + FSDP2 path, side by side in interleaved repeats.

Ours: ``ShardedOptimizerStrategy(stage=3, tensor_parallel_size=2)``, which splits the layers the demo GPT names in
its ``tensor_parallel_plan()`` and shards with FSDP2 over the data axis, nothing written for it in the module. The
anchor: Lightning's ``ModelParallelStrategy(tensor_parallel_size=2)`` with the same plan written by hand in the
module's ``configure_model`` (``parallelize_module`` on each block, then ``fully_shard`` on each block and the
model: :class:`~benchmarks.anchors.TensorParallelGPT`), as a Lightning user writes it. Both train the same model from
the same initial weights on the same global batch (both tensor ranks of a pair read the same batch), so their losses
agree up to rounding. ``ModelParallelStrategy`` runs on CPU: Lightning builds its mesh on the CPU device over gloo,
where torch's ``parallelize_module`` and ``fully_shard`` run.

Layout: 1 data x 2 tensor on 2 processes (``tiny``; ``small`` and ``medium`` on a machine with fewer than 4 cores),
2 x 2 on 4 (``small`` and ``medium`` with 4 cores or more, ``large`` on 4 GPUs).
"""

from __future__ import annotations

import os
import sys
from functools import partial

from benchmarks.anchors import MeasuredModelParallelStrategy, TensorParallelGPT
from benchmarks.harness import Contender, PairedConfig, PairedResults, Workload, measure_pairs, module_of
from benchmarks.report import load_notes, paired_blocks, section
from lightning_parallel.strategies import ShardedOptimizerStrategy

__all__ = [
    "CONTENDERS",
    "NAME",
    "PAIRS",
    "PRESETS",
    "TENSOR_PARALLEL_SIZE",
    "Config",
    "TensorParallelResults",
    "measure",
    "render",
]

NAME = "tensor_parallel"
TENSOR_PARALLEL_SIZE = 2
"""Ranks of each tensor-parallel group, on both sides; the other processes are data parallel."""

CONTENDERS: tuple[Contender, ...] = (
    Contender(
        name="zero3_tp",
        label=f"ours: ShardedOptimizerStrategy(stage=3, tensor_parallel_size={TENSOR_PARALLEL_SIZE})",
        make_strategy=partial(
            ShardedOptimizerStrategy, 3, tensor_parallel_size=TENSOR_PARALLEL_SIZE, start_method="fork"
        ),
        is_ours=True,  # created with its weights: tensor parallelism splits weights that exist (no empty_init)
    ),
    Contender(
        name="model_parallel_tp",
        label=f"anchor: Lightning ModelParallelStrategy(tensor_parallel_size={TENSOR_PARALLEL_SIZE}) + the plan and"
        " fully_shard in configure_model",
        make_strategy=partial(MeasuredModelParallelStrategy, tensor_parallel_size=TENSOR_PARALLEL_SIZE),
        make_module=partial(module_of, TensorParallelGPT),
    ),
)
PAIRS: tuple[tuple[str, str], ...] = (("zero3_tp", "model_parallel_tp"),)


def _cpu_processes() -> int:
    """4 processes (2 data x 2 tensor) where this process may run on 4 cores or more, else 2 (1 x 2)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # not on macOS
    return 4 if cores >= 4 else 2


Config = PairedConfig
"""``workload.devices`` is a multiple of :data:`TENSOR_PARALLEL_SIZE`; ``workload.batch_size`` sequences per
data-parallel replica (a tensor-parallel group)."""


PRESETS: dict[str, Config] = {
    "tiny": Config(
        workload=Workload(preset="tiny", steps=4, warmup_steps=2, batch_size=4, seq_len=32, time_throughput=False),
        repeats=1,
    ),
    # With `make bench` (20.5 M parameters): 8 x 128 tokens per tensor-parallel pair, every rank of the pair
    # computing the whole batch on its half of the split layers.
    "medium": Config(workload=Workload(preset="gpt-20m", steps=8, warmup_steps=3, devices=_cpu_processes())),
    "small": Config(workload=Workload(steps=20, devices=_cpu_processes())),
    "large": Config(
        workload=Workload(preset="gpt-125m", steps=30, warmup_steps=5, seq_len=1024, accelerator="gpu", devices=4)
    ),
}


TensorParallelResults = PairedResults


def measure(config: Config) -> TensorParallelResults:
    return measure_pairs(CONTENDERS, PAIRS, config)


def render(results: TensorParallelResults, *, command: str) -> str:
    workload = results.config.workload
    data = workload.devices // TENSOR_PARALLEL_SIZE
    return section(
        f"{NAME}: ShardedOptimizerStrategy(stage=3, tensor_parallel_size={TENSOR_PARALLEL_SIZE}) vs Lightning's"
        " ModelParallelStrategy (TP + FSDP2)",
        command=command,
        notes=[
            f"{workload.describe()}; {data} data x {TENSOR_PARALLEL_SIZE} tensor (a replica is a tensor-parallel"
            f" pair: {workload.batch_size * data} sequences per step in all); {results.config.repeats} interleaved"
            " repeats.",
            *load_notes(results.outcomes.values()),
            "The same plan on both sides: the demo GPT's `tensor_parallel_plan()` (ours reads it) and the same styles"
            " written by hand in the anchor's `configure_model`: `mlp.c_fc` colwise, `mlp.c_proj` rowwise,"
            " `attn.c_attn` (fused q/k/v) colwise with its output gathered, `attn.c_proj` rowwise on a replicated"
            " input; FSDP2 on each block and the model over the data axis (ours: its ZeRO-3 units). Same initial"
            " weights, same batches: the final losses agree up to rounding.",
            "Bytes held: parameters, gradients and optimizer state of the largest rank (ours: `memory_report()`, the"
            " anchor's: the parameters' and `.grad`'s local shards and AdamW's state); wire bytes: FSDP2's and"
            " tensor parallelism's `DTensor` collectives through the monitor's `CollectiveTap` on both sides, ring"
            " algorithms over the world size (at 2 x 2 each group has 2 ranks: the same overcount on both sides). At"
            " 2 x 2 on gloo ours all-reduces the gradients over the data axis (gloo's faster path, as in the `zero`"
            " section) where FSDP2 reduce-scatters them: more bytes on the wire (measured at `tiny`: 1.4x).",
            "Tensor parallelism is for layers that do not fit one device, over fast links; on CPU processes over"
            " gloo each split layer's collectives cost more than its halved compute saves: the ratio compares two"
            " implementations of the same layout, not tensor parallelism with data parallelism.",
        ],
        blocks=paired_blocks(results.comparisons, results.outcomes.values()),
    )


if __name__ == "__main__":
    from benchmarks.run_all import main

    sys.exit(main(["--only", NAME, *sys.argv[1:]]))
