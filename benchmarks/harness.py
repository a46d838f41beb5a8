"""The one way every benchmark trains and measures: contenders, workloads, interleaved repeats, ratios.

A :class:`Contender` is a strategy (ours or an anchor) plus the LightningModule it trains; a :class:`Workload` is the
model size, world size, batch and number of steps. :func:`run_interleaved` trains every contender once per repeat,
in alternating order (forwards, then backwards), so that slow drift of a shared machine affects each side alike.
Throughput comes from fits that carry no monitor, only :class:`StepClock` (a clock at ``on_train_batch_start`` and
``on_train_batch_end`` on every rank, what a user's timing callback does): the monitor's dispatch-mode tap costs
FSDP2's collectives more than ours (+14-24 ms on a ~70 ms ZeRO-3 step), so timing under it favoured us; and with
glibc's own allocator settings, as users run (:mod:`benchmarks.isolation`: the fixed mmap threshold the memory figures
need made every step ~25-30% slower, unevenly between sides). Everything
else, tokens, bytes held per rank, peak memory, bytes per collective, exposed communication, the pipeline's bubble
and timeline, comes from one more fit per contender under
:class:`~lightning_parallel.monitor.ParallelismMonitor` (its summary, which rank 0 writes as JSON, read back here),
so ours and the anchors are measured by the same code. Every fit also records the machine's
1-minute load average before and after it (:attr:`Run.load`), so a run disturbed by other work is visible. Every fit
(and every raw loop) runs in a process of its own forked from a fresh interpreter (:mod:`benchmarks.isolation`), so
contenders are built from picklable parts: module-level functions and ``functools.partial``, no lambdas. An anchor
that raises (not installed, refuses the CPU) is kept with the reason as :attr:`Outcome.unavailable`; one of ours that
raises fails the benchmark.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy

from benchmarks.isolation import in_fresh_process, one_line
from lightning_parallel.accounting import ring_wire_bytes
from lightning_parallel.demos import GPTLightningModule, TextDataModule
from lightning_parallel.demos.gpt import PRESETS as GPT_PRESETS
from lightning_parallel.demos.gpt import GPTConfig, num_parameters
from lightning_parallel.demos.main import _restored_environ  # Lightning's launchers write MASTER_PORT here
from lightning_parallel.monitor import ParallelismMonitor
from lightning_parallel.monitor.report import steady_communication

__all__ = [
    "Comparison",
    "Contender",
    "Outcome",
    "PairedConfig",
    "PairedResults",
    "Run",
    "StepClock",
    "UserTimingCallback",
    "Workload",
    "compare",
    "compile_backend",
    "compiled",
    "measure_pairs",
    "module_of",
    "monitored_fit",
    "one_line",
    "run_interleaved",
    "train",
    "user_callbacks",
    "with_user_callback",
]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one fit trains: the demo GPT on the demo corpus with AdamW in fp32."""

    preset: str = "small"
    """Model size, a key of :data:`~lightning_parallel.demos.gpt.PRESETS`."""
    overrides: dict[str, int] = field(default_factory=dict)
    """``GPTConfig`` fields that replace the preset's (``n_layer``, ``n_embd``, ``vocab_size``, ...)."""
    devices: int = 2
    """Processes (world size), one per CPU process or GPU."""
    batch_size: int = 8
    """Sequences per batch of one data-parallel replica (a pipeline takes the whole batch)."""
    seq_len: int = 128
    """Tokens per sequence (at most the preset's ``block_size``)."""
    steps: int = 15
    """Optimizer steps per fit."""
    warmup_steps: int = 3
    """Steps left out of every figure."""
    accelerator: str = "cpu"
    """``"cpu"`` (gloo) or ``"gpu"`` (NCCL, one process per GPU)."""
    time_throughput: bool = True
    """Time each repeat in a fit without the monitor (:func:`train`); ``False``: every repeat is one fit under the
    monitor, its step times included (runs read for bytes only: the ZeRO scaling part, the test suite's presets)."""

    def __post_init__(self) -> None:
        GPTConfig.from_preset(self.preset, **self.overrides)  # raises for an unknown preset or field
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"`warmup_steps={self.warmup_steps}` must be in [0, steps={self.steps}).")

    @property
    def tokens_per_sequence(self) -> int:
        return min(self.seq_len, GPT_PRESETS[self.preset]["block_size"])

    def describe(self) -> str:
        """One sentence for RESULTS.md."""
        params = num_parameters(GPTConfig.from_preset(self.preset, **self.overrides))
        shape = "".join(f", {k}={v}" for k, v in self.overrides.items())
        backend = "gloo" if self.accelerator == "cpu" else "NCCL"
        return (
            f"GPT `{self.preset}`{shape} ({params / 1e6:.2f} M parameters), AdamW, fp32; {self.devices}"
            f" {self.accelerator.upper()} processes (fork, {backend}); {self.batch_size} x {self.tokens_per_sequence}"
            f" tokens per replica per step; {self.steps} steps of which {self.warmup_steps} warm-up"
        )


