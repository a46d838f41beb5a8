"""Run statistics for demos and benchmarks: loss, steady-state throughput, peak memory and communication per rank.

:class:`RunStats` measures on every rank and gathers the per-rank numbers to rank 0 at the end of training, where it
writes them into ``trainer.callback_metrics``. Lightning's fork and spawn launchers send ``callback_metrics`` of rank 0
back to the parent process, so after ``trainer.fit`` the parent reads them with :func:`summarize`:

.. code-block:: python

    trainer = Trainer(strategy=DataParallelStrategy(start_method="fork"), devices=2, callbacks=[RunStats()])
    trainer.fit(model, datamodule)
    print(summarize(trainer)["tokens_per_s"])
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from itertools import pairwise
from typing import Any, TypedDict

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

# Re-exported: the demo's programs import these names from here.
from lightning_parallel.accounting import (
    LiveTensorPeak,
    batch_inputs,
    dataset_tensors,
    peak_memory_bytes,
    reset_peak_memory,
)

__all__ = ["STATS_PREFIX", "RunStats", "RunSummary", "batch_inputs", "peak_memory_bytes", "summarize"]

STATS_PREFIX = "stats/"
"""Prefix of every key :class:`RunStats` writes into ``trainer.callback_metrics``."""

# Per-rank values, packed into one float64 vector so that a single all_gather moves them all. float64 holds byte
# counts exactly up to 2**53.
_FIELDS = (
    "tokens",
    "samples",
    "elapsed_s",
    "median_step_s",
    "measured_batches",
    "optimizer_steps",
    "peak_mem",
    "peak_tensor_bytes",
    "all_reduce_bytes",
    "comm_total_bytes",
    "comm_calls",
    "final_loss",
)


class RunSummary(TypedDict):
    """What :func:`summarize` reads back from ``trainer.callback_metrics``."""

    world_size: int
    """Number of ranks that trained."""
    measured_steps: int
    """Training batches (per rank) inside the measurement window, after the warm-up."""
    final_loss: float
    """Training loss of the last batch, averaged over ranks (NaN if no batch ran)."""
    samples_per_s: float
    """Samples per second summed over ranks in the measurement window (NaN if it was empty)."""
    tokens_per_s: float
    """Input tokens per second summed over ranks in the measurement window (NaN if it was empty)."""
    tokens_per_s_median_step: float
    """Input tokens per step summed over ranks, divided by the slowest rank's median step time: robust to steps
    slowed down by other work on the machine (NaN if the window was empty)."""
    peak_mem: list[float]
    """Peak memory in bytes of each rank, indexed by global rank (process RSS on CPU, allocated memory on CUDA)."""
    peak_tensors: list[float]
    """Peak bytes of live tensors of each rank over the last warm-up batch (``LiveTensorPeak``: exact, independent
    of the allocator; the training data set's own tensors left out, as a GPU run keeps them on the host; NaN where
    that batch did not run)."""
    comm_bytes_per_step: float | None
    """All-reduce payload bytes per optimizer step on one rank; ``None`` if the strategy counts no communication,
    NaN if it has counters but recorded nothing although several ranks trained (tracking was off)."""


class RunStats(Callback):
    """Measure loss, throughput, peak memory and all-reduce bytes on every rank; gather them into callback_metrics.

    The first ``warmup_steps`` training batches are not measured (allocator warm-up, DDP's bucket rebuild, lazy
    initialisation). Throughput is the wall time from ``on_train_batch_start`` of the first measured batch to
    ``on_train_batch_end`` of the last one (on CUDA measured with CUDA events, so no step waits for the device: it
    is synchronized once, at the end); samples are ``inputs.size(0)`` and tokens ``inputs.numel()`` of each batch,
    summed over ranks (every rank trains on its own batch) and divided by the slowest rank's time. A second, robust
    figure divides the tokens of one step by the slowest rank's median step time (a step being the time between
    consecutive ``on_train_batch_end`` calls, data loading included). Peak memory is measured from ``setup`` on: the
    process's peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA. If the strategy has a
    ``communication_stats`` attribute (:class:`~lightning_parallel.DataParallelStrategy`), it is reset when measurement
    starts and its all-reduce bytes are reported per optimizer step. Over the last warm-up batch (the first batch
    without warm-up), each rank also measures the peak bytes of its live tensors exactly
    (:class:`~lightning_parallel.accounting.LiveTensorPeak`).

    At ``on_train_end`` every rank's numbers are all-gathered and written, on every rank, into
    ``trainer.callback_metrics`` as float64 tensors under ``stats/...`` keys (``stats/tokens_per_s``,
    ``stats/samples_per_s``, ``stats/final_loss``, ``stats/peak_mem_rank{r}``, ``stats/comm_bytes_per_step``, ...).
    Read them with :func:`summarize`, also in the parent process of a fork/spawn launch.

    Args:
        warmup_steps: Training batches to skip before measuring (>= 0).
    """

    def __init__(self, warmup_steps: int = 2) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"`warmup_steps={warmup_steps!r}` must be an integer >= 0 (training batches to skip).")
        self.warmup_steps = warmup_steps
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._batches_seen = 0
        self._clock: _StepClock | None = None
        self._start_global_step = 0
        self._tokens: float = 0  # an int until a fractional data share is added
        self._data_share = 1.0
        self._samples: float = 0
        self._measured_batches = 0
        self._final_loss: Tensor | float = math.nan
        self._peak_tracker: LiveTensorPeak | None = None
        self._peak_tensor_bytes = math.nan

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reset_counters()
            reset_peak_memory(trainer.strategy.root_device)
            # Ranks that load the same batch (the stages of one pipeline) must count it once: weight each rank's
            # tokens by (distinct data shards) / (ranks).
            replicas = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
            self._data_share = replicas.get("num_replicas", trainer.world_size) / trainer.world_size

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The last warm-up batch (the optimizer state exists from the first step on), so the tracker's cost per op
        # stays out of the measured window; the first batch when there is no warm-up.
        if self._batches_seen == max(self.warmup_steps - 1, 0):
            self._peak_tracker = LiveTensorPeak(exclude=lambda: dataset_tensors(trainer.train_dataloader)).__enter__()
        if self._batches_seen != self.warmup_steps:
            return
        stats = getattr(trainer.strategy, "communication_stats", None)
        if stats is not None:
            stats.reset()
        self._start_global_step = trainer.global_step
        self._clock = _StepClock(trainer.strategy.root_device)
        self._clock.mark()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches_seen += 1
        if self._peak_tracker is not None:
            self._peak_tracker.__exit__(None, None, None)
            self._peak_tensor_bytes = float(self._peak_tracker.result().peak_bytes)
            self._peak_tracker = None
        self._final_loss = _loss_value(trainer, outputs)
        if self._clock is None:
            return
        self._clock.mark()  # no wait for the device: a CUDA event, read at the end
        inputs = batch_inputs(batch)
        if inputs is not None:
            self._tokens += inputs.numel() * self._data_share
            self._samples += (inputs.size(0) if inputs.dim() > 0 else 1) * self._data_share
        self._measured_batches += 1

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        local = torch.tensor(self._local_values(trainer), dtype=torch.float64, device=trainer.strategy.root_device)
        gathered = _all_gather(trainer, local).reshape(-1, len(_FIELDS)).cpu()  # (world_size, num_fields)
        has_comm_stats = getattr(trainer.strategy, "communication_stats", None) is not None
        for key, value in _metrics_from_gathered(gathered, has_comm_stats=has_comm_stats).items():
            trainer.callback_metrics[STATS_PREFIX + key] = torch.tensor(value, dtype=torch.float64)

    def _local_values(self, trainer: pl.Trainer) -> list[float]:
        step_times = self._clock.intervals() if self._clock is not None else []  # waits for the device, once
        elapsed = sum(step_times)
        stats = getattr(trainer.strategy, "communication_stats", None)
        all_reduce_bytes = comm_total = comm_calls = 0
        if stats is not None:
            all_reduce_bytes = stats.bytes_by_collective.get("all_reduce", 0)
            comm_total, comm_calls = stats.total_bytes, stats.calls
        optimizer_steps = trainer.global_step - self._start_global_step if self._clock is not None else 0
        values = {
            "tokens": self._tokens,
            "samples": self._samples,
            "elapsed_s": elapsed,
            "median_step_s": statistics.median(step_times) if step_times else 0.0,
            "measured_batches": self._measured_batches,
            "optimizer_steps": optimizer_steps,
            "peak_mem": peak_memory_bytes(trainer.strategy.root_device),
            "peak_tensor_bytes": self._peak_tensor_bytes,
            "all_reduce_bytes": all_reduce_bytes,
            "comm_total_bytes": comm_total,
            "comm_calls": comm_calls,
            "final_loss": float(self._final_loss),  # the one read of a loss: after the last step
        }
        return [float(values[name]) for name in _FIELDS]


class _StepClock:
    """Times between marks without waiting for the device at each: on CUDA each mark records a timing event on the
    current stream, and :meth:`intervals` waits once for the last one (elapsed device time between the marks, which
    includes the time the device sat idle waiting for the host); on CPU, wall time."""

    def __init__(self, device: torch.device) -> None:
        self._on_cuda = device.type == "cuda"
        self._marks: list[Any] = []

    def mark(self) -> None:
        if self._on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (one fewer than the marks)."""
        if len(self._marks) < 2:
            return []
        if self._on_cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in pairwise(self._marks)]  # ms -> s
        return [b - a for a, b in pairwise(self._marks)]


