"""Events our strategies emit, and what a strategy tells an observer (the monitor) it can measure.

A strategy owns one :class:`StrategyEvents`. Its sync paths run inside ``events.timed(phase)``, and a pipeline's
stages report each forward/backward chunk they run (``events.chunk``); whoever wants the seconds
(``ParallelismMonitor``) subscribes a :class:`PhaseListener` for the duration of a fit and unsubscribes afterwards.
Nothing is timed while nobody listens (a chunk costs two clock reads), and nobody replaces methods on another
object's instance.

:class:`InstrumentedStrategy` is the small protocol the monitor reads instead of asking which strategy class it
holds: the communication ledger, the switch that turns counting on, the events, and an :class:`Instrumentation`
record of what this run can measure. Plain Python: no torch, no Lightning.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lightning_parallel.accounting import CommunicationStats

__all__ = [
    "PHASES",
    "Instrumentation",
    "InstrumentedStrategy",
    "Phase",
    "PhaseListener",
    "ReportsGradientTensors",
    "StrategyEvents",
]

Phase = Literal["exposed_communication", "pipeline_step"]
PHASES: tuple[str, ...] = ("exposed_communication", "pipeline_step")
"""``exposed_communication``: blocked in gradient sync or parameter gathering outside autograd (ZeRO-1/2 buckets,
pipeline replicas' all-reduce). ``pipeline_step``: the whole pipeline schedule of a training step."""


class PhaseListener(Protocol):
    """Receives the seconds of every timed phase, and every pipeline chunk, while subscribed."""

    def on_phase(self, phase: str, seconds: float) -> None: ...

    def on_chunk(self, kind: str, stage: int, start: float, end: float) -> None: ...


class StrategyEvents:
    """The events one strategy emits; listeners subscribe and unsubscribe (no global registry)."""

    def __init__(self) -> None:
        self._listeners: list[PhaseListener] = []

    @property
    def has_listeners(self) -> bool:
        return bool(self._listeners)

    def subscribe(self, listener: PhaseListener) -> None:
        if listener not in self._listeners:
            self._listeners.append(listener)

    def unsubscribe(self, listener: PhaseListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    @contextmanager
    def timed(self, phase: Phase) -> Generator[None, None, None]:
        """Report the wall seconds of the block to every listener (also when it raises); free when none listens."""
        if not self._listeners:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            for listener in list(self._listeners):
                listener.on_phase(phase, seconds)

    def chunk(self, kind: str, stage: int, start: float, end: float) -> None:
        """A pipeline stage ran one chunk: ``kind`` ``"F"``/``"B"``/``"W"`` (forward, backward, weight gradient) of
        stage index ``stage`` from ``start`` to ``end`` (``time.perf_counter`` seconds); told to every listener."""
        for listener in list(self._listeners):
            listener.on_chunk(kind, stage, start, end)


@dataclass(frozen=True, kw_only=True)
class Instrumentation:
    """What a strategy's run can measure, as the strategy itself answers it (read after its ``setup``)."""

    data_parallel_size: int
    """Replicas a global batch is split across (samples/s counts local batch x this)."""
    tap: Literal["fsdp"] | None = None
    """Collectives issued by code we do not own, which the monitor counts with a function mode during training
    batches (``monitor.ledger.CollectiveTap``): FSDP2's (ZeRO-3). ``None``: everything is counted at the call site
    (the pipeline's P2P ops by our own stage class)."""
    times_exposed_communication: bool = False
    """Whether the gradient sync waits run in our Python code, inside ``events.timed("exposed_communication")``
    (``False`` where they run inside autograd: DDP's reducer, FSDP2)."""
    is_pipeline: bool = False
    """Whether steps run a pipeline schedule (``events.timed("pipeline_step")``, bubble and timeline)."""


@runtime_checkable
class InstrumentedStrategy(Protocol):
    """A strategy the monitor can measure: all three of ours (``strategies.base.LightningParallelStrategy``)."""

    track_communication: bool
    """Count collective bytes into :attr:`communication_stats` (set before the strategy's ``setup``)."""
    communication_stats: CommunicationStats
    events: StrategyEvents

    def instrumentation(self) -> Instrumentation: ...


@runtime_checkable
class ReportsGradientTensors(Protocol):
    """A strategy that names every gradient tensor it holds (ours: ``.grad`` plus ZeRO-1/2's buckets), which the
    monitor's peak breakdown counts as gradients; for any other strategy it counts the parameters' ``.grad``."""

    def gradient_tensors(self) -> list[Any]: ...
