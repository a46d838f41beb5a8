"""The project's main demo: train the demo GPT with every strategy on CPU processes and print one row per strategy.

Run it as ``python -m lightning_parallel.demos.main`` (``make demo``). Each strategy trains the same model, from the
same initial weights, on the Python standard library's source code for ``--steps`` optimizer steps on ``--devices``
CPU processes started with ``fork``, so that every run's numbers come back to this process. Every row trains the
same global batch (``batch_size x devices`` sequences, split over the row's data-parallel replicas: a 2-stage
pipeline on 2 processes is one replica and takes the whole global batch, and so is a pair of tensor-parallel ranks,
which read the same batch) for the same number of optimizer steps, so
the losses agree up to floating-point rounding. The table shows the training loss at the end, the throughput in
tokens per second (summed over processes, after a warm-up), the all-reduce payload per optimizer step, the bytes of
parameters + gradients + optimizer state each process holds (exact, from the strategy's ``memory_report()``), the
peak bytes of live tensors of each process over one step (exact) and, last, each process's peak RSS. A PNG beside
it plots every row's loss curve and the bytes per process.

A strategy is a row of :data:`STRATEGY_ROWS`: a CLI name, a table label, a function that builds a fresh strategy for
a number of processes and the number of data-parallel replicas it makes of them. A row that fails prints its error
in the table; the others still run and the program exits with status 1.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import textwrap
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy

from lightning_parallel.demos.data import TextDataModule
from lightning_parallel.demos.gpt import PRESETS
from lightning_parallel.demos.module import GPTLightningModule
from lightning_parallel.demos.report import DemoRecorder, Recording, read_recording, write_demo_figure
from lightning_parallel.demos.stats import RunStats, RunSummary, summarize
from lightning_parallel.strategies import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy

__all__ = [
    "STRATEGY_ROWS",
    "DemoConfig",
    "RowResult",
    "StrategyRow",
    "format_table",
    "main",
    "quiet_lightning",
    "run_demo",
    "table_notes",
    "train_once",
]

_MIB = 1024**2


@dataclass(frozen=True)
class StrategyRow:
    """One strategy of the demo table."""

    name: str
    """Name for ``--strategies``."""
    label: str
    """Text of the table's first column."""
    make_strategy: Callable[[int], Strategy]
    """Builds a fresh strategy for a number of processes (a Trainer takes ownership of its strategy, so every run
    needs a new one). Use ``start_method="fork"`` so the run's results come back to this process."""
    num_replicas: Callable[[int], int] = lambda devices: devices
    """Data-parallel replicas the strategy makes of a number of processes (each takes an equal part of the global
    batch); every process by default."""


def _pipeline_stages(devices: int) -> int:
    """The demo's pipeline depth: 2 stages when the processes split evenly into pairs, else 1."""
    return 2 if devices % 2 == 0 else 1


def _tensor_parallel_size(devices: int) -> int:
    """The demo's tensor-parallel degree: 2 when the processes split evenly into pairs, else 1 (plain ZeRO-3)."""
    return 2 if devices % 2 == 0 else 1


