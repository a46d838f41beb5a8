"""ShardedOptimizerStrategy (ZeRO 1/2/3) against Lightning's DDP, DDP + ZeroRedundancyOptimizer, FSDP, FSDP2 and
DeepSpeed.

* **Throughput** (``workload``): every contender in interleaved repeats; ratios ours / anchor per repeat, and the
  bytes held, peak memory, bytes on the wire and exposed communication per step of the same runs. Besides the
  anchors: ours at stages 1 and 2 with ``overlap_param_gather=False`` (what overlapping the parameter all-gather with
  the next forward buys), ZeRO-3 against Lightning's FSDP2 path (``ModelParallelStrategy`` + ``fully_shard`` per
  block), ZeRO-2 and Lightning's DDP each with the model compiled in place (the compiled ratio), and ZeRO-1/2/3,
  Lightning's DDP and the FSDP2 path each with a plain user callback (``harness.UserTimingCallback``: overrides
  ``on_train_batch_end``, reads nothing), what a typical training script gets.
* **Scaling** (``scaling``, a model whose AdamW state dominates): ours and DDP once at each of ``world_sizes``;
  bytes held by the largest rank and on the wire per step, beside ``lightning_parallel.planner.plan``'s prediction
  for those and larger world sizes.

ZeRO-3 creates the model under ``trainer.init_module(empty_init=True)`` (meta device, sharded before it is
materialised), as a user does to get its memory benefit; its initial weights, and so its loss, differ from the others'.
To add an anchor: a :class:`~benchmarks.harness.Contender` in :data:`CONTENDERS` and its pairs in :data:`PAIRS`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from benchmarks import figures
from benchmarks.anchors import (
    FullyShardedGPT,
    MeasuredDDPStrategy,
    MeasuredModelParallelStrategy,
    ZeroRedundancyGPT,
    deepspeed,
    fsdp_shard_grad_op,
)
from benchmarks.harness import (
    Comparison,
    Contender,
    Outcome,
    Workload,
    compare,
    compile_backend,
    compiled,
    module_of,
    run_interleaved,
    with_user_callback,
)
from benchmarks.report import comparison_table, load_notes, markdown_table, mib, outcome_table, section
from lightning_parallel.demos.gpt import GPTConfig
from lightning_parallel.planner import plan
from lightning_parallel.strategies import ShardedOptimizerStrategy

__all__ = ["CONTENDERS", "NAME", "PAIRS", "PRESETS", "Config", "ZeroResults", "measure", "render", "write_figures"]

NAME = "zero"
DDP = "lightning_ddp"


def _ours(stage: int) -> Contender:
    return Contender(
        name=f"zero{stage}",
        label=f"ours: ShardedOptimizerStrategy(stage={stage})",
        make_strategy=partial(ShardedOptimizerStrategy, stage, start_method="fork"),
        empty_init=stage == 3,
        is_ours=True,
    )


def _ours_without_overlap(stage: int) -> Contender:
    """Stages 1-2 waiting for the parameter all-gather at the end of the step instead of during the next forward."""
    return Contender(
        name=f"zero{stage}_no_overlap",
        label=f"ours: ShardedOptimizerStrategy(stage={stage}, overlap_param_gather=False)",
        make_strategy=partial(ShardedOptimizerStrategy, stage, overlap_param_gather=False, start_method="fork"),
        is_ours=True,
    )


_DDP_CONTENDER = Contender(name=DDP, label="anchor: Lightning DDPStrategy", make_strategy=MeasuredDDPStrategy)
_FSDP2_CONTENDER = Contender(
    name="fsdp2",
    label="anchor: Lightning ModelParallelStrategy + fully_shard per block (FSDP2)",
    make_strategy=MeasuredModelParallelStrategy,
    make_module=partial(module_of, FullyShardedGPT),
    empty_init=True,  # as ours at stage 3: Lightning materialises the meta model after `configure_model`
)

CONTENDERS: tuple[Contender, ...] = (
    _ours(1),
    _ours(2),
    _ours(3),
    _DDP_CONTENDER,
    Contender(
        name="ddp_zero_redundancy",
        label="anchor: Lightning DDP + ZeroRedundancyOptimizer",
        make_strategy=MeasuredDDPStrategy,
        make_module=partial(module_of, ZeroRedundancyGPT),
    ),
    Contender(
        name="fsdp_shard_grad_op",
        label="anchor: Lightning FSDPStrategy(SHARD_GRAD_OP)",
        make_strategy=fsdp_shard_grad_op,
    ),
    Contender(
        name="deepspeed_stage1",
        label="anchor: Lightning DeepSpeedStrategy(stage=1)",
        make_strategy=partial(deepspeed, 1),
    ),
    Contender(
        name="deepspeed_stage2",
        label="anchor: Lightning DeepSpeedStrategy(stage=2)",
        make_strategy=partial(deepspeed, 2),
    ),
    _ours_without_overlap(1),
    _ours_without_overlap(2),
    _FSDP2_CONTENDER,
    Contender(
        name="zero2_compiled",
        label="ours: ShardedOptimizerStrategy(stage=2), model compiled",
        make_strategy=partial(ShardedOptimizerStrategy, 2, start_method="fork"),
        make_module=compiled(),
        is_ours=True,
    ),
    Contender(
        name="ddp_compiled",
        label="anchor: Lightning DDPStrategy, model compiled",
        make_strategy=MeasuredDDPStrategy,
        make_module=compiled(),
    ),
    # What a typical script gets: one plain callback that overrides `on_train_batch_end` and reads nothing.
    *(with_user_callback(_ours(stage)) for stage in (1, 2, 3)),
    with_user_callback(_DDP_CONTENDER),
    with_user_callback(_FSDP2_CONTENDER),
)
"""Every configuration of the throughput part, in the order of the first repeat."""
PAIRS: tuple[tuple[str, str], ...] = (
    *((f"zero{stage}", anchor) for stage in (1, 2, 3) for anchor in (DDP, "ddp_zero_redundancy")),
    ("zero1", "deepspeed_stage1"),
    ("zero2", "fsdp_shard_grad_op"),
    ("zero2", "deepspeed_stage2"),
    ("zero3", "fsdp2"),
    ("zero2_compiled", "ddp_compiled"),
    ("zero1", "zero1_no_overlap"),
    ("zero2", "zero2_no_overlap"),
    *((f"zero{stage}_user_callback", f"{DDP}_user_callback") for stage in (1, 2, 3)),
    ("zero3_user_callback", "fsdp2_user_callback"),
    ("zero2_user_callback", "zero2"),
)
"""(ours, anchor) compared in the summary."""
SCALED: tuple[str, ...] = ("zero1", "zero2", "zero3", DDP)
"""Configurations of the scaling part."""
PLANNED = {"zero1": "zero1", "zero2": "zero2", "zero3": "zero3", DDP: "data_parallel"}
"""Our configuration -> the planner's name for it (Lightning's DDP holds and sends what ``data_parallel`` does)."""
PREDICTED_WORLD_SIZES: tuple[int, ...] = tuple(2**k for k in range(11))


@dataclass(frozen=True, kw_only=True)
class Config:
    workload: Workload
    """The throughput part."""
    scaling: Workload
    """The scaling part (12.7 M parameters: AdamW's state is the largest block per rank); ``devices`` is replaced."""
    world_sizes: tuple[int, ...] = (1, 2, 4)
    repeats: int = 3


PRESETS: dict[str, Config] = {
    "tiny": Config(
        workload=Workload(preset="tiny", steps=4, warmup_steps=2, batch_size=4, seq_len=32, time_throughput=False),
        scaling=Workload(preset="tiny", steps=2, warmup_steps=1, batch_size=2, seq_len=32, time_throughput=False),
        world_sizes=(1, 2),
        repeats=1,
    ),
    # The default (`make bench`): 20.5 M parameters, 2 CPU ranks of 8 x 128 tokens; a step takes ~1.5-3 s per rank.
    "medium": Config(
        # 10 steps, 4 of them warm-up: the first steps after the optimizer state appears run slower (allocator,
        # page faults); with 6 steps and 2 warm-up their ratios spread over 0.83-1.17.
        workload=Workload(preset="gpt-20m", steps=10, warmup_steps=4),
        scaling=Workload(
            preset="small",
            overrides={"n_layer": 4, "n_embd": 512},
            steps=3,
            warmup_steps=1,
            batch_size=2,
            time_throughput=False,  # bytes only
        ),
    ),
    "small": Config(
        workload=Workload(),
        scaling=Workload(
            preset="small",
            overrides={"n_layer": 4, "n_embd": 512},
            steps=3,
            warmup_steps=1,
            batch_size=2,
            time_throughput=False,  # bytes only
        ),
    ),
    "large": Config(  # GPUs, not run by us yet
        workload=Workload(preset="gpt-125m", steps=30, warmup_steps=5, seq_len=1024, accelerator="gpu"),
        scaling=Workload(
            preset="gpt-125m",
            steps=4,
            warmup_steps=2,
            batch_size=4,
            seq_len=1024,
            accelerator="gpu",
            time_throughput=False,
        ),
    ),
}


@dataclass
class ZeroResults:
    config: Config
    outcomes: dict[str, Outcome]
    comparisons: list[Comparison]
    scaling: dict[int, dict[str, Outcome]] = field(default_factory=dict)
    """World size -> configuration -> its one run."""
    predicted: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    """Configuration -> world size -> the planner's (bytes held by the largest rank, wire bytes of the busiest)."""

    def measured(self, name: str) -> dict[int, tuple[float, float]]:
        """World size -> measured (bytes held by the largest rank, wire bytes of the busiest rank per step)."""
        runs = {ws: outcomes[name].runs[0] for ws, outcomes in self.scaling.items()}
        return {ws: (float(run.max_held), run.wire or 0.0) for ws, run in runs.items()}

    def planner_agreement(self) -> float:
        """The largest relative difference between planner and measurement where both exist."""
        return max(
            abs(m - p) / max(abs(m), 1.0)
            for name in SCALED
            for ws, measured in self.measured(name).items()
            if ws in self.predicted[name]
            for m, p in zip(measured, self.predicted[name][ws], strict=True)
        )


def predict(workload: Workload, world_sizes: tuple[int, ...]) -> dict[str, dict[int, tuple[float, float]]]:
    """The planner's bytes held (largest rank) and wire bytes (busiest rank) per step for :data:`SCALED`."""
    model = GPTConfig.from_preset(workload.preset, **workload.overrides)
    predicted: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in SCALED}
    for ws in world_sizes:
        planned = plan(
            model,
            world_size=ws,
            batch_size=workload.batch_size,
            seq_len=workload.tokens_per_sequence,
            process_group_backend="gloo" if workload.accelerator == "cpu" else "nccl",
        )
        names = {c.name for c in planned.configurations}
        for name in SCALED:
            if PLANNED[name] in names:  # ZeRO is planned from two ranks on
                config = planned.configuration(PLANNED[name])
                predicted[name][ws] = (float(max(r.held for r in config.ranks)), config.wire_bytes(ws))
    return predicted


