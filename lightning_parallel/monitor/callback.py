"""ParallelismMonitor: throughput, step-time split, bytes held and bytes communicated per rank, as a callback."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_parallel.accounting import (
    BatchSizeFn,
    CommunicationStats,
    LiveTensorPeak,
    PeakMemory,
    dataset_tensors,
    default_batch_size,
    default_length,
    module_memory_report,
    optimizer_state_tensors,
    peak_memory_bytes,
)
from lightning_parallel.instrumentation import (
    Clock,
    Instrumentation,
    InstrumentedStrategy,
    ReportsGradientTensors,
    WallClock,
)
from lightning_parallel.lightning_optimizer import unwrap_optimizer
from lightning_parallel.monitor.figure import write_figure
from lightning_parallel.monitor.ledger import CollectiveTap, PhaseTimes
from lightning_parallel.monitor.report import format_table
from lightning_parallel.monitor.timing import PendingSteps, StepStamps, clock_for

__all__ = ["ParallelismMonitor", "StepRecord"]

NOT_MEASURED = "not measured"


@dataclass
class StepRecord:
    """What one rank measured in one training batch."""

    step: int
    """``trainer.global_step`` before the batch."""
    step_time_s: float
    """Time from ``on_train_batch_start`` to ``on_train_batch_end``: on the host's clock on CPU, on the current
    CUDA stream on a GPU (the work queued between the two, as the device ran it)."""
    samples: int
    """Samples of the global batch (local batch size x data-parallel replicas)."""
    tokens: int
    """Tokens of the global batch (0 when the inputs have no sequence dim)."""
    communication: dict[str, int] | None
    """Bytes per collective in this batch (see ``monitor/ledger.py``); ``None``: not measured."""
    exposed_communication_s: float | None
    """Seconds blocked in gradient sync / parameter gathering after backward; ``None``: not measurable."""
    pipeline_idle_s: float | None
    """Seconds of the pipeline schedule this rank's stages were not computing; ``None``: not a pipeline."""
    compute_s: float
    """The rest of the step: ``step_time_s`` minus what is measured above."""
    bubble_fraction: float | None = None
    """Pipeline: ``idle / schedule time`` of this step on this rank."""
    timeline: list[tuple[str, int, float, float]] = field(default_factory=list)
    """Pipeline: ``(kind, stage, start, end)`` chunks of this step, seconds from the step's start."""


@dataclass(frozen=True)
class _StepFacts:
    """What the host knows of a step when it ends; its seconds come later (:class:`~.timing.PendingSteps`)."""

    step: int
    samples: int
    tokens: int
    communication: dict[str, int] | None