STRATEGY_ROWS: tuple[StrategyRow, ...] = (
    StrategyRow(
        "data_parallel",
        "data_parallel",
        # track_communication counts the fp32 all-reduce bytes, to compare with the compressed row below.
        lambda devices: DataParallelStrategy(start_method="fork", track_communication=True),
    ),
    StrategyRow(
        "data_parallel_fp16",
        "data_parallel + fp16 compression",
        lambda devices: DataParallelStrategy(start_method="fork", gradient_compression="fp16"),
    ),
    StrategyRow(
        "pipeline",
        "pipeline 1F1B",
        lambda devices: PipelineParallelStrategy(
            pipeline_parallel_size=_pipeline_stages(devices), start_method="fork", schedule="1F1B", num_microbatches=4
        ),
        num_replicas=lambda devices: devices // _pipeline_stages(devices),
    ),
    StrategyRow("zero1", "zero1 (optimizer state sharded)", lambda d: ShardedOptimizerStrategy(1, start_method="fork")),
    StrategyRow("zero2", "zero2 (+ gradients sharded)", lambda d: ShardedOptimizerStrategy(2, start_method="fork")),
    StrategyRow("zero3", "zero3 (+ parameters sharded)", lambda d: ShardedOptimizerStrategy(3, start_method="fork")),
    StrategyRow(
        "zero3_tp",
        # The layers of `GPT.tensor_parallel_plan()` split over pairs of processes, ZeRO-3 over the pairs (1 x 2 on 2).
        "zero3 x tensor parallel 2",
        lambda devices: ShardedOptimizerStrategy(
            3, tensor_parallel_size=_tensor_parallel_size(devices), start_method="fork"
        ),
        num_replicas=lambda devices: devices // _tensor_parallel_size(devices),
    ),
)
"""The strategies the demo compares, in table order. Later strategies add a row here."""


@dataclass(kw_only=True)
class DemoConfig:
    """What every row trains: the same model, data and number of steps."""

    preset: str = "small"
    """Model size, a key of :data:`~lightning_parallel.demos.gpt.PRESETS`."""
    steps: int = 20
    """Optimizer steps per strategy."""
    devices: int = 2
    """CPU processes per strategy."""
    warmup_steps: int = 3
    """Steps before throughput is measured."""
    batch_size: int = 8
    """Sequences per batch per process when every process is a data-parallel replica; the global batch of every row
    is ``batch_size * devices`` (see :attr:`global_batch_size`)."""
    seq_len: int = 128
    """Tokens per sequence; capped at the preset's ``block_size``."""
    max_bytes: int = 400_000
    """Bytes of the standard library's source to train on (the demo needs few)."""
    seed: int = 0
    """Seed of the initial weights and of the data split."""

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step, the same in every row."""
        return self.batch_size * self.devices


@dataclass
class RowResult:
    """Outcome of one row: its measured numbers, or the error that stopped it."""

    label: str
    """The row's table label."""
    summary: RunSummary | None = None
    """The :class:`~lightning_parallel.demos.stats.RunStats` numbers of a finished run."""
    recording: Recording | None = None
    """Per-step losses and per-rank state bytes of a finished run."""
    error: str | None = None
    """One line describing why the run failed."""