def measure(config: Config) -> ZeroResults:
    """Run the throughput part (interleaved repeats), then the scaling part (one run per world size)."""
    outcomes = run_interleaved(CONTENDERS, config.workload, repeats=config.repeats)
    results = ZeroResults(config, outcomes, [compare(outcomes[a], outcomes[b]) for a, b in PAIRS])
    scaled = [c for c in CONTENDERS if c.name in SCALED]
    for ws in config.world_sizes:
        results.scaling[ws] = run_interleaved(scaled, replace(config.scaling, devices=ws), repeats=1)
    results.predicted = predict(config.scaling, tuple(sorted({*config.world_sizes, *PREDICTED_WORLD_SIZES})))
    return results


def _scaling_table(results: ZeroResults) -> str:
    measured_sizes = results.config.world_sizes
    planned_sizes = [ws for ws in PREDICTED_WORLD_SIZES if ws not in measured_sizes]
    header = ["configuration", *(f"ws {ws}" for ws in measured_sizes), *(f"ws {ws} (planner)" for ws in planned_sizes)]
    rows = []
    for contender in (c for c in CONTENDERS if c.name in SCALED):
        values = {**results.predicted[contender.name], **results.measured(contender.name)}
        rows.append(
            [contender.label]
            + [f"{mib(values[ws][0])} / {mib(values[ws][1])}" if ws in values else "-" for ws in measured_sizes]
            + [f"{mib(values[ws][0], 1)} / {mib(values[ws][1], 1)}" if ws in values else "-" for ws in planned_sizes]
        )
    return markdown_table(header, rows)