class ParallelismMonitor(Callback):
    """Measure what a parallel training run really does, per step and per rank, and summarise it at the end of fit.

    * per step: throughput (samples/s, tokens/s when the batch has a sequence dim) and the step time split into
      compute, exposed communication (ZeRO-1/2 gradient sync and parameter all-gather, pipeline replicas'
      all-reduce) and pipeline idle. Where a phase cannot be seen (DDP's and FSDP2's waits run inside autograd) it
      is reported as ``None`` / "not measured" and counted in compute.
    * per rank: bytes of parameters, gradients and optimizer state really held (from tensor storages, the
      strategy's ``memory_report()`` where it has one) and the peak process memory (RSS on CPU, max allocated on CUDA).
    * communication: bytes per step by collective type (all-reduce, reduce-scatter, all-gather, send, recv), as
      defined in :mod:`lightning_parallel.monitor.ledger`, measured from the calls our strategies make. Under other
      strategies (Lightning's ``DDPStrategy``, ...) it is "not measured". FSDP2's collectives (ZeRO-3) are counted by
      a dispatch mode around FSDP2's pre-forward hooks and over backward, a Python call per op there: its cost is
      part of ZeRO-3's step times.
    * pipeline: the bubble fraction per rank (time not spent in its stages' forward/backward chunks over the
      schedule's time) and a timeline of the last step.

    Metrics go to every ``trainer.loggers`` entry (``monitor/...``) from global rank 0 every ``log_every_n_steps``.
    At the end of fit rank 0 prints a table, writes the summary of all ranks as JSON and a PNG figure (per-rank
    memory bars, throughput over steps, pipeline timeline; needs matplotlib, the ``plots`` extra, else skipped with
    a message). Attaching the monitor switches on the strategy's communication counting before the model is
    wrapped and subscribes to the strategy's timed phases (``lightning_parallel.instrumentation``); without a
    monitor nothing is counted or timed.

    Times come from the host's clock on CPU and from CUDA events on the current stream on a GPU (where the host's
    clock would time kernel launches and NCCL's non-blocking waits), read once the device has passed them, at the
    latest one step later: the monitor never synchronizes the device per step (:mod:`.timing`). So on a GPU a step's
    record (and its log line) appears at the end of the next step, and the last ones at the end of training.

    Args:
        figure_path: where to write the PNG; ``None``: ``parallelism_monitor.png`` in the first logger's
            ``log_dir`` (or ``trainer.default_root_dir``). ``False``: no figure.
        summary_path: where to write the JSON summary; ``None``: next to the figure, ``parallelism_monitor.json``.
        log_every_n_steps: log the per-step metrics every this many steps.
        batch_size_fn: ``fn(batch) -> int``, the samples of one local batch; ``None``: dim 0 of the batch's input
            tensor (:func:`~lightning_parallel.accounting.default_batch_size`). As Lightning's ``ThroughputMonitor``.
        length_fn: ``fn(batch) -> int``, the tokens of one local batch (0: no tokens/s); ``None``: the elements of
            the input tensor when it is at least 2-D (:func:`~lightning_parallel.accounting.default_length`).
        peak_tensors_step: a training step (``trainer.global_step`` when it starts, e.g. ``2``: after the optimizer
            state exists) whose peak bytes of live tensors each rank measures exactly with
            :class:`~lightning_parallel.accounting.LiveTensorPeak`, independent of the C allocator: the peak, the
            phase it happened in (``forward``, ``backward``, ``optimizer_step``; a pipeline's forward and backward
            both run in ``forward``, inside its schedule) and what held it then (``parameters``, ``gradients``,
            ``optimizer_state``, ``other``: activations, autograd's saved tensors, temporaries and communication
            buffers such as ZeRO-2's full gradient buckets in flight). The training data set's own tensors are left out
            (a GPU run keeps them on the host: :func:`~lightning_parallel.accounting.dataset_tensors`). In the summary
            as ``peak_tensors`` per rank.
            It sees every op of that step through a Python dispatch mode: slower, so one step. ``None``: off.
    """

    def __init__(
        self,
        *,
        figure_path: str | Path | bool | None = None,
        summary_path: str | Path | None = None,
        log_every_n_steps: int = 1,
        batch_size_fn: BatchSizeFn | None = None,
        length_fn: BatchSizeFn | None = None,
        peak_tensors_step: int | None = None,
    ) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"`log_every_n_steps={log_every_n_steps!r}` must be a positive integer.")
        if peak_tensors_step is not None and (
            isinstance(peak_tensors_step, bool) or not isinstance(peak_tensors_step, int) or peak_tensors_step < 0
        ):
            raise ValueError(
                f"`peak_tensors_step={peak_tensors_step!r}` must be a step index >= 0 (e.g. 2, once the optimizer"
                " state exists) or None."
            )
        for name, fn in (("batch_size_fn", batch_size_fn), ("length_fn", length_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"`{name}={fn!r}` must be a function `fn(batch) -> int` or None.")
        if figure_path is True:
            raise ValueError(
                "`figure_path=True` is invalid: pass a path, None (default location) or False (no figure)."
            )
        self.figure_path = figure_path
        self.summary_path = summary_path
        self.log_every_n_steps = log_every_n_steps
        self.batch_size_fn: BatchSizeFn = batch_size_fn or default_batch_size
        self.length_fn: BatchSizeFn = length_fn or default_length
        self.peak_tensors_step = peak_tensors_step
        self._peak_tracker: LiveTensorPeak | None = None
        self._peak_tensors: PeakMemory | None = None
        self.steps: list[StepRecord] = []
        self.summary: dict[str, Any] | None = None
        """All ranks' measurements after fit (on rank 0; this rank's only elsewhere)."""
        self._stats: CommunicationStats | None = None
        self.clock: Clock = WallClock()
        """Marks the step and the strategy's timed blocks (``PhaseListener``): CUDA events on a GPU, set per fit."""
        self._stamps: StepStamps | None = None
        self._pending: PendingSteps[_StepFacts] = PendingSteps(self.clock)
        self._tap: CollectiveTap | None = None
        self._tap_hooks: list[RemovableHandle] = []
        self._in_batch = False
        self._strategy: InstrumentedStrategy | None = None  # ours, while subscribed to its events
        self._instrumentation: Instrumentation | None = None
        self._tracked_before: tuple[Any, bool] | None = None
        self._step = 0
        self._before: dict[str, int] = {}
        self._memory: dict[str, int] = {}

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.steps, self.summary = [], None
        self._stats, self._tap, self._instrumentation = None, None, None
        self._peak_tracker, self._peak_tensors = None, None
        strategy = trainer.strategy
        if isinstance(strategy, InstrumentedStrategy):
            # Read by the strategy's `setup` (wrapping/bucketing), which runs after the callbacks' `setup`.
            self._tracked_before = (strategy, strategy.track_communication)
            strategy.track_communication = True
            self._stats = strategy.communication_stats

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        # No device synchronize per step: the marks are read once the device has passed them (`monitor/timing.py`).
        self.clock = clock_for(strategy.root_device)
        self._pending = PendingSteps(self.clock)
        if not isinstance(strategy, InstrumentedStrategy) or self._stats is None:
            return
        self._instrumentation = instrumentation = strategy.instrumentation()
        if instrumentation.tap is not None:
            self._tap = CollectiveTap(self._stats)
            self._tap_hooks = self._tap.hook_forward(pl_module)
        self._strategy = strategy
        strategy.events.subscribe(self)

    def on_phase(self, phase: str, start: Any, end: Any) -> None:
        """A timed phase of the strategy (``lightning_parallel.instrumentation.PhaseListener``): this step's."""
        if self._in_batch and self._stamps is not None:
            self._stamps.phases.append((phase, start, end))

    def on_chunk(self, kind: str, stage: int, start: Any, end: Any) -> None:
        """A pipeline chunk this rank's stages ran (``PhaseListener``): busy time and timeline of a training batch."""
        if self._in_batch and self._stamps is not None:
            self._stamps.chunks.append((kind, stage, start, end))

    def _exit_tap(self) -> None:
        if self._tap is not None:
            self._tap.stop()

    def _restore(self) -> None:
        self._in_batch = False
        self._exit_tap()
        for handle in self._tap_hooks:
            handle.remove()
        self._tap_hooks = []
        if self._strategy is not None:
            self._strategy.events.unsubscribe(self)
            self._strategy = None

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._in_batch = True
        if self._tap is not None:
            self._tap.counting = True  # entered around FSDP2's pre-forward hooks and over backward, see below
        self._before = dict(self._stats.bytes_by_collective) if self._stats is not None else {}
        self._step = trainer.global_step
        if self.peak_tensors_step is not None and trainer.global_step == self.peak_tensors_step:
            self._start_peak_tracking(trainer)
        self._stamps = StepStamps(start=self.clock.stamp())

    def _start_peak_tracking(self, trainer: pl.Trainer) -> None:
        module, optimizers, strategy = trainer.lightning_module, trainer.optimizers, trainer.strategy

        def categories() -> dict[str, list[torch.Tensor]]:
            parameters = list(module.parameters())
            if isinstance(strategy, ReportsGradientTensors):  # ours: with its own gradient buffers (ZeRO-1/2 buckets)
                gradients = strategy.gradient_tensors()
            else:
                gradients = [p.grad for p in parameters if p.grad is not None]
            return {
                "parameters": parameters,
                "gradients": gradients,
                "optimizer_state": list(optimizer_state_tensors([unwrap_optimizer(o) for o in optimizers])),
            }

        tracker = LiveTensorPeak(
            categories=categories,
            device=trainer.strategy.root_device,
            exclude=lambda: dataset_tensors(trainer.train_dataloader),
        )
        tracker.phase = "forward"
        self._peak_tracker = tracker.__enter__()

    def _stop_peak_tracking(self) -> None:
        tracker, self._peak_tracker = self._peak_tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
            self._peak_tensors = tracker.result()

    def _set_peak_phase(self, phase: str) -> None:
        if self._peak_tracker is not None:
            self._peak_tracker.phase = phase

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._set_peak_phase("backward")
        if self._tap is not None and self._in_batch:
            # Dispatch modes leave in the reverse order they entered: the tap (entered after the peak tracker) first.
            self._tap.start()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit_tap()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._set_peak_phase("optimizer_step")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stamps, self._stamps = self._stamps, None
        assert stamps is not None
        stamps.end = self.clock.stamp()
        if self._tap is not None:
            self._tap.counting = False
        self._exit_tap()  # before the peak tracker (see `on_before_backward`); a no-op after a normal backward
        self._stop_peak_tracking()
        self._in_batch = False
        communication = None
        if self._stats is not None:
            after = self._stats.bytes_by_collective
            communication = {
                k: int(after[k] - self._before.get(k, 0)) for k in after if after[k] != self._before.get(k, 0)
            }
        instrumentation = self._instrumentation
        replicas = instrumentation.data_parallel_size if instrumentation is not None else trainer.world_size
        samples = int(self.batch_size_fn(batch)) * replicas
        tokens = int(self.length_fn(batch)) * replicas
        self._pending.add(stamps, _StepFacts(self._step, samples, tokens, communication))
        self._memory = _memory_report(trainer)
        self._record_read_steps(trainer)

    def _record_read_steps(self, trainer: pl.Trainer, *, wait: bool = False) -> None:
        """Record (and log) the steps whose marks can be read: on CPU the one that just ended, on a GPU the ones the
        device has passed, at the latest one step later; ``wait``: all (end of training)."""
        for facts, elapsed, times in self._pending.read(wait=wait):
            record = self._step_record(facts, elapsed, times)
            self.steps.append(record)
            if trainer.global_rank == 0 and (len(self.steps) - 1) % self.log_every_n_steps == 0:
                self._log(trainer, record)

    def _step_record(self, facts: _StepFacts, elapsed: float, times: PhaseTimes) -> StepRecord:
        instrumentation = self._instrumentation
        is_pipeline = instrumentation is not None and instrumentation.is_pipeline
        measures_sync = instrumentation is not None and instrumentation.times_exposed_communication
        exposed = times.exposed_communication if measures_sync else None
        idle = bubble = None
        timeline: list[tuple[str, int, float, float]] = []
        if is_pipeline:
            idle = max(0.0, times.pipeline_step - times.pipeline_busy)
            bubble = idle / times.pipeline_step if times.pipeline_step > 0 else None
            timeline = list(times.events)
        compute = max(0.0, elapsed - (exposed or 0.0) - (idle or 0.0))
        return StepRecord(
            **vars(facts),  # step, samples, tokens, communication: the record's fields of the same names
            step_time_s=elapsed,
            exposed_communication_s=exposed,
            pipeline_idle_s=idle,
            compute_s=compute,
            bubble_fraction=bubble,
            timeline=timeline,
        )

    def _log(self, trainer: pl.Trainer, record: StepRecord) -> None:
        metrics: dict[str, float] = {"monitor/step_time_s": record.step_time_s, "monitor/compute_s": record.compute_s}
        if record.step_time_s > 0:
            metrics["monitor/samples_per_s"] = record.samples / record.step_time_s
            if record.tokens:
                metrics["monitor/tokens_per_s"] = record.tokens / record.step_time_s
        if record.exposed_communication_s is not None:
            metrics["monitor/exposed_communication_s"] = record.exposed_communication_s
        if record.pipeline_idle_s is not None:
            metrics["monitor/pipeline_idle_s"] = record.pipeline_idle_s
        if record.bubble_fraction is not None:
            metrics["monitor/bubble_fraction"] = record.bubble_fraction
        for collective, num_bytes in (record.communication or {}).items():
            metrics[f"monitor/bytes_{collective}"] = float(num_bytes)
        for kind, num_bytes in self._memory.items():
            metrics[f"monitor/held_{kind}_bytes"] = float(num_bytes)
        metrics["monitor/peak_memory_bytes"] = float(peak_memory_bytes(trainer.strategy.root_device))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=record.step)

    # ------------------------------------------------------------------ end of fit
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()
        self._record_read_steps(trainer, wait=True)
        local = self._rank_summary(trainer)
        ranks: list[Any] = [local]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, local)
        self.summary = {"strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size, "ranks": ranks}
        if trainer.global_rank != 0:
            return
        rank_zero_info(format_table(self.summary))
        # Every rank's bytes held and peak, once, through the loggers (the per-step series above is rank 0's).
        per_rank = {f"monitor/rank{r['rank']}/held_{k}_bytes": float(v) for r in ranks for k, v in r["memory"].items()}
        per_rank |= {f"monitor/rank{r['rank']}/peak_memory_bytes": float(r["peak_memory_bytes"]) for r in ranks}
        for logger in trainer.loggers:
            logger.log_metrics(per_rank, step=self.steps[-1].step if self.steps else 0)
        figure = self._figure_path(trainer)
        summary_path = (
            Path(self.summary_path)
            if self.summary_path
            else (figure.with_suffix(".json") if figure else self._default_dir(trainer) / "parallelism_monitor.json")
        )
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(self.summary, indent=1))
        if figure is not None:
            if write_figure(self.summary, figure):
                rank_zero_info(f"ParallelismMonitor: figure written to {figure}")
            else:
                rank_zero_info(
                    "ParallelismMonitor: figure skipped, matplotlib is not installed"
                    " (`pip install lightning-parallel[plots]`)."
                )

    def _rank_summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        return {
            "rank": trainer.global_rank,
            "memory": dict(self._memory),
            "peak_memory_bytes": peak_memory_bytes(trainer.strategy.root_device),
            "peak_tensors": self._peak_tensors.as_dict() if self._peak_tensors is not None else None,
            "communication_measured": self._stats is not None,
            "steps": [asdict(s) for s in self.steps],
        }

    def _default_dir(self, trainer: pl.Trainer) -> Path:
        for logger in trainer.loggers:
            log_dir = getattr(logger, "log_dir", None)
            if log_dir:
                return Path(log_dir)
        return Path(trainer.default_root_dir)

    def _figure_path(self, trainer: pl.Trainer) -> Path | None:
        if self.figure_path is False:
            return None
        if self.figure_path:
            return Path(self.figure_path)
        return self._default_dir(trainer) / "parallelism_monitor.png"

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._pending.clear()  # a failed step's marks may never be passed (a device error)
        self._stamps = None
        self._exit_tap()
        self._stop_peak_tracking()
        self._restore()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()
        if self._tracked_before is not None:  # the strategy counts only while a monitor is attached
            strategy, tracked = self._tracked_before
            strategy.track_communication = tracked
            self._tracked_before = None


def _memory_report(trainer: pl.Trainer) -> dict[str, int]:
    report = getattr(trainer.strategy, "memory_report", None)
    if callable(report):
        measured = report()
    else:  # Lightning's own strategies: parameters, `.grad` and optimizer state of the module as it is
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        measured = module_memory_report(trainer.lightning_module, unwrap_optimizer(optimizer))
    return {
        "parameters": measured.parameters,
        "gradients": measured.gradients,
        "optimizer_state": measured.optimizer_state,
    }