def _loss_value(trainer: pl.Trainer, outputs: Any) -> Tensor | float:
    """The batch's training loss, left on its device (read once, at the end): ``outputs["loss"]`` (undoing
    Lightning's division by the accumulation factor), or the ``train_loss`` the module logged."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, Tensor) and loss.numel() == 1:
        return loss.detach().reshape(()).float() * trainer.accumulate_grad_batches
    logged = trainer.callback_metrics.get("train_loss")
    return logged.detach().reshape(()).float() if isinstance(logged, Tensor) and logged.numel() == 1 else math.nan


def _all_gather(trainer: pl.Trainer, local: Tensor) -> Tensor:
    """Every rank's ``local`` vector stacked, ``(world_size, n)``; ``local`` itself when there is one rank."""
    if trainer.world_size == 1:
        return local.unsqueeze(0)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == trainer.world_size:
        # The list form of all_gather: Lightning's all_gather and all_gather_into_tensor both warn of deprecated torch
        # APIs (torch 2.13), and their replacement, all_gather_single, is missing from older torch.
        parts = [torch.empty_like(local) for _ in range(trainer.world_size)]
        dist.all_gather(parts, local)
        return torch.stack(parts)  # (world_size, n)
    if hasattr(trainer.strategy, "all_gather"):
        return trainer.strategy.all_gather(local)
    raise RuntimeError(f"RunStats cannot gather from {trainer.world_size} ranks: no collective is available.")


