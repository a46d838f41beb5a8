"""DataParallelStrategy against its anchor, Lightning's own DDPStrategy, side by side in one run.

Both train the demo GPT on the same data with the same per-process batch, number of steps and world size, started
with ``fork``. Each repeat runs every configuration once, in alternating order (forwards, then backwards) so that
slow drift of the machine affects both sides alike; the table reports medians. Two more configurations of ours
measure the all-reduce payload per optimizer step: fp32 (counted with ``track_communication=True``) and
``gradient_compression="fp16"``, which should send exactly half the bytes.

Run it with ``python -m benchmarks.data_parallel [--preset small|large|tiny] [--repeats N]`` or through
``python -m benchmarks.run_all``. It updates its section of ``benchmarks/RESULTS.md``. The ``large`` preset trains
``gpt-125m`` on 2 GPUs (NCCL); it has not been run by us yet.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy

from benchmarks.presets import configure_preset
from benchmarks.results import machine_description, markdown_table, today, update_section
from benchmarks.trainers import benchmark_trainer
from lightning_parallel.demos.data import TextDataModule
from lightning_parallel.demos.gpt import PRESETS as GPT_PRESETS
from lightning_parallel.demos.gpt import num_parameters
from lightning_parallel.demos.main import DemoConfig, _restored_environ, quiet_lightning
from lightning_parallel.demos.module import GPTLightningModule
from lightning_parallel.demos.stats import RunStats, RunSummary, summarize
from lightning_parallel.strategies import DataParallelStrategy

__all__ = [
    "CONFIGS",
    "PRESETS",
    "BenchmarkConfig",
    "DataParallelResults",
    "configure",
    "main",
    "measure",
    "render_markdown",
]

_MIB = 1024**2
NAME = "data_parallel"
"""This benchmark's section name in RESULTS.md."""

OURS, ANCHOR, FP32_COUNTED, FP16 = "ours", "lightning_ddp", "ours_fp32_counted", "ours_fp16"

CONFIGS: dict[str, tuple[str, Callable[[], Strategy]]] = {
    OURS: ("ours: DataParallelStrategy", lambda: DataParallelStrategy(start_method="fork")),
    ANCHOR: ("anchor: Lightning DDPStrategy", lambda: DDPStrategy(start_method="fork")),
    FP32_COUNTED: (
        "ours, fp32 all-reduce counted",
        lambda: DataParallelStrategy(start_method="fork", track_communication=True),
    ),
    FP16: ("ours, fp16 compression", lambda: DataParallelStrategy(start_method="fork", gradient_compression="fp16")),
}
"""Configuration name -> (table label, strategy factory), in the order of the first repeat."""
BYTES_CONFIGS = (FP32_COUNTED, FP16)
"""Configurations that measure the all-reduce bytes per step; they run in the first repeat only."""


@dataclass(kw_only=True)
class BenchmarkConfig:
    """What every configuration trains."""

    preset: str = "small"
    """Model size, a key of :data:`~lightning_parallel.demos.gpt.PRESETS`."""
    steps: int = 20
    """Optimizer steps per run."""
    warmup_steps: int = 3
    """Steps before throughput is measured."""
    devices: int = 2
    """Processes (world size), one per CPU process or GPU."""
    batch_size: int = 8
    """Sequences per batch per process."""
    seq_len: int = 128
    """Tokens per sequence; capped at the preset's ``block_size``."""
    repeats: int = 3
    """Runs per configuration; medians are reported."""
    accelerator: str = "cpu"
    """Lightning accelerator: ``"cpu"`` (gloo) or ``"gpu"`` (NCCL, one process per GPU)."""

    def demo_config(self) -> DemoConfig:
        """The same settings in the demo's terms."""
        return DemoConfig(
            preset=self.preset,
            steps=self.steps,
            devices=self.devices,
            warmup_steps=self.warmup_steps,
            batch_size=self.batch_size,
            seq_len=min(self.seq_len, GPT_PRESETS[self.preset]["block_size"]),
        )


PRESETS: dict[str, BenchmarkConfig] = {
    "tiny": BenchmarkConfig(preset="tiny", steps=4, warmup_steps=2, batch_size=4, seq_len=32, repeats=1),
    "small": BenchmarkConfig(),
    "large": BenchmarkConfig(
        preset="gpt-125m", steps=30, warmup_steps=5, batch_size=8, seq_len=1024, accelerator="gpu"
    ),
}
"""Benchmark sizes for ``--preset``: ``tiny`` for tests, ``small`` for 2 CPU cores, ``large`` for 2 GPUs."""


