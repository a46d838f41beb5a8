"""PipelineParallelStrategy against a raw ``torch.distributed.pipelining`` loop, with per-rank timelines.

Everything runs on processes started with ``fork`` (CPU and gloo; GPUs and NCCL with ``--preset large``), on the
demo GPT and the same split, batch and number of micro-batches on both sides:

* **Lightning overhead**: median step time of our strategy inside ``Trainer.fit`` against a hand-written loop that
  drives the same ``PipelineStage``/``Schedule1F1B`` with an AdamW step (no Lightning); throughput ratio, goal >= 0.95.
  Repeats alternate the order of the two.
* **Bubble**: the per-rank timeline of one training step (each stage's forward/backward of every micro-batch,
  recorded around torch's ``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``); the idle fraction of every
  rank over the step against theory ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B.
* **Activation memory**: the most micro-batches whose activations a rank holds at once (from the timeline) times the
  bytes autograd saves for one micro-batch of that rank's stage (measured with ``saved_tensors_hooks``): 1F1B vs GPipe.
* **Memory per rank**: parameter + AdamW state bytes per rank against DataParallelStrategy's full replica.
* **Picture**: ``benchmarks/figures/pipeline_timeline.png`` (matplotlib) and a Chrome trace
  ``benchmarks/figures/pipeline_timeline.json`` (open in ``chrome://tracing`` or https://ui.perfetto.dev).

Run it with ``python -m benchmarks.pipeline [--preset small|large|tiny] [--repeats N]`` or through
``python -m benchmarks.run_all``. It updates its section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from benchmarks.figures import save_timeline
from benchmarks.presets import configure_preset
from benchmarks.results import FIGURES_DIR, machine_description, markdown_table, today, update_section
from benchmarks.trainers import benchmark_trainer
from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import GPTLightningModule, TextDataModule, next_token_loss
from lightning_parallel.demos.gpt import PRESETS as GPT_PRESETS
from lightning_parallel.demos.main import quiet_lightning
from lightning_parallel.distributed.pipeline.partition import StageModule, StagePlan

__all__ = [
    "PRESETS",
    "BenchmarkConfig",
    "configure",
    "main",
    "measure",
    "render_markdown",
    "write_chrome_trace",
    "write_figures",
]

NAME = "pipeline"
"""This benchmark's section name in RESULTS.md."""
TIMELINE_PNG = "pipeline_timeline.png"
"""File name of the timeline figure in the figures folder."""
TIMELINE_TRACE = "pipeline_timeline.json"
"""File name of the Chrome trace in the figures folder."""
_MIB = 1024**2


@dataclass(kw_only=True)
class BenchmarkConfig:
    """What every run trains."""

    preset: str = "small"
    """Model size, a key of :data:`~lightning_parallel.demos.gpt.PRESETS`."""
    steps: int = 12
    """Optimizer steps per run."""
    warmup_steps: int = 4
    """Steps before step times are measured; the timeline is recorded for the first measured step."""
    pipeline_parallel_size: int = 2
    """Pipeline ranks (processes, one per CPU process or GPU)."""
    batch_size: int = 16
    """Sequences per batch."""
    seq_len: int = 128
    """Tokens per sequence; capped at the preset's ``block_size``."""
    num_microbatches: int = 4
    """Micro-batches of the overhead comparison."""
    bubble_microbatches: tuple[int, ...] = (2, 4, 8)
    """Micro-batch counts of the bubble measurement (GPipe, 1F1B)."""
    interleaved_microbatches: tuple[int, ...] = (4, 8)
    """Micro-batch counts for the interleaved schedules (2 virtual stages per rank; multiples of the ranks)."""
    repeats: int = 3
    """Runs per overhead configuration; medians are reported."""
    accelerator: str = "cpu"
    """Lightning accelerator: ``"cpu"`` (gloo) or ``"gpu"`` (NCCL, one process per GPU)."""

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * min(self.seq_len, GPT_PRESETS[self.preset]["block_size"])


