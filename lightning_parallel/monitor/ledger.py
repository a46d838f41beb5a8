"""Communication accounting for the monitor: what counts as "bytes", and scoped wrappers for code we do not own.

**Definition.** ``bytes`` of a collective is the size of its *full* buffer on this rank: the tensor all-reduced, the
(unsharded) input of a reduce-scatter, the (gathered) output of an all-gather, the tensor sent or received by a P2P
op. That is a property of the call, independent of the backend's algorithm. What a ring algorithm puts on the wire
per rank is ``2(N-1)/N`` of it for all-reduce and ``(N-1)/N`` for reduce-scatter and all-gather, which is why
reduce-scatter + all-gather (ZeRO) moves the same wire bytes as one all-reduce (DDP): :func:`ring_wire_bytes`.
The definitions live in :mod:`lightning_parallel.accounting` (re-exported here); this module adds the scoped
wrappers and the per-step phase times.

**Where the numbers come from.** Our own code records at each call it makes (``CommunicationStats.record``):
DDP's gradient all-reduce through a communication hook (``DataParallelStrategy(track_communication=True)``), the
ZeRO-1/2 buckets' reduce-scatter and all-gather and their "got a gradient" flags (one byte per parameter tensor,
all-reduced at each sync), the pipeline replicas' gradient all-reduce. For code we do not own,
:class:`CollectiveTap` wraps the torch functions it calls, only while a monitor is attached and only inside training
batches, and restores them afterwards: FSDP2's all-gathers and reduce-scatters (ZeRO-3) and torch pipelining's P2P
sends/receives. Control messages of a fixed size (the one-element non-finite-loss flag, the 16-byte ``requires_grad``
fingerprint of ``distributed/trainable.py`` all-reduced every step, the broadcast of logged values, checkpoint
gathers) are not counted: the ledger holds the traffic that scales with the model and the batch, and the planner
predicts exactly that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_parallel.accounting import COLLECTIVES, CommunicationStats, ring_wire_bytes, tensor_bytes
from lightning_parallel.monitor import _compat

__all__ = ["COLLECTIVES", "CollectiveTap", "PhaseTimes", "ring_wire_bytes"]


@dataclass
class PhaseTimes:
    """Seconds of one step spent in the phases the monitor can see (``None``: not measurable here)."""

    exposed_communication: float = 0.0
    """Blocked in gradient synchronisation / parameter gathering after backward (ZeRO-1/2, pipeline replicas)."""
    pipeline_busy: float = 0.0
    """Running this rank's stages' forward/backward chunks."""
    pipeline_step: float = 0.0
    """The whole pipeline schedule of the step (busy + idle)."""
    pipeline_wait: float = 0.0
    """Blocked in P2P waits (waiting for a neighbour stage)."""
    events: list[tuple[str, int, float, float]] = field(default_factory=list)
    """``(kind, stage, start, end)`` of every F/B/W chunk of the step (``time.perf_counter`` seconds)."""


class CollectiveTap:
    """Scoped wrappers counting bytes of collectives issued by FSDP2 (``fsdp``) or torch pipelining (``pipeline``).

    :meth:`install` replaces the functions, :meth:`remove` restores the originals; counting happens only while
    :attr:`active` is true (the monitor sets it for the duration of a training batch). Nothing is wrapped unless a
    monitor installs a tap, so runs without a monitor pay nothing.

    Args:
        stats: the ledger to record into (the strategy's ``communication_stats``).
        times: where to accumulate pipeline busy/wait seconds.
        fsdp: wrap FSDP2's all-gather / reduce-scatter.
        pipeline: wrap torch pipelining's P2P batches, waits and stage chunks.
    """

    def __init__(self, stats: CommunicationStats, times: PhaseTimes, *, fsdp: bool, pipeline: bool) -> None:
        self.stats = stats
        self.times = times
        self.fsdp = fsdp
        self.pipeline = pipeline
        self.active = False
        self._restore: list[tuple[Any, str, Any]] = []

    @property
    def installed(self) -> bool:
        return bool(self._restore)

    def install(self) -> None:
        if self.installed:
            return
        if self.fsdp:
            for name, collective in _compat.fsdp_collective_names().items():
                self._wrap(dist, name, self._counting_collective(getattr(dist, name), collective))
        if self.pipeline:
            schedules = _compat.schedules
            self._wrap(schedules, "_batch_p2p", self._counting_p2p(schedules._batch_p2p))
            self._wrap(schedules, "_wait_batch_p2p", self._timed(schedules._wait_batch_p2p, "pipeline_wait"))
            stage_class = _compat.PIPELINE_STAGE_CLASS
            for name, kind in _compat.PIPELINE_STAGE_METHODS.items():
                if hasattr(stage_class, name):
                    self._wrap(stage_class, name, self._timed_chunk(getattr(stage_class, name), kind))

    def remove(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()
        self.active = False

    def _wrap(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def _counting_collective(self, original: Callable[..., Any], collective: str) -> Callable[..., Any]:
        tap = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if tap.active:
                # all-gather: (output, input) -> the gathered output; reduce-scatter: (output, input) -> the input.
                output = kwargs.get("output_tensor", kwargs.get("output", args[0] if args else None))
                source = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
                full = output if collective == "all_gather" else source
                if isinstance(full, Tensor):
                    tap.stats.record(collective, tensor_bytes(full))
            return original(*args, **kwargs)

        return wrapper

    def _counting_p2p(self, original: Callable[..., Any]) -> Callable[..., Any]:
        tap = self

        def wrapper(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> Any:
            if tap.active:
                for op in p2p_ops:
                    kind = "send" if getattr(op.op, "__name__", "") == "isend" else "recv"
                    tap.stats.record(kind, tensor_bytes(op.tensor))
            return original(p2p_ops, *args, **kwargs)

        return wrapper

    def _timed(self, original: Callable[..., Any], phase: str) -> Callable[..., Any]:
        tap = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not tap.active:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                setattr(tap.times, phase, getattr(tap.times, phase) + time.perf_counter() - start)

        return wrapper

    def _timed_chunk(self, original: Callable[..., Any], kind: str) -> Callable[..., Any]:
        tap = self

        def wrapper(stage: Any, *args: Any, **kwargs: Any) -> Any:
            if not tap.active:
                return original(stage, *args, **kwargs)
            start = time.perf_counter()
            try:
                return original(stage, *args, **kwargs)
            finally:
                end = time.perf_counter()
                tap.times.pipeline_busy += end - start
                tap.times.events.append((kind, int(getattr(stage, "stage_index", 0)), start, end))

        return wrapper