@contextmanager
def _restored_environ() -> Iterator[None]:
    """Lightning's fork launcher writes MASTER_PORT into this process's environment; undo it so that every run picks
    a fresh port."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def train_once(
    strategy: Strategy, config: DemoConfig, *, num_replicas: int | None = None, label: str = ""
) -> tuple[RunSummary, Recording]:
    """Train the demo model with ``strategy``; return what :class:`RunStats` and :class:`DemoRecorder` measured.

    Args:
        strategy: A fresh strategy; a fork or spawn start method brings the results back to this process.
        config: Model size, data and steps.
        num_replicas: Data-parallel replicas the strategy makes of ``config.devices`` processes; each loads
            ``config.global_batch_size // num_replicas`` sequences per step. ``None``: every process is a replica.
        label: Text of the progress line.
    """
    replicas = config.devices if num_replicas is None else num_replicas
    if replicas < 1 or config.global_batch_size % replicas:
        raise ValueError(
            f"The global batch of {config.global_batch_size} sequences does not split over `num_replicas={replicas}`"
            " data-parallel replicas; choose a batch size and number of devices it divides."
        )
    seq_len = min(config.seq_len, PRESETS[config.preset]["block_size"])
    torch.manual_seed(config.seed)
    model = GPTLightningModule(config.preset)
    datamodule = TextDataModule(
        seq_len=seq_len, batch_size=config.global_batch_size // replicas, max_bytes=config.max_bytes, seed=config.seed
    )
    datamodule.setup("fit")  # once here: forked processes inherit the loaded corpus
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=config.devices,
        strategy=strategy,
        max_steps=config.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,  # one bar per rank would interleave; DemoRecorder draws one line on rank 0
        callbacks=[RunStats(warmup_steps=config.warmup_steps), DemoRecorder(label, config.steps)],
    )
    with _restored_environ():
        trainer.fit(model, datamodule=datamodule)
    return summarize(trainer), read_recording(trainer)


def run_demo(rows: Sequence[StrategyRow], config: DemoConfig) -> list[RowResult]:
    """Train once per row, printing one line per row; a failing row records its error and the next row still runs."""
    results = []
    for row in rows:
        start = time.perf_counter()
        try:
            replicas = row.num_replicas(config.devices)
            summary, recording = train_once(
                row.make_strategy(config.devices), config, num_replicas=replicas, label=row.label
            )
        except Exception as error:  # one broken strategy must not hide the others' results
            print(f"\r{row.label:<34} FAILED", flush=True)
            traceback.print_exc()
            results.append(RowResult(row.label, error=_one_line(error)))
            continue
        elapsed = time.perf_counter() - start
        loss = recording.losses[-1] if recording.losses else math.nan
        print(f"\r{row.label:<34} {config.steps} steps in {elapsed:5.1f} s, loss {loss:.4f}", flush=True)
        results.append(RowResult(row.label, summary=summary, recording=recording))
    return results


def _one_line(error: BaseException) -> str:
    """The last non-empty line of an error's message (a forked rank's traceback ends with its real error)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return f"{type(error).__name__}: {text}"[:160]


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def format_table(results: Sequence[RowResult], *, devices: int) -> str:
    """The results as a plain-text table with ``|`` separated columns, one row per strategy.

    Columns: strategy, loss at the end, tokens/s, all-reduce MiB per optimizer step, then per rank the MiB of
    parameters + gradients + optimizer state it holds (exact, ``n/a`` for a strategy without ``memory_report()``),
    per rank the peak bytes of live tensors over one step and, last, per rank the peak RSS (MiB) of the process.
    """
    header = ["strategy", "loss", "tokens/s", "all-reduce MiB/step"]
    header += [f"state MiB rank{r}" for r in range(devices)] + [f"peak tensors MiB rank{r}" for r in range(devices)]
    header += [f"peak RSS MiB rank{r}" for r in range(devices)]
    lines = [header]
    for result in results:
        summary, recording = result.summary, result.recording
        if summary is None or recording is None:
            lines.append([result.label, f"FAILED: {result.error}"])
            continue
        comm = summary["comm_bytes_per_step"]
        state = recording.state_bytes
        states = ["n/a"] * devices if state is None else [_number(b / _MIB, 2) for b in state]
        tensors = [_number(m / _MIB, 2) for m in summary["peak_tensors"]]
        peaks = [_number(m / _MIB, 1) for m in summary["peak_mem"]]
        lines.append(
            [
                result.label,
                _number(summary["final_loss"], 4),
                _number(summary["tokens_per_s"], 0),
                _number(None if comm is None else comm / _MIB, 2),
                *states,
                *tensors,
                *peaks,
            ]
        )
    return _render(lines)


def table_notes(config: DemoConfig) -> str:
    """The lines printed under the table: what is equal across rows and what each memory column measures."""
    text = (
        f"Every row trains the same {config.global_batch_size} sequences per step for {config.steps} optimizer steps"
        " from the same weights, so the losses are equal up to floating-point rounding (the fp16 row also rounds its"
        " gradients to fp16 for the all-reduce). state MiB: parameters + gradients + optimizer state held by each"
        " process (exact, from the strategy's memory_report()). peak tensors MiB: the peak bytes of live tensors"
        " during one training step after the warm-up (exact: activations, gradients in flight and temporaries"
        " included). Peak RSS comes last: it includes the Python/torch runtime and memory the allocator keeps after"
        " freeing, which hide the differences between strategies at this size. The tensor-parallel row splits the"
        " blocks' layers over pairs of processes (the GPT's tensor_parallel_plan()); both of a pair compute the pair's"
        " whole batch, so at this size it peaks above ZeRO-3 alone."
    )
    return textwrap.fill(text, width=118)