PRESETS: dict[str, BenchmarkConfig] = {
    "tiny": BenchmarkConfig(
        preset="tiny",
        steps=6,
        warmup_steps=2,
        batch_size=8,
        seq_len=32,
        bubble_microbatches=(4,),
        interleaved_microbatches=(4,),
        repeats=1,
    ),
    "small": BenchmarkConfig(),
    "large": BenchmarkConfig(
        preset="gpt-125m", steps=20, warmup_steps=5, batch_size=16, seq_len=1024, accelerator="gpu"
    ),
}
"""Benchmark sizes for ``--preset``: ``tiny`` for tests, ``small`` for 2 CPU cores, ``large`` for 2 GPUs."""


def configure(preset: str, *, repeats: int | None = None, steps: int | None = None) -> BenchmarkConfig:
    """The configuration of ``preset`` with ``repeats`` and ``steps`` replaced where given (warm-up kept shorter)."""
    return configure_preset(PRESETS, preset, repeats=repeats, steps=steps)


# ------------------------------------------------------------------ instrumentation (benchmark only)
_RECORDING = [False]
_STEP = [0]
_EVENTS: list[tuple[str, int, int, float, float, int]] = []
_RECORDED_STEPS = 3
"""Training steps recorded per run after the warm-up; the bubble is their median."""


def _timed(original: Any, kind: str) -> Any:
    def timed(self: PipelineStage, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not _RECORDING[0]:
            return original(self, chunk_id, *args, **kwargs)
        start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across the processes of one machine
        try:
            return original(self, chunk_id, *args, **kwargs)
        finally:
            _EVENTS.append((kind, self.stage_index, int(chunk_id), start, time.perf_counter(), _STEP[0]))

    return timed


_CHUNK_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}
"""Full backward, or its input-gradient half in zero-bubble schedules (B); the weight-gradient half (W)."""


@contextmanager
def _chunk_timing() -> Iterator[None]:
    """Time ``PipelineStage``'s chunk methods while the benchmark runs (forked ranks inherit it), then restore them.

    Scoped, not at import: a permanent patch would shadow what other code (ParallelismMonitor) wraps on the base class.
    """
    patched = []
    for name, kind in _CHUNK_METHODS.items():
        patched.append((name, name in vars(PipelineStage), getattr(PipelineStage, name)))
        setattr(PipelineStage, name, _timed(getattr(PipelineStage, name), kind))
    try:
        yield
    finally:
        for name, was_own, original in patched:
            if was_own:
                setattr(PipelineStage, name, original)
            else:
                delattr(PipelineStage, name)


class _Recorder(Callback):
    """Per-rank step times, the timeline of the first measured step, and parameter/optimizer bytes, to a file."""

    def __init__(self, out_dir: str, warmup_steps: int) -> None:
        self.out_dir, self.warmup_steps = out_dir, warmup_steps
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _RECORDING[0] = self.warmup_steps <= batch_idx < self.warmup_steps + _RECORDED_STEPS
        _STEP[0] = batch_idx
        if batch_idx == 0:
            self.ends.append(time.perf_counter())
            self.cpu_ends.append(time.process_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _RECORDING[0] = False
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # as the raw loop does
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        result = {
            "rank": trainer.global_rank,
            "step_times": [b - a for a, b in itertools.pairwise(self.ends)][self.warmup_steps :],
            "cpu_times": [b - a for a, b in itertools.pairwise(self.cpu_ends)][self.warmup_steps :],
            "events": list(_EVENTS),
            "param_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters()),
            "optimizer_bytes": sum(
                v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            ),
            "starts": list(trainer.strategy.stage_plan.starts),
        }
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _datamodule(config: BenchmarkConfig) -> TextDataModule:
    seq_len = min(config.seq_len, GPT_PRESETS[config.preset]["block_size"])
    data = TextDataModule(seq_len=seq_len, batch_size=config.batch_size, max_bytes=400_000, shuffle=False)
    data.setup("fit")
    return data


def _lightning_run(config: BenchmarkConfig, schedule: str, num_microbatches: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="lp-bench-") as out_dir:
        pl.seed_everything(0, verbose=False)
        model = GPTLightningModule(config.preset)
        strategy = PipelineParallelStrategy(start_method="fork", schedule=schedule, num_microbatches=num_microbatches)
        trainer = benchmark_trainer(
            accelerator=config.accelerator,
            devices=config.pipeline_parallel_size,
            strategy=strategy,
            max_steps=config.steps,
            callbacks=[_Recorder(out_dir, config.warmup_steps)],
        )
        trainer.fit(model, datamodule=_datamodule(config))
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(config.pipeline_parallel_size)]