def _gpt(workload: Workload) -> pl.LightningModule:
    return GPTLightningModule(workload.preset, **workload.overrides)


class UserTimingCallback(pl.Callback):
    """What almost every training script adds: a callback that overrides ``on_train_batch_end`` (here it times the
    step) and reads no parameter. Declares nothing (no ``reads_parameters``)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.seconds: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self.started)


def user_callbacks() -> list[pl.Callback]:
    """One :class:`UserTimingCallback`."""
    return [UserTimingCallback()]


def with_user_callback(contender: Contender) -> Contender:
    """``contender`` training with a :class:`UserTimingCallback` too, named ``<name>_user_callback``."""
    return replace(
        contender,
        name=f"{contender.name}_user_callback",
        label=f"{contender.label}, with a user callback",
        make_callbacks=user_callbacks,
    )


def compile_backend(workload: Workload) -> str:
    """``torch.compile``'s backend for ``workload``: ``inductor`` on GPUs; ``aot_eager`` on CPU, where inductor's C++
    compile costs ~20 s per graph on our 2-core machine (tests/test_compile.py), several graphs per fit (DDP splits the
    graph at its buckets) in every repeat. ``aot_eager`` runs dynamo and AOTAutograd (what changes how gradients are
    produced and when the strategies' hooks fire) without inductor's kernels."""
    return "inductor" if workload.accelerator == "gpu" else "aot_eager"


def compiled(
    make_module: Callable[[Workload], pl.LightningModule] = _gpt,
) -> Callable[[Workload], pl.LightningModule]:
    """``make_module`` with its ``model`` compiled in place (``nn.Module.compile`` with :func:`compile_backend`), as a
    user compiles under our strategies (tests/test_compile.py): parameter names and the hooks on them are unchanged."""

    return partial(_compiled_module, make_module)


def _compiled_module(make_module: Callable[[Workload], pl.LightningModule], workload: Workload) -> pl.LightningModule:
    module = make_module(workload)
    model = module.model
    assert isinstance(model, torch.nn.Module), f"{type(module).__name__}.model is not a module"
    model.compile(backend=compile_backend(workload))
    return module


def module_of(module_class: Callable[..., pl.LightningModule], workload: Workload) -> pl.LightningModule:
    """``module_class(workload.preset, **workload.overrides)``: with ``functools.partial``, a contender's
    ``make_module`` for a GPT LightningModule subclass that pickles (:mod:`benchmarks.isolation`)."""
    return module_class(workload.preset, **workload.overrides)


@dataclass(frozen=True, kw_only=True)
class Contender:
    """One side of a comparison."""

    name: str
    """Key in results and tables' pairs."""
    label: str
    """Text of the tables' first column."""
    make_strategy: Callable[[], Strategy] | None = None
    """A fresh strategy that starts its ranks with ``fork`` (a re-launch would re-run the benchmark); it must pickle
    (a class, a module-level function or a ``functools.partial`` of one)."""
    run: Callable[[Workload], Run] | None = None
    """Trains without a Trainer (a raw torch loop) and measures itself, instead of :func:`train`'s fit."""
    make_module: Callable[[Workload], pl.LightningModule] = _gpt
    """The LightningModule (it chooses the optimizer)."""
    empty_init: bool = False
    """Create the model under ``trainer.init_module(empty_init=True)`` (how a user gets ZeRO-3's memory benefit)."""
    is_ours: bool = False
    """Ours must run; an anchor that raises is reported as not available."""
    make_callbacks: Callable[[], list[pl.Callback]] = list
    """The user's callbacks beside the benchmark's monitor (:func:`with_user_callback`)."""


@dataclass
class Run:
    """One fit, as the monitor measured it (steps after the warm-up)."""

    step_s: list[float]
    """Per measured step: the slowest rank's step time (``on_train_batch_start`` to ``on_train_batch_end``), from a
    fit without the monitor (:func:`train`)."""
    tokens: int
    """Tokens of the global batch."""
    held: list[dict[str, int]]
    """Per rank: bytes of ``parameters``, ``gradients``, ``optimizer_state`` after the last step."""
    peak: list[int]
    """Per rank: peak memory (RSS on CPU, max allocated on CUDA)."""
    payload: list[dict[str, int]] | None = None
    """Per rank: payload bytes per collective of the last step; ``None``: not measured."""
    world_size: int = 1
    loss: float | None = None
    """Rank 0's last logged ``train_loss``."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """The monitor's per-rank records (steps after the warm-up), for bubble and timeline."""
    load: tuple[float, float] | None = None
    """The machine's 1-minute load average (``os.getloadavg()``) when the fit started and when it ended; it counts the
    fit's own ranks. Set by :func:`train`."""
    monitored_step_s: list[float] | None = None
    """The same step times in the fit under the monitor, whose figures this run carries (``None``: a raw loop that
    measures itself)."""
    cpu_s: list[float] | None = None
    """Per measured step of the fit timed without the monitor: the largest CPU seconds of a rank in the step's window
    (``time.process_time()``, every thread of the rank). Work done rather than time waited: what other work on a
    shared machine changes least. ``None``: not measured (a fit under the monitor)."""

    @property
    def cpu_per_step(self) -> float | None:
        """The median of :attr:`cpu_s` (``None``: not measured)."""
        return statistics.median(self.cpu_s) if self.cpu_s else None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / statistics.median(self.step_s)

    @property
    def exposed_s(self) -> float | None:
        """Median over measured steps of the slowest rank's exposed communication seconds (the monitor's
        ``exposed_communication_s``: gradient sync and parameter gather waits outside compute); ``None`` where the
        strategy's waits run inside autograd (DDP's reducer, FSDP) and the monitor cannot time them."""
        per_rank = [[s.get("exposed_communication_s") for s in rank["steps"]] for rank in self.ranks]
        if not per_rank or not per_rank[0] or any(v is None for values in per_rank for v in values):
            return None
        return statistics.median(max(step) for step in zip(*per_rank, strict=True))

    @property
    def max_held(self) -> int:
        return max(sum(rank.values()) for rank in self.held)

    @property
    def max_peak(self) -> int:
        return max(self.peak)

    @property
    def wire(self) -> float | None:
        """Bytes the busiest rank puts on the wire per step under ring algorithms (``None``: not measured)."""
        if self.payload is None:
            return None
        return max(sum(ring_wire_bytes(k, v, self.world_size) for k, v in rank.items()) for rank in self.payload)

    @classmethod
    def from_summary(cls, summary: dict[str, Any], *, warmup_steps: int, loss: Any = None) -> Run:
        """Build from :attr:`ParallelismMonitor.summary` (the JSON rank 0 wrote)."""
        ranks = [{**rank, "steps": rank["steps"][warmup_steps:]} for rank in summary["ranks"]]
        step_s = [max(steps) for steps in zip(*([s["step_time_s"] for s in r["steps"]] for r in ranks), strict=True)]
        payload = [steady_communication(rank) for rank in ranks]
        return cls(
            step_s=step_s,
            tokens=ranks[0]["steps"][0]["tokens"],
            held=[rank["memory"] for rank in ranks],
            peak=[rank["peak_memory_bytes"] for rank in ranks],
            payload=None if None in payload else payload,  # type: ignore[arg-type]
            world_size=summary["world_size"],
            loss=None if loss is None else float(loss),
            ranks=ranks,
        )


class StepClock(UserTimingCallback):
    """Every rank's step times (``on_train_batch_start`` to ``on_train_batch_end``, the monitor's window) and CPU
    seconds in the same window (``time.process_time()``: every thread of the rank), written to
    ``folder/steps-rank<r>.json`` at the end of the fit; nothing else (no dispatch mode, no collective)."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.cpu_started = 0.0
        self.cpu_seconds: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.cpu_started = time.process_time()
        super().on_train_batch_start(*args)

    def on_train_batch_end(self, *args: Any) -> None:
        super().on_train_batch_end(*args)
        self.cpu_seconds.append(time.process_time() - self.cpu_started)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {"wall": self.seconds, "cpu": self.cpu_seconds}
        Path(self.folder, f"steps-rank{trainer.global_rank}.json").write_text(json.dumps(record))

    @staticmethod
    def slowest_rank(folder: str, world_size: int, warmup_steps: int, *, clock: str = "wall") -> list[float]:
        """Per step after the warm-up, the largest of the ranks' seconds on ``clock`` (``"wall"`` or ``"cpu"``)."""
        ranks = [json.loads(Path(folder, f"steps-rank{r}.json").read_text())[clock] for r in range(world_size)]
        return [max(step) for step in zip(*(rank[warmup_steps:] for rank in ranks), strict=True)]


def train(contender: Contender, workload: Workload, *, figures: Run | None = None) -> Run:
    """Fit the demo model with ``contender`` and time it without the monitor (glibc's own allocator settings, as a user
    runs); the other figures come from
    ``figures`` (an earlier run of the same contender and workload) or, when ``None``, from one more fit under a
    :class:`ParallelismMonitor` first (:func:`monitored_fit`). A contender with its own ``run`` (a raw loop) measures
    itself. The run records the machine's 1-minute load average at the start and the end of the timed fit."""
    if contender.run is not None:
        if figures is None:  # its memory figures, from a run with glibc's mmap threshold fixed (`isolation.py`)
            figures = in_fresh_process(contender.run, workload)
        start = os.getloadavg()[0]
        timed = in_fresh_process(contender.run, workload, release_freed_memory=False)
        return replace(figures, step_s=timed.step_s, cpu_s=timed.cpu_s, load=(start, os.getloadavg()[0]))
    if not workload.time_throughput:
        return monitored_fit(contender, workload)
    if figures is None:
        figures = monitored_fit(contender, workload)
    start = os.getloadavg()[0]
    timed = _fit(contender, workload, monitored=False)
    return replace(figures, step_s=timed.step_s, cpu_s=timed.cpu_s, load=(start, os.getloadavg()[0]))


def monitored_fit(contender: Contender, workload: Workload) -> Run:
    """One fit under a :class:`ParallelismMonitor`: what it measured (its step times are timed under it), with the
    load average at the start and the end. For figures only the monitor gives (bubble, timeline), not throughput."""
    start = os.getloadavg()[0]
    run = _fit(contender, workload, monitored=True)
    run.load = (start, os.getloadavg()[0])
    run.monitored_step_s = run.step_s
    return run


def _fit(contender: Contender, workload: Workload, *, monitored: bool) -> Run:
    """One fit in a process of its own (:func:`~benchmarks.isolation.in_fresh_process`): forked from a fresh
    interpreter, never from this long-lived one, which has run every fit before it."""
    assert contender.make_strategy is not None, f"{contender.name} has neither `make_strategy` nor `run`"
    # Timed fits run with glibc's own allocator settings, as users' do; monitored ones measure RSS (`isolation.py`).
    return in_fresh_process(_fit_here, contender, workload, monitored=monitored, release_freed_memory=monitored)


def _fit_here(contender: Contender, workload: Workload, *, monitored: bool) -> Run:
    assert contender.make_strategy is not None
    torch.manual_seed(0)
    data = TextDataModule(seq_len=workload.tokens_per_sequence, batch_size=workload.batch_size, max_bytes=400_000)
    data.setup("fit")  # once here: the forked ranks inherit the corpus
    with tempfile.TemporaryDirectory(prefix="lp-bench-") as folder:
        summary_path = Path(folder, "monitor.json")
        measure = ParallelismMonitor(figure_path=False, summary_path=summary_path) if monitored else StepClock(folder)
        trainer = pl.Trainer(
            accelerator=workload.accelerator,
            devices=workload.devices,
            strategy=contender.make_strategy(),
            max_steps=workload.steps,
            callbacks=[measure, *contender.make_callbacks()],
            default_root_dir=folder,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
        )
        # At world size 1 ZeRO-3 trains unsharded and cannot take a meta-device model: create it normally there.
        empty_init = contender.empty_init and workload.devices > 1
        with trainer.init_module(empty_init=True) if empty_init else nullcontext():
            model = contender.make_module(workload)
        with _restored_environ():
            trainer.fit(model, datamodule=data)
        if not monitored:
            step_s, cpu_s = (
                StepClock.slowest_rank(folder, workload.devices, workload.warmup_steps, clock=clock)
                for clock in ("wall", "cpu")
            )
            return Run(step_s=step_s, tokens=0, held=[], peak=[], world_size=workload.devices, cpu_s=cpu_s)
        summary = json.loads(summary_path.read_text())
    return Run.from_summary(
        summary, warmup_steps=workload.warmup_steps, loss=trainer.callback_metrics.get("train_loss")
    )


@dataclass
class Outcome:
    """Every repeat of one contender, or why it could not run."""

    contender: Contender
    runs: list[Run] = field(default_factory=list)
    unavailable: str | None = None
    """Why the anchor did not run (its error, one line)."""

    def median(self, metric: Callable[[Run], float | None]) -> float | None:
        values = [metric(run) for run in self.runs]
        return None if not values or None in values else statistics.median(values)  # type: ignore[type-var]

    @property
    def loads(self) -> list[float]:
        """The 1-minute load averages recorded at the start and end of every run."""
        return [value for run in self.runs if run.load is not None for value in run.load]


def run_interleaved(
    contenders: Sequence[Contender],
    workload: Workload,
    *,
    repeats: int,
    train_fn: Callable[..., Run] = train,
) -> dict[str, Outcome]:
    """Train every contender ``repeats`` times in alternating order; returns name -> outcome. Each repeat is timed
    without the monitor; a contender's first repeat also fits once under it, whose figures the others reuse
    (``train_fn(contender, workload, figures=...)``).

    Raises:
        RuntimeError: If one of ours failed (its error is chained).
    """
    if repeats < 1:
        raise ValueError(f"`repeats={repeats}` must be at least 1.")
    outcomes = {c.name: Outcome(c) for c in contenders}
    for repeat in range(repeats):
        for contender in contenders if repeat % 2 == 0 else contenders[::-1]:
            outcome = outcomes[contender.name]
            if outcome.unavailable is not None:
                continue
            start = time.monotonic()
            try:
                figures = outcome.runs[0] if outcome.runs else None
                outcome.runs.append(train_fn(contender, workload, figures=figures))
            except Exception as error:  # an anchor that cannot run here is a result, not a failure
                if contender.is_ours:
                    raise RuntimeError(f"{contender.label} failed: {one_line(error)}") from error
                outcome.unavailable = one_line(error)
            print(
                f"{contender.label}, {workload.devices} ranks, repeat {repeat + 1}/{repeats}:"
                f" {time.monotonic() - start:.1f} s",
                flush=True,
            )
    return outcomes


@dataclass
class Comparison:
    """Ours against one anchor: ratios ours / anchor (``None``: not measured on both sides)."""

    ours: str
    anchor: str
    throughput: list[float] = field(default_factory=list)
    """Tokens/s per repeat (the two ran back to back); > 1: ours faster."""
    cpu: list[float] = field(default_factory=list)
    """CPU seconds per step per repeat (:attr:`Run.cpu_s`); < 1: ours does less work per step. Empty where a side did
    not measure it."""
    held: float | None = None
    """Bytes of parameters + gradients + optimizer state on the largest rank; < 1: ours holds less."""
    peak: float | None = None
    """Peak memory of the largest rank; < 1: ours peaks lower."""
    wire: float | None = None
    """Bytes on the wire per step of the busiest rank; 1: the same traffic."""
    exposed_s: tuple[float | None, float | None] = (None, None)
    """Ours' and the anchor's exposed communication seconds per step (medians; ``None``: the monitor cannot time it),
    what explains much of a throughput ratio."""
    unavailable: str | None = None
    """Why the anchor did not run."""


def _ratio(ours: float | None, anchor: float | None) -> float | None:
    return None if ours is None or not anchor else ours / anchor


def compare(ours: Outcome, anchor: Outcome) -> Comparison:
    """Paired ratios of two outcomes of the same :func:`run_interleaved` call."""
    result = Comparison(ours.contender.label, anchor.contender.label, unavailable=anchor.unavailable)
    if anchor.unavailable is None:
        pairs = zip(ours.runs, anchor.runs, strict=True)
        result.throughput = [a.tokens_per_s / b.tokens_per_s for a, b in pairs]
        cpu = [(a.cpu_per_step, b.cpu_per_step) for a, b in zip(ours.runs, anchor.runs, strict=True)]
        result.cpu = [a / b for a, b in cpu if a is not None and b]
        for name in ("held", "peak", "wire"):
            metric = attrgetter("wire" if name == "wire" else f"max_{name}")
            setattr(result, name, _ratio(ours.median(metric), anchor.median(metric)))
        result.exposed_s = (ours.median(attrgetter("exposed_s")), anchor.median(attrgetter("exposed_s")))
    return result


@dataclass(frozen=True, kw_only=True)
class PairedConfig:
    """A benchmark whose contenders all train one workload, compared in pairs."""

    workload: Workload
    repeats: int = 3


@dataclass
class PairedResults:
    """What :func:`measure_pairs` measured."""

    config: PairedConfig
    outcomes: dict[str, Outcome]
    comparisons: list[Comparison]


def measure_pairs(
    contenders: Sequence[Contender], pairs: Sequence[tuple[str, str]], config: PairedConfig
) -> PairedResults:
    """:func:`run_interleaved` over ``contenders``, then :func:`compare` of each ``(ours, anchor)`` pair of names."""
    outcomes = run_interleaved(contenders, config.workload, repeats=config.repeats)
    return PairedResults(config, outcomes, [compare(outcomes[ours], outcomes[anchor]) for ours, anchor in pairs])