def _render(lines: list[list[str]]) -> str:
    """Align ``lines`` (the header first) into columns; a two-cell line (a failed row) spans the numeric columns."""
    header = lines[0]
    complete = [line for line in lines if len(line) == len(header)]
    widths = [max(len(line[0]) for line in lines)]
    widths += [max(len(line[i]) for line in complete) for i in range(1, len(header))]
    rendered = []
    for line in lines:
        if len(line) != len(header):
            rendered.append(f"{line[0]:<{widths[0]}} | {line[1]}")
            continue
        cells = [f"{line[0]:<{widths[0]}}"] + [f"{cell:>{w}}" for cell, w in zip(line[1:], widths[1:], strict=True)]
        rendered.append(" | ".join(cells))
    rendered.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(rendered)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_parallel.demos.main",
        description="Train the demo GPT with each strategy on CPU processes and compare loss, speed and memory.",
    )
    names = [row.name for row in STRATEGY_ROWS]
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model size (default: small)")
    parser.add_argument("--steps", type=int, default=DemoConfig.steps, help="optimizer steps per strategy")
    parser.add_argument("--devices", type=int, default=DemoConfig.devices, help="CPU processes per strategy")
    parser.add_argument(
        "--strategies",
        default=",".join(names),
        help=f"comma-separated rows to run (default: all): {', '.join(names)}",
    )
    parser.add_argument(
        "--png",
        default="lightning_logs/demo.png",
        help="where to write the loss curves and memory bars ('' for none; default: lightning_logs/demo.png)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1.")
    if args.devices < 1:
        parser.error(f"--devices={args.devices} must be at least 1.")
    unknown = [name for name in args.strategies.split(",") if name not in names]
    if unknown:
        parser.error(f"unknown strategies {unknown}; valid names: {', '.join(names)}.")
    return args


def quiet_lightning() -> None:
    """Keep Lightning's start-up chatter and the CPU data-loading hint out of the demo's output."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # torch (2.13) logs, on every rank, that gathering a weight split by both FSDP2 and tensor parallelism
    # (`(_StridedShard(0), Shard(0))`) whole takes 2 all-gathers instead of one: the consolidated state dict that the
    # fork launcher brings back after the tensor-parallel row's fit. Once per fit, not per step.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for message in (".*does not have many workers.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo, print its table and write its PNG.

    Sets this process to one intra-op thread before forking (forking a process whose OpenMP pool has run is unsafe);
    the forked ranks choose their own thread count.

    Args:
        argv: Command-line arguments; ``None`` reads ``sys.argv``.

    Returns:
        0 if every strategy trained, 1 otherwise.
    """
    args = _parse_args(argv)
    wanted = args.strategies.split(",")
    rows = [row for row in STRATEGY_ROWS if row.name in wanted]
    config = DemoConfig(preset=args.preset, steps=args.steps, devices=args.devices)
    config.warmup_steps = min(config.warmup_steps, max(0, config.steps - 1))
    torch.set_num_threads(1)
    quiet_lightning()
    print(
        f"{config.devices} CPU processes, preset {config.preset!r}, {config.steps} steps per strategy,"
        f" {config.global_batch_size} sequences per step:",
        flush=True,
    )
    results = run_demo(rows, config)
    print()
    print(format_table(results, devices=config.devices))
    print(table_notes(config))
    finished = [(r.label, r.recording) for r in results if r.recording is not None]
    if args.png and finished:
        if write_demo_figure(finished, args.png):
            print(f"Loss curves and memory per process: {args.png}")
        else:
            print("No PNG: matplotlib is not installed (pip install 'lightning-parallel[plots]').")
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