def configure(preset: str, *, repeats: int | None = None, steps: int | None = None) -> BenchmarkConfig:
    """The configuration of ``preset`` with ``repeats`` and ``steps`` replaced where given (warm-up kept shorter)."""
    return configure_preset(PRESETS, preset, repeats=repeats, steps=steps)


def _train_once(strategy: Strategy, config: BenchmarkConfig) -> RunSummary:
    """Train the demo model once (as the demo's ``train_once`` does, on ``config.accelerator``)."""
    demo = config.demo_config()
    torch.manual_seed(demo.seed)
    model = GPTLightningModule(demo.preset)
    datamodule = TextDataModule(seq_len=demo.seq_len, batch_size=demo.batch_size, max_bytes=demo.max_bytes, seed=0)
    datamodule.setup("fit")  # once here: forked processes inherit the loaded corpus
    trainer = benchmark_trainer(
        accelerator=config.accelerator,
        devices=config.devices,
        strategy=strategy,
        max_steps=demo.steps,
        callbacks=[RunStats(warmup_steps=demo.warmup_steps)],
    )
    with _restored_environ():
        trainer.fit(model, datamodule=datamodule)
    return summarize(trainer)


@dataclass
class DataParallelResults:
    """Every run's numbers and the figures derived from them."""

    config: BenchmarkConfig
    """What was run."""
    runs: dict[str, list[RunSummary]] = field(default_factory=dict)
    """Configuration name -> one summary per repeat."""
    throughput_ratios: list[float] = field(default_factory=list)
    """Ours / anchor tokens per second of each repeat (the two ran back to back)."""
    throughput_ratio: float = float("nan")
    """Median of :attr:`throughput_ratios` (goal: >= 1.0)."""
    median_step_ratios: list[float] = field(default_factory=list)
    """Ours / anchor tokens per second from the median step time, per repeat (robust to other load on the machine)."""
    median_step_ratio: float = float("nan")
    """Median of :attr:`median_step_ratios` (goal: >= 1.0)."""
    fp32_bytes_per_step: float = float("nan")
    """All-reduce payload bytes per optimizer step on one rank without compression."""
    fp16_bytes_per_step: float = float("nan")
    """All-reduce payload bytes per optimizer step on one rank with fp16 compression."""
    bytes_ratio: float = float("nan")
    """fp16 / fp32 bytes per step (goal: 0.5)."""

    def median(self, name: str, key: str) -> float:
        """Median over repeats of a scalar field (``"tokens_per_s"``, ``"final_loss"``, ...) of config ``name``."""
        return statistics.median(float(run[key]) for run in self.runs[name])

    def median_peak_mem(self, name: str) -> list[float]:
        """Median over repeats of each rank's peak memory in bytes."""
        per_rank = zip(*(run["peak_mem"] for run in self.runs[name]), strict=True)
        return [statistics.median(values) for values in per_rank]


def measure(config: BenchmarkConfig) -> DataParallelResults:
    """Run every configuration ``config.repeats`` times, alternating the order, and derive the ratios.

    Call it with one intra-op thread in this process (``torch.set_num_threads(1)``): it forks the ranks.

    Raises:
        RuntimeError: If a run failed (the rank's error is chained).
    """
    if config.repeats < 1:
        raise ValueError(f"`repeats={config.repeats}` must be at least 1.")
    results = DataParallelResults(config=config, runs={name: [] for name in CONFIGS})
    for repeat in range(config.repeats):
        order = list(CONFIGS) if repeat % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            if repeat > 0 and name in BYTES_CONFIGS:
                continue  # their purpose, the bytes per step, is deterministic: one run each
            label, make_strategy = CONFIGS[name]
            print(f"\n=== repeat {repeat + 1}/{config.repeats}: {label} ===", flush=True)
            results.runs[name].append(_train_once(make_strategy(), config))
    results.throughput_ratios = _paired_ratios(results, "tokens_per_s")
    results.throughput_ratio = statistics.median(results.throughput_ratios)
    results.median_step_ratios = _paired_ratios(results, "tokens_per_s_median_step")
    results.median_step_ratio = statistics.median(results.median_step_ratios)
    results.fp32_bytes_per_step = _comm_bytes(results, FP32_COUNTED)
    results.fp16_bytes_per_step = _comm_bytes(results, FP16)
    results.bytes_ratio = results.fp16_bytes_per_step / results.fp32_bytes_per_step
    return results


def _paired_ratios(results: DataParallelResults, key: str) -> list[float]:
    """Ours / anchor of ``key`` for each repeat (in each repeat the two ran back to back)."""
    pairs = zip(results.runs[OURS], results.runs[ANCHOR], strict=True)
    return [float(ours[key]) / float(anchor[key]) for ours, anchor in pairs]