# ------------------------------------------------------------------ the anchor: torch.distributed.pipelining alone
def _raw_rank(rank: int, world_size: int, config: BenchmarkConfig, starts: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu") if config.accelerator == "cpu" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(str(Path(out_dir, "store")), world_size)
    backend = "gloo" if device.type == "cpu" else "nccl"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        pl.seed_everything(0, verbose=False)
        model = GPTLightningModule(config.preset)
        layers = model.pipeline_layers()
        plan = StagePlan(starts=tuple(starts), num_layers=len(layers), pipeline_parallel_size=world_size)
        stage_module = StageModule([layers[i] for i in plan.layers_of(rank)])
        stage = PipelineStage(stage_module.to(device), rank, world_size, device)
        schedule = Schedule1F1B(stage, config.num_microbatches, loss_fn=next_token_loss)
        optimizer = torch.optim.AdamW(stage_module.parameters(), lr=3e-4, betas=(0.9, 0.95))
        loader = _datamodule(config).train_dataloader()
        ends, cpu_ends = [time.perf_counter()], [time.process_time()]
        for step, (inputs, targets) in enumerate(loader):
            if step == config.steps:
                break
            if rank == 0:
                schedule.step(inputs.to(device))
            elif rank == world_size - 1:
                schedule.step(target=targets.to(device))
            else:
                schedule.step()
            optimizer.step()
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # GPU work is asynchronous: end the step's clock when it is done
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
        times = [b - a for a, b in itertools.pairwise(ends)][config.warmup_steps :]
        cpu = [b - a for a, b in itertools.pairwise(cpu_ends)][config.warmup_steps :]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"step_times": times, "cpu_times": cpu}))
    finally:
        dist.destroy_process_group()


def _raw_run(config: BenchmarkConfig, starts: list[int]) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="lp-bench-raw-") as out_dir:
        world_size = config.pipeline_parallel_size
        processes = [
            context.Process(target=_raw_rank, args=(rank, world_size, config, starts, out_dir))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(600)
        if any(process.exitcode != 0 for process in processes):
            raise RuntimeError(f"raw pipeline loop failed: exit codes {[p.exitcode for p in processes]}")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]


