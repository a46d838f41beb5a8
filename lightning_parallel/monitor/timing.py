"""Where the monitor's seconds come from on each device, and the steps whose seconds are not known yet.

On CPU the host's clock is right (:class:`~lightning_parallel.instrumentation.WallClock`): gloo's waits block the
calling thread and ops run as they are called. On a GPU it is not: ``work.wait()`` on NCCL returns at once (it only
makes the current stream wait for NCCL's), and a chunk's kernels run after Python has launched them, so host time
measures launches. :class:`EventClock` marks with CUDA events recorded on the current stream, the one compute runs
on, so a block's time is what that stream spent in it (including what it waited for on other streams).

Events can only be read once the device has passed them; reading at once would synchronize every step and remove the
overlap of communication and compute that is being measured. :class:`PendingSteps` holds each step's marks
(:class:`StepStamps`) and reads a step once its end has passed, at the latest one step later (then waiting for that
one event, not for the device), and all of them at the end of training.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from lightning_parallel.instrumentation import Clock, WallClock
from lightning_parallel.monitor.ledger import PhaseTimes

__all__ = ["EventClock", "PendingSteps", "StepStamps", "clock_for"]

T = TypeVar("T")


class EventClock:
    """Marks with CUDA events recorded on the device's current stream; reads them without synchronizing the device.

    Args:
        device: the CUDA device whose current stream is marked.
        new_event: makes one timing event (default ``torch.cuda.Event(enable_timing=True)``); anything with
            ``record(stream)``, ``query()``, ``synchronize()`` and ``elapsed_time(end)`` (milliseconds) will do.
        current_stream: the stream to record on, asked at every mark (default ``torch.cuda.current_stream(device)``).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        new_event: Callable[[], Any] | None = None,
        current_stream: Callable[[], Any] | None = None,
    ) -> None:
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._current_stream = current_stream or (lambda: torch.cuda.current_stream(device))

    def stamp(self) -> Any:
        event = self._new_event()
        event.record(self._current_stream())
        return event

    def is_ready(self, stamp: Any) -> bool:
        return bool(stamp.query())

    def seconds(self, start: Any, end: Any) -> float:
        # Both must have completed for `elapsed_time`; waiting on an event waits for that point only.
        start.synchronize()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


def clock_for(device: torch.device) -> Clock:
    """CUDA events on a CUDA device, the host's clock elsewhere (CPU: gloo's waits are real waits there)."""
    return EventClock(device) if device.type == "cuda" else WallClock()


@dataclass
class StepStamps:
    """The marks of one training step: its start and end, its timed phases and its pipeline chunks."""

    start: Any
    end: Any = None
    phases: list[tuple[str, Any, Any]] = field(default_factory=list)
    """``(phase, start, end)`` of every timed block (``instrumentation.PHASES``)."""
    chunks: list[tuple[str, int, Any, Any]] = field(default_factory=list)
    """``(kind, stage, start, end)`` of every pipeline chunk this rank ran."""

    def read(self, clock: Clock) -> tuple[float, PhaseTimes]:
        """The step's seconds and the seconds of its phases (chunks from the step's start)."""
        assert self.end is not None, "the step has not ended"
        elapsed = clock.seconds(self.start, self.end)  # first: once the end has passed, the marks before it have
        times = PhaseTimes()
        for phase, start, end in self.phases:
            seconds = clock.seconds(start, end)
            if phase == "pipeline_step":
                times.pipeline_step += seconds
            elif phase == "exposed_communication":
                times.exposed_communication += seconds
        for kind, stage, start, end in self.chunks:
            begin, finish = clock.seconds(self.start, start), clock.seconds(self.start, end)
            times.pipeline_busy += finish - begin
            times.events.append((kind, stage, begin, finish))
        return elapsed, times


class PendingSteps(Generic[T]):
    """Ended steps whose marks are not read yet, oldest first, each with what the host already knows of it (``T``).

    Args:
        clock: the clock that made the marks.
        max_unread: steps left unread after :meth:`read` when their end has not passed yet; older ones are read,
            waiting for their end mark. 1: the step that just ended, so step ``n - 1`` is read at the end of step
            ``n`` (by then the device has usually passed it, and waiting for it leaves step ``n`` queued).
    """

    def __init__(self, clock: Clock, *, max_unread: int = 1) -> None:
        self.clock = clock
        self.max_unread = max_unread
        self._pending: deque[tuple[StepStamps, T]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, stamps: StepStamps, facts: T) -> None:
        self._pending.append((stamps, facts))

    def read(self, *, wait: bool = False) -> list[tuple[T, float, PhaseTimes]]:
        """The steps that can be read now, oldest first: ``(facts, step seconds, phase times)``; ``wait``: all."""
        done = []
        while self._pending:
            stamps, facts = self._pending[0]
            if not (wait or len(self._pending) > self.max_unread or self.clock.is_ready(stamps.end)):
                break
            self._pending.popleft()
            done.append((facts, *stamps.read(self.clock)))
        return done

    def clear(self) -> None:
        self._pending.clear()