def _comm_bytes(results: DataParallelResults, name: str) -> float:
    values = {run["comm_bytes_per_step"] for run in results.runs[name]}
    if len(values) != 1 or None in values:
        raise RuntimeError(f"`{name}` counted different or no all-reduce bytes across repeats: {sorted(values)}.")
    return float(values.pop())


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None or value != value else f"{value:,.{digits}f}"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _config_rows(results: DataParallelResults) -> list[list[str]]:
    rows = []
    for name, (label, _) in CONFIGS.items():
        comm = results.runs[name][0]["comm_bytes_per_step"]
        rows.append(
            [
                label,
                _fmt(results.median(name, "tokens_per_s"), 0),
                _fmt(results.median(name, "tokens_per_s_median_step"), 0),
                _fmt(results.median(name, "final_loss"), 4),
                _fmt(None if comm is None else comm / _MIB, 3),
                *(_fmt(m / _MIB, 1) for m in results.median_peak_mem(name)),
            ]
        )
    return rows


def _ratio_rows(results: DataParallelResults) -> list[list[str]]:
    def per_repeat(ratios: list[float]) -> str:
        return ", ".join(f"{ratio:.3f}" for ratio in ratios)

    return [
        [
            "throughput ours / Lightning DDP, window wall time",
            f"{results.throughput_ratio:.3f}",
            per_repeat(results.throughput_ratios),
            ">= 1.0",
            _yes_no(results.throughput_ratio >= 1.0),
        ],
        [
            "throughput ours / Lightning DDP, median step time",
            f"{results.median_step_ratio:.3f}",
            per_repeat(results.median_step_ratios),
            ">= 1.0",
            _yes_no(results.median_step_ratio >= 1.0),
        ],
        [
            "all-reduce bytes per step, fp16 / fp32",
            f"{results.bytes_ratio:.4f}",
            "-",
            "0.5",
            _yes_no(results.bytes_ratio == 0.5),
        ],
    ]


def render_markdown(results: DataParallelResults, *, command: str) -> str:
    """The RESULTS.md section: command, date, machine, setup, a table of medians and the ratios against the goals."""
    cfg = results.config
    seq_len = cfg.demo_config().seq_len
    processes = (
        f"{cfg.devices} {cfg.accelerator.upper()} processes (fork, {'gloo' if cfg.accelerator == 'cpu' else 'NCCL'})"
    )
    header = ["configuration", "tokens/s", "tokens/s (median step)", "final loss", "all-reduce MiB/step"]
    header += [f"peak MiB rank{r}" for r in range(cfg.devices)]
    ratio_header = ["ratio", "median", "per repeat", "goal", "met"]
    return f"""## {NAME}: DataParallelStrategy vs Lightning's DDPStrategy

- Command: `{command}`
- Date: {today()}
- Machine: {machine_description()}
- Setup: GPT preset `{cfg.preset}` ({num_parameters(cfg.preset) / 1e6:.2f} M parameters), {processes},
  {cfg.batch_size} x {seq_len} tokens per process per step, {cfg.steps} steps of which
  {cfg.warmup_steps} warm-up, {cfg.repeats} repeats in alternating order; medians over repeats (the two
  byte-counting configurations run once: their bytes per step are deterministic).
- tokens/s: summed over processes, over the wall time of the measured steps; "median step" divides one step's tokens
  by the median step time instead, which ignores steps slowed down by other work on the machine. Peak memory: each
  process's peak RSS during `fit`. All-reduce payload per step on one rank: fp32
  {results.fp32_bytes_per_step:,.0f} B, fp16 {results.fp16_bytes_per_step:,.0f} B.

{markdown_table(header, _config_rows(results))}

{markdown_table(ratio_header, _ratio_rows(results))}
"""


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS), help="benchmark size (default: small)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per configuration (default: the preset's)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the preset's)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, command: str | None = None) -> int:
    """Run the benchmark, print its section and write it into ``benchmarks/RESULTS.md``.

    Args:
        argv: Command-line arguments; ``None`` reads ``sys.argv``.
        command: The command to record in RESULTS.md; defaults to this module's command with ``argv``.

    Returns:
        0 once the results are written (whether or not they meet their goals: the table says so); a failed run
        raises instead.
    """
    args = _parse_args(argv)
    config = configure(args.preset, repeats=args.repeats, steps=args.steps)
    if command is None:
        command = f"python -m benchmarks.data_parallel --preset {args.preset} --repeats {config.repeats}"
        command += "" if args.steps is None else f" --steps {args.steps}"
    torch.set_num_threads(1)  # before forking: a forked child of a process whose OpenMP pool ran can hang
    quiet_lightning()
    results = measure(config)
    section = render_markdown(results, command=command)
    print("\n" + section)
    update_section(NAME, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