# ------------------------------------------------------------------ analysis
def first_step(ranks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' records restricted to the first recorded step."""
    step = min(e[5] for r in ranks for e in r["events"])
    return [{**r, "events": [e for e in r["events"] if e[5] == step]} for r in ranks]


def bubble_fraction(ranks: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """Idle fraction of each rank over each recorded step's span (first block start to last block end over all
    ranks): the median over steps of the mean over ranks, and of the worst rank."""
    means, worsts = [], []
    for step in sorted({e[5] for r in ranks for e in r["events"]}):
        events = [[e for e in r["events"] if e[5] == step] for r in ranks]
        span = max(e[4] for rank in events for e in rank) - min(e[3] for rank in events for e in rank)
        idle = [1.0 - sum(e[4] - e[3] for e in rank) / span for rank in events]
        means.append(statistics.mean(idle))
        worsts.append(max(idle))
    return statistics.median(means), statistics.median(worsts)


def peak_in_flight(rank: dict[str, Any]) -> int:
    """The most micro-batches whose forward ran and backward did not yet, on one rank."""
    in_flight = peak = 0
    for kind, *_ in sorted(rank["events"], key=lambda e: e[3]):
        in_flight += {"F": 1, "B": -1}.get(kind, 0)
        peak = max(peak, in_flight)
    return peak


def activation_bytes(config: BenchmarkConfig, starts: Sequence[int], num_microbatches: int) -> list[int]:
    """Bytes autograd saves for one micro-batch of each stage (parameters excluded), measured on one process."""
    pl.seed_everything(0, verbose=False)
    model = GPTLightningModule(config.preset)
    layers = model.pipeline_layers()
    plan = StagePlan(starts=tuple(starts), num_layers=len(layers), pipeline_parallel_size=len(starts))
    parameters = {p.data_ptr() for p in model.parameters()}
    seq_len = min(config.seq_len, GPT_PRESETS[config.preset]["block_size"])
    x: Any = torch.randint(256, (config.batch_size // num_microbatches, seq_len))
    result = []
    saved: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        if tensor.data_ptr() not in parameters:
            saved[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor

    for stage in range(plan.num_stages):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = StageModule([layers[i] for i in plan.layers_of(stage)])(x)
        x = x.detach().requires_grad_()
        result.append(sum(saved.values()))
    return result


# ------------------------------------------------------------------ pictures
def write_chrome_trace(ranks: Sequence[dict[str, Any]], path: Path) -> None:
    """The recorded step as a Chrome trace: one thread per rank, one slice per forward/backward block."""
    origin = min(e[3] for r in ranks for e in r["events"])
    events = [
        {
            "name": f"{kind}{chunk}",
            "cat": "forward" if kind == "F" else "backward",
            "ph": "X",
            "ts": (start - origin) * 1e6,
            "dur": (end - start) * 1e6,
            "pid": 0,
            "tid": r["rank"],
            "args": {"stage": stage, "microbatch": chunk},
        }
        for r in ranks
        for kind, stage, chunk, start, end, _step in r["events"]
    ]
    names = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r["rank"], "args": {"name": f"rank {r['rank']}"}}
        for r in ranks
    ]
    path.write_text(json.dumps({"traceEvents": names + events, "displayTimeUnit": "ms"}))


# ------------------------------------------------------------------ measure and report
@dataclass
class PipelineResults:
    """Everything :func:`measure` found."""

    config: BenchmarkConfig
    ours_step_s: list[float] = field(default_factory=list)
    raw_step_s: list[float] = field(default_factory=list)
    ours_best_s: list[float] = field(default_factory=list)
    raw_best_s: list[float] = field(default_factory=list)
    ours_cpu_s: list[float] = field(default_factory=list)
    """Per repeat: median over steps of the CPU seconds all ranks spent on a step (summed over ranks)."""
    raw_cpu_s: list[float] = field(default_factory=list)
    bubble: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    in_flight: dict[tuple[str, int], list[int]] = field(default_factory=list)  # type: ignore[assignment]
    timelines: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict)
    activation_bytes: dict[int, list[int]] = field(default_factory=dict)
    """Per micro-batch count: bytes autograd saves for one micro-batch of each stage."""
    param_bytes: list[int] = field(default_factory=list)
    optimizer_bytes: list[int] = field(default_factory=list)
    full_model_bytes: int = 0
    starts: list[int] = field(default_factory=list)


def measure(config: BenchmarkConfig) -> PipelineResults:
    """Run the overhead pairs (alternating order), then one timeline run per schedule and micro-batch count."""
    with _chunk_timing():
        return _measure(config)


def _measure(config: BenchmarkConfig) -> PipelineResults:
    results = PipelineResults(config, in_flight={})
    first = _lightning_run(config, "1F1B", config.num_microbatches)
    results.starts = first[0]["starts"]
    for repeat in range(config.repeats):
        order = ("ours", "raw") if repeat % 2 == 0 else ("raw", "ours")
        for side in order:
            if side == "ours":
                ranks = first if repeat == 0 else _lightning_run(config, "1F1B", config.num_microbatches)
                results.ours_step_s.append(statistics.median(ranks[0]["step_times"]))
                results.ours_best_s.append(min(ranks[0]["step_times"]))
                results.ours_cpu_s.append(_cpu_per_step(ranks))
                results.param_bytes = [r["param_bytes"] for r in ranks]
                results.optimizer_bytes = [r["optimizer_bytes"] for r in ranks]
            else:
                ranks = _raw_run(config, results.starts)
                results.raw_step_s.append(statistics.median(ranks[0]["step_times"]))
                results.raw_best_s.append(min(ranks[0]["step_times"]))
                results.raw_cpu_s.append(_cpu_per_step(ranks))
    # The timeline runs need only the warm-up and the recorded steps.
    timeline_config = replace(config, steps=min(config.steps, config.warmup_steps + _RECORDED_STEPS))
    for schedule, counts in (
        ("GPipe", config.bubble_microbatches),
        ("1F1B", config.bubble_microbatches),
        ("Interleaved1F1B", config.interleaved_microbatches),
        ("InterleavedZeroBubble", config.interleaved_microbatches),
    ):
        for m in counts:
            ranks = _lightning_run(timeline_config, schedule, m)
            results.timelines[(schedule, m)] = first_step(ranks)
            results.bubble[(schedule, m)] = bubble_fraction(ranks)
            results.in_flight[(schedule, m)] = [peak_in_flight(r) for r in first_step(ranks)]
    results.activation_bytes = {m: activation_bytes(config, results.starts, m) for m in config.bubble_microbatches}
    pl.seed_everything(0, verbose=False)
    results.full_model_bytes = sum(p.numel() * p.element_size() for p in GPTLightningModule(config.preset).parameters())
    return results


def write_figures(results: PipelineResults, figures_dir: Path) -> None:
    """Save the timeline of one step per schedule at the overhead's micro-batch count (PNG) and the 1F1B step as a
    Chrome trace, under ``figures_dir``."""
    m = results.config.num_microbatches
    pictured = [(f"{s}, m={mb}", results.timelines[(s, mb)]) for s, mb in results.timelines if mb == m]
    save_timeline(pictured, figures_dir / TIMELINE_PNG)
    write_chrome_trace(results.timelines[("1F1B", m)], figures_dir / TIMELINE_TRACE)


def _cpu_per_step(ranks: Sequence[dict[str, Any]]) -> float:
    """Median over steps of the CPU time of all ranks together: the work per step, insensitive to waiting and to
    other processes competing for the cores (unlike wall time)."""
    return statistics.median(sum(step) for step in zip(*(r["cpu_times"] for r in ranks), strict=True))


def _bubble_theory(schedule: str, p: int, m: int) -> float | None:
    """Idle share with equal blocks and free communication: ``(p - 1) / (v m + p - 1)`` with ``v`` stages per rank
    (v = 2 for the interleaved schedules); ``None`` for zero-bubble, whose ideal is about 0 but not closed-form."""
    if schedule == "InterleavedZeroBubble":
        return None
    v = 2 if schedule == "Interleaved1F1B" else 1
    return (p - 1) / (v * m + p - 1)


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:,.{digits}f}"


def render_markdown(results: PipelineResults, *, command: str) -> str:
    config = results.config
    p, m = config.pipeline_parallel_size, config.num_microbatches
    ratios = [raw / ours for ours, raw in zip(results.ours_step_s, results.raw_step_s, strict=True)]
    best_ratios = [raw / ours for ours, raw in zip(results.ours_best_s, results.raw_best_s, strict=True)]
    ratio, best_ratio = statistics.median(ratios), statistics.median(best_ratios)
    tokens = config.tokens_per_batch

    def row(label: str, median: list[float], best: list[float]) -> list[str]:
        step, fastest = statistics.median(median), statistics.median(best)
        return [label, _fmt(step), f"{tokens / step:,.0f}", _fmt(fastest), f"{tokens / fastest:,.0f}"]

    overhead = markdown_table(
        ["configuration", "median step (s)", "tokens/s", "fastest step (s)", "tokens/s (fastest step)"],
        [
            row("ours: PipelineParallelStrategy in Trainer.fit", results.ours_step_s, results.ours_best_s),
            row("anchor: raw torch.distributed.pipelining loop", results.raw_step_s, results.raw_best_s),
        ],
    )

    cpu_ratios = [raw / ours for ours, raw in zip(results.ours_cpu_s, results.raw_cpu_s, strict=True)]
    cpu_ratio = statistics.median(cpu_ratios)

    def verdict(value: float) -> str:
        return "met" if value >= 0.95 else "not met"

    def per_repeat(values: list[float]) -> str:
        return ", ".join(f"{r:.3f}" for r in values)

    ratio_line = (
        f"Throughput ours / raw (goal >= 0.95), by wall time of the median step: **{ratio:.3f}** ({verdict(ratio)};"
        f" per repeat {per_repeat(ratios)}), of the fastest step: **{best_ratio:.3f}** ({verdict(best_ratio)};"
        f" {per_repeat(best_ratios)}); by CPU time per step, all ranks: **{cpu_ratio:.3f}** ({verdict(cpu_ratio)};"
        f" {per_repeat(cpu_ratios)}; ours {statistics.median(results.ours_cpu_s):.3f} s, raw"
        f" {statistics.median(results.raw_cpu_s):.3f} s). Wall time moves with other work on a shared machine; CPU"
        " time measures the work each side does per step."
    )

    bubble_rows = []
    for (schedule, mb), (mean, worst) in results.bubble.items():
        theory = _bubble_theory(schedule, p, mb)
        peaks = results.in_flight[(schedule, mb)]
        act_cell = "-"  # interleaved: a rank holds two virtual stages of different sizes; see the in-flight count
        if mb in results.activation_bytes and not schedule.startswith("Interleaved"):
            act_cell = ", ".join(_fmt(peak * results.activation_bytes[mb][r] / _MIB, 1) for r, peak in enumerate(peaks))
        bubble_rows.append(
            [
                f"{schedule}, m={mb}",
                "-" if theory is None else _fmt(theory),
                _fmt(mean),
                _fmt(worst),
                ", ".join(map(str, peaks)),
                act_cell,
            ]
        )
    bubble = markdown_table(
        [
            "schedule",
            "bubble theory",
            "bubble measured (mean of ranks)",
            "worst rank",
            "peak in-flight micro-batches per rank (interleaved: stage x micro-batch pairs)",
            "peak activation MiB per rank",
        ],
        bubble_rows,
    )
    total = [a + b for a, b in zip(results.param_bytes, results.optimizer_bytes, strict=True)]
    dp_total = 3 * results.full_model_bytes  # parameters + AdamW's two moments, the whole model on every rank
    memory = markdown_table(
        ["rank", "parameter MiB", "AdamW state MiB", "total MiB", "DataParallelStrategy total MiB", "share"],
        [
            [
                str(r),
                _fmt(results.param_bytes[r] / _MIB, 2),
                _fmt(results.optimizer_bytes[r] / _MIB, 2),
                _fmt(total[r] / _MIB, 2),
                _fmt(dp_total / _MIB, 2),
                _fmt(total[r] / dp_total),
            ]
            for r in range(p)
        ],
    )
    return "\n".join(
        [
            f"## {NAME}: PipelineParallelStrategy vs a raw torch.distributed.pipelining loop",
            "",
            f"- Command: `{command}`",
            f"- Date: {today()}",
            f"- Machine: {machine_description()}",
            f"- Setup: GPT preset `{config.preset}`, {p} pipeline ranks ({config.accelerator.upper()} processes, fork,"
            f" {'gloo' if config.accelerator == 'cpu' else 'NCCL'}), batch"
            f" {config.batch_size} x {min(config.seq_len, GPT_PRESETS[config.preset]['block_size'])} tokens,"
            f" {config.steps} steps of which {config.warmup_steps} warm-up, split (first layer per stage)"
            f" {results.starts} by estimated compute; overhead pairs with 1F1B, m={m}, {config.repeats} repeats in"
            " alternating order.",
            "- Step time: median over the measured steps of rank 0 (data loading and optimizer step included on both"
            " sides). Bubble: idle share of each rank over a step's span (first block start to last block end"
            f" over all ranks), median over {_RECORDED_STEPS} steps. Activations: peak in-flight micro-batches x"
            " bytes autograd saves for one micro-batch (batch / m sequences) of the rank's stage.",
            "",
            overhead,
            "",
            ratio_line,
            "",
            bubble,
            "",
            memory,
            "",
            f"Timeline of one training step with m={m} ({', '.join(s for s, mb in results.timelines if mb == m)},"
            " top to bottom; one band per rank, rank 0 first; forward blue, backward green, weight gradients"
            f" yellow, idle white): `figures/{TIMELINE_PNG}`; the 1F1B step as a Chrome trace:"
            f" `figures/{TIMELINE_TRACE}` (open it in https://ui.perfetto.dev).",
            "",
            f"![pipeline timeline](figures/{TIMELINE_PNG})",
        ]
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS), help="benchmark size (default: small)")
    parser.add_argument("--repeats", type=int, default=None, help="overhead runs per side (default: the preset's)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the preset's)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, command: str | None = None) -> int:
    """Run the benchmark, write its section of ``benchmarks/RESULTS.md`` and the timeline picture and trace."""
    args = _parse_args(argv)
    config = configure(args.preset, repeats=args.repeats, steps=args.steps)
    if command is None:
        command = f"python -m benchmarks.pipeline --preset {args.preset} --repeats {config.repeats}"
    torch.set_num_threads(1)  # before forking: a forked child of a process whose OpenMP pool ran can hang
    quiet_lightning()
    results = measure(config)
    write_figures(results, FIGURES_DIR)
    section = render_markdown(results, command=command)
    print("\n" + section)
    update_section(NAME, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