def render(results: ZeroResults, *, command: str) -> str:
    cfg = results.config
    peaks = markdown_table(
        ["configuration", *(f"peak MiB/rank, ws {ws}" for ws in cfg.world_sizes)],
        [
            [c.label, *(mib(max(results.scaling[ws][c.name].runs[0].peak), 1) for ws in cfg.world_sizes)]
            for c in CONTENDERS
            if c.name in SCALED
        ],
    )
    return section(
        f"{NAME}: ShardedOptimizerStrategy (ZeRO 1/2/3) vs Lightning DDP, ZeroRedundancyOptimizer, FSDP, FSDP2,"
        " DeepSpeed",
        command=command,
        notes=[
            f"Throughput part: {cfg.workload.describe()}; {cfg.repeats} interleaved repeats.",
            *load_notes(results.outcomes.values()),
            f"Compiled pair: `module.model.compile(backend={compile_backend(cfg.workload)!r})` before the fit (on CPU"
            " `aot_eager`: dynamo and AOTAutograd without inductor's ~20 s C++ compile per graph); the warm-up steps"
            " hold the compilation.",
            "FSDP2 anchor: Lightning's `ModelParallelStrategy(tensor_parallel_size=1)` with `fully_shard` on each block"
            " and on the model in `configure_model`, created on the meta device like ours at stage 3. `overlap_param_"
            "gather=False` rows: ours waiting for the parameter all-gather at the end of the step; ours / that row is"
            " what the overlap with the next forward buys.",
            "Exposed communication: the monitor's `exposed_communication_s` (gradient sync and parameter gather waits"
            " outside compute, slowest rank, median over steps); `not measured` where the waits run inside autograd"
            " (DDP's reducer, FSDP) and cannot be timed from Python.",
            f"Scaling part: {cfg.scaling.describe().split(';')[0]}, {cfg.scaling.batch_size} x"
            f" {cfg.scaling.tokens_per_sequence} tokens per rank, once at world sizes"
            f" {', '.join(map(str, cfg.world_sizes))} (bytes only: the load there is no concern).",
            "Step time (slowest rank, steps after the warm-up) from fits without the monitor (a step clock callback"
            " only: the monitor's dispatch-mode tap costs FSDP2's collectives more than ours); from one more fit per"
            " configuration under `ParallelismMonitor` in every rank: exposed communication, bytes held from"
            " `memory_report()` (ours; the anchors' parameters, `.grad` and local optimizer state), peak"
            " memory (RSS on CPU: it includes torch and what the forked rank inherits), payload bytes per collective"
            " from the strategies' ledger (FSDP2's collectives through the monitor's `CollectiveTap`). Wire bytes: ring"
            " algorithms, all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the payload. Lightning's DDP"
            " all-reduces through the library's counting hook; ZeroRedundancyOptimizer's parameter broadcast is not"
            " counted (its wire bytes are a lower bound).",
            "DeepSpeed (an optional install) runs on CPU through `benchmarks/deepspeed_anchor.py`, which skips"
            " Lightning's CUDA-only checks; without it, or where a strategy refuses this machine (torch's FSDP1 needs"
            " an accelerator), the row says why.",
        ],
        blocks={
            "Ours / anchor": comparison_table(results.comparisons),
            f"Throughput part, world size {cfg.workload.devices}: medians over repeats": outcome_table(
                results.outcomes.values()
            ),
            "Scaling: MiB held by the largest rank / MiB on the wire per rank per step": (
                _scaling_table(results)
                + f"\n\nPlanner vs measurement, largest relative difference: {results.planner_agreement():.1e}."
                + "\n\n![scaling](figures/scaling.png)"
            ),
            "Peak memory per rank by world size": peaks,
        },
    )


def write_figures(results: ZeroResults, folder: Path) -> None:
    series = {c.label: (results.measured(c.name), results.predicted[c.name]) for c in CONTENDERS if c.name in SCALED}
    figures.scaling_chart(series, folder / "scaling.png")


if __name__ == "__main__":
    from benchmarks.run_all import main

    sys.exit(main(["--only", NAME, *sys.argv[1:]]))
