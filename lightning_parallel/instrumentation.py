"""Events our strategies emit, and what a strategy tells an observer (the monitor) it can measure.

A strategy owns one :class:`StrategyEvents`. Its sync paths run inside ``events.timed(phase)``, and a pipeline's
stages run each forward/backward chunk inside ``events.chunk(kind, stage)``; whoever wants the seconds
(``ParallelismMonitor``) subscribes a :class:`PhaseListener` for the duration of a fit and unsubscribes afterwards.
Nothing is timed while nobody listens (a block costs two stamps), and nobody replaces methods on another object's
instance.

Where a block starts and ends is marked by the listener's :class:`Clock`, read later: :class:`WallClock` on CPU
(gloo's waits block the host, so wall time is the time spent), CUDA events on a GPU
(``lightning_parallel.monitor.timing.EventClock``): there ``work.wait()`` returns at once and kernels run after
their launch, so the host's clock would time launches; an event recorded on the current stream before and after the
block times what that stream, the one compute runs on, spent in it, waits for NCCL's stream included.

:class:`InstrumentedStrategy` is the small protocol the monitor reads instead of asking which strategy class it
holds: the communication ledger, the switch that turns counting on, the events, and an :class:`Instrumentation`
record of what this run can measure. Plain Python: no torch, no Lightning.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lightning_parallel.accounting import CommunicationStats

__all__ = [
    "PHASES",
    "Clock",
    "Instrumentation",
    "InstrumentedStrategy",
    "Phase",
    "PhaseListener",
    "ReportsGradientTensors",
    "StrategyEvents",
    "WallClock",
]

Phase = Literal["exposed_communication", "pipeline_step"]
PHASES: tuple[str, ...] = ("exposed_communication", "pipeline_step")
"""``exposed_communication``: blocked in gradient sync or parameter gathering outside autograd (ZeRO-1/2 buckets,
pipeline replicas' all-reduce). ``pipeline_step``: the whole pipeline schedule of a training step."""


class Clock(Protocol):
    """Marks points in the order work runs, and tells the seconds between two marks once they have passed."""

    def stamp(self) -> Any:
        """A mark of "now": where the work issued so far ends (an opaque value, given back to :meth:`seconds`)."""
        ...

    def is_ready(self, stamp: Any) -> bool:
        """Whether ``stamp`` has passed, so that :meth:`seconds` up to it returns without waiting."""
        ...

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` (waits until ``end`` has passed)."""
        ...


class WallClock:
    """The host's clock (``time.perf_counter``, or ``now``): right where the work runs on the calling thread (CPU,
    gloo)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now

    def stamp(self) -> float:
        return self.now()

    def is_ready(self, stamp: Any) -> bool:
        return True

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)


class PhaseListener(Protocol):
    """Receives the start and end marks of every timed phase and pipeline chunk, while subscribed, from its clock."""

    clock: Clock
    """Marks the blocks this listener is told of."""

    def on_phase(self, phase: str, start: Any, end: Any) -> None: ...

    def on_chunk(self, kind: str, stage: int, start: Any, end: Any) -> None: ...


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
        """Tell every listener the block's start and end marks (also when it raises); free when none listens.

        A block that waits for communication ends after the wait, where the work after it can start: on a GPU the
        end mark is on the current stream behind the wait, so the block's time is what compute waited for.
        """
        with self._marked(lambda listener, start, end: listener.on_phase(phase, start, end)):
            yield

    @contextmanager
    def chunk(self, kind: str, stage: int) -> Generator[None, None, None]:
        """A pipeline stage runs one chunk inside this block: ``kind`` ``"F"``/``"B"``/``"W"`` (forward, backward,
        weight gradient) of stage index ``stage``; its marks are told to every listener."""
        with self._marked(lambda listener, start, end: listener.on_chunk(kind, stage, start, end)):
            yield

    @contextmanager
    def _marked(self, tell: Any) -> Iterator[None]:
        if not self._listeners:
            yield
            return
        listeners = list(self._listeners)
        starts = [listener.clock.stamp() for listener in listeners]
        try:
            yield
        finally:
            for listener, start in zip(listeners, starts, strict=True):
                tell(listener, start, listener.clock.stamp())


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