def _median_step_throughput(col: dict[str, Tensor]) -> float:
    """Tokens per second from the median step time of the slowest rank: unlike the window's wall time, it ignores a
    few steps slowed down by other work on the machine."""
    tokens_per_step = float((col["tokens"] / col["measured_batches"]).sum())  # summed over ranks
    return tokens_per_step / float(col["median_step_s"].max())


def _metrics_from_gathered(gathered: Tensor, *, has_comm_stats: bool) -> dict[str, float]:
    """Turn the ``(world_size, num_fields)`` table of per-rank values into the reported metrics."""
    col = {name: gathered[:, i] for i, name in enumerate(_FIELDS)}
    world_size = gathered.size(0)
    elapsed = float(col["elapsed_s"].max())
    has_window = elapsed > 0 and float(col["measured_batches"].min()) > 0
    metrics = {
        "world_size": float(world_size),
        "measured_steps": float(col["measured_batches"].min()),
        "elapsed_s": elapsed,
        "final_loss": float(col["final_loss"].mean()),
        "samples_per_s": float(col["samples"].sum()) / elapsed if has_window else math.nan,
        "tokens_per_s": float(col["tokens"].sum()) / elapsed if has_window else math.nan,
        "tokens_per_s_per_rank": float(col["tokens"].sum()) / elapsed / world_size if has_window else math.nan,
        "tokens_per_s_median_step": _median_step_throughput(col) if has_window else math.nan,
    }
    for rank in range(world_size):
        metrics[f"peak_mem_rank{rank}"] = float(col["peak_mem"][rank])
        metrics[f"peak_tensors_rank{rank}"] = float(col["peak_tensor_bytes"][rank])
    if has_comm_stats:
        steps = float(col["optimizer_steps"].min())
        # No recorded call with several ranks means tracking was off (uncompressed DDP without a counting hook).
        counted = steps > 0 and (world_size == 1 or float(col["comm_calls"].min()) > 0)
        metrics["comm_bytes_per_step"] = float(col["all_reduce_bytes"][0]) / steps if counted else math.nan
        metrics["comm_total_bytes_per_step"] = float(col["comm_total_bytes"][0]) / steps if counted else math.nan
    return metrics


def summarize(trainer: pl.Trainer) -> RunSummary:
    """Read the numbers :class:`RunStats` put into ``trainer.callback_metrics`` back as plain Python values.

    Works in the process that called ``trainer.fit``, including the parent of a fork/spawn launch.

    Raises:
        RuntimeError: If ``trainer.callback_metrics`` holds no ``RunStats`` results (no ``RunStats`` callback, or
            training did not reach ``on_train_end``).
    """
    metrics = {k[len(STATS_PREFIX) :]: v for k, v in trainer.callback_metrics.items() if k.startswith(STATS_PREFIX)}
    if "world_size" not in metrics:
        raise RuntimeError(
            "No RunStats results in `trainer.callback_metrics`: pass `callbacks=[RunStats()]` to the Trainer and"
            " call `summarize` after `trainer.fit` returned."
        )
    world_size = int(metrics["world_size"])
    comm = metrics.get("comm_bytes_per_step")
    return RunSummary(
        world_size=world_size,
        measured_steps=int(metrics["measured_steps"]),
        final_loss=float(metrics["final_loss"]),
        samples_per_s=float(metrics["samples_per_s"]),
        tokens_per_s=float(metrics["tokens_per_s"]),
        tokens_per_s_median_step=float(metrics["tokens_per_s_median_step"]),
        peak_mem=[float(metrics[f"peak_mem_rank{rank}"]) for rank in range(world_size)],
        peak_tensors=[float(metrics[f"peak_tensors_rank{rank}"]) for rank in range(world_size)],
        comm_bytes_per_step=None if comm is None else float(comm),
    )
