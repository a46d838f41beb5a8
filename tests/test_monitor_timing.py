"""Where the monitor's seconds come from (issue 36, item 6): the host's clock on CPU, CUDA events on a GPU.

The CUDA path runs here with a fake of our own event interface (``EventClock(new_event=..., current_stream=...)``):
a device whose stream reaches each recorded event at a time the test queues, and which has run up to another time.
It checks the bookkeeping: the marks are recorded on the current stream around each block, a step is read once the
device has passed its end (at the latest one step later, waiting for that event only), and nothing waits during a
step. The CPU path is timed with a host clock the test moves (a gloo wait blocks the host thread).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_parallel.instrumentation import StrategyEvents, WallClock
from lightning_parallel.monitor.timing import EventClock, PendingSteps, StepStamps, clock_for


class _FakeDevice:
    """One stream's timeline in milliseconds: ``queued`` where the next recorded event lands, ``ran`` how far the
    device has run. ``calls`` logs every event call; ``waits`` counts the synchronizes that had to wait."""

    def __init__(self) -> None:
        self.queued = 0.0
        self.ran = 0.0
        self.stream = "stream 0"
        self.calls: list[tuple[Any, ...]] = []
        self.waits = 0


class _FakeEvent:
    def __init__(self, device: _FakeDevice) -> None:
        self.device = device
        self.at: float | None = None

    def record(self, stream: Any) -> None:
        self.at = self.device.queued
        self.device.calls.append(("record", stream, self.at))

    def query(self) -> bool:
        assert self.at is not None
        self.device.calls.append(("query", self.at))
        return self.device.ran >= self.at

    def synchronize(self) -> None:
        assert self.at is not None
        self.device.calls.append(("synchronize", self.at))
        if self.device.ran < self.at:
            self.device.waits += 1
            self.device.ran = self.at

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        assert self.device.ran >= end.at, "read before the device passed the event: CUDA raises here"
        return end.at - self.at


class _Listener:
    """What ``ParallelismMonitor`` does with the strategy's events: collects one step's marks."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.stamps: StepStamps | None = None

    def on_phase(self, phase: str, start: Any, end: Any) -> None:
        assert self.stamps is not None
        self.stamps.phases.append((phase, start, end))

    def on_chunk(self, kind: str, stage: int, start: Any, end: Any) -> None:
        assert self.stamps is not None
        self.stamps.chunks.append((kind, stage, start, end))


def _pipeline_step(events: StrategyEvents, listener: _Listener, device: _FakeDevice) -> StepStamps:
    """One step as a pipeline strategy runs it on a GPU: 10 ms of host-side work before the schedule, a schedule of
    two chunks (40 + 30 ms of kernels) with 20 ms between them waiting for the neighbour stage, then the replicas'
    all-reduce: `work.wait()` returns at once on the host; the stream waits 25 ms for NCCL's."""
    listener.stamps = StepStamps(start=listener.clock.stamp())
    device.queued += 10
    with events.timed("pipeline_step"):
        with events.chunk("F", 0):
            device.queued += 40
        device.queued += 20
        with events.chunk("B", 0):
            device.queued += 30
    with events.timed("exposed_communication"):
        device.stream = "stream 0 (after the wait)"  # the end mark goes on the stream current after the wait
        device.queued += 25
    listener.stamps.end = listener.clock.stamp()
    return listener.stamps


def test_cuda_events_time_the_stream_and_are_read_a_step_later_without_waiting() -> None:
    device = _FakeDevice()
    clock = EventClock(
        torch.device("cuda", 0), new_event=lambda: _FakeEvent(device), current_stream=lambda: device.stream
    )
    events, listener = StrategyEvents(), _Listener(clock)
    events.subscribe(listener)
    pending: PendingSteps[str] = PendingSteps(clock)

    pending.add(_pipeline_step(events, listener, device), "step 0")
    assert pending.read() == []  # the device is behind: step 0 stays queued, nothing waits
    assert not [call for call in device.calls if call[0] == "synchronize"]
    records = [call for call in device.calls if call[0] == "record"]
    # 2 for the step, 2 per timed block and chunk, each on the stream current when it was marked.
    assert len(records) == 2 + 2 * 4
    assert records[-1][1] == "stream 0 (after the wait)"

    device.ran = device.queued  # the device finished step 0 while the host queues step 1
    pending.add(_pipeline_step(events, listener, device), "step 1")
    ((facts, seconds, times),) = pending.read()
    assert facts == "step 0" and device.waits == 0
    assert seconds == pytest.approx(0.125)
    assert times.exposed_communication == pytest.approx(0.025)  # what the stream waited for NCCL's
    assert times.pipeline_step == pytest.approx(0.090)
    assert times.pipeline_busy == pytest.approx(0.070)  # idle: the 20 ms between the chunks
    assert times.events == [
        ("F", 0, pytest.approx(0.010), pytest.approx(0.050)),
        ("B", 0, pytest.approx(0.070), pytest.approx(0.100)),
    ]

    # The device is still on step 1 when step 2 ends: step 1 is read now, waiting for its end event (not the device).
    pending.add(_pipeline_step(events, listener, device), "step 2")
    assert [facts for facts, _, _ in pending.read()] == ["step 1"]
    assert device.waits == 1 and len(pending) == 1
    assert [facts for facts, _, _ in pending.read(wait=True)] == ["step 2"]  # end of training: all
    assert len(pending) == 0


def test_no_listener_no_marks() -> None:
    device = _FakeDevice()
    events = StrategyEvents()
    with events.timed("exposed_communication"), events.chunk("F", 0):
        pass
    listener = _Listener(EventClock(torch.device("cuda"), new_event=lambda: _FakeEvent(device), current_stream=str))
    events.subscribe(listener)
    events.unsubscribe(listener)
    with events.timed("pipeline_step"):
        pass
    assert device.calls == []


class _HostTime:
    """The host's clock as the test moves it: work that blocks the calling thread (a gloo wait) advances it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_on_cpu_the_host_clock_times_blocking_waits() -> None:
    host = _HostTime()
    clock = WallClock(now=host)
    events, listener = StrategyEvents(), _Listener(clock)
    events.subscribe(listener)
    listener.stamps = StepStamps(start=clock.stamp())
    with events.timed("pipeline_step"), events.chunk("F", 1):
        host.now += 0.25  # a forward chunk
    with events.timed("exposed_communication"):
        host.now += 0.5  # gloo's wait blocks the calling thread
    listener.stamps.end = clock.stamp()
    pending: PendingSteps[int] = PendingSteps(clock)
    pending.add(listener.stamps, 0)
    ((_, seconds, times),) = pending.read()  # at once: the host's clock is always readable
    assert times.exposed_communication == 0.5
    assert times.pipeline_busy == 0.25 and times.pipeline_step == 0.25
    assert seconds == 0.75
    ((kind, stage, start, end),) = times.events
    assert (kind, stage, start, end) == ("F", 1, 0.0, 0.25)


def test_the_clock_follows_the_device() -> None:
    assert isinstance(clock_for(torch.device("cpu")), WallClock)
    assert isinstance(clock_for(torch.device("cuda", 1)), EventClock)  # nothing touches CUDA until a mark


def test_the_monitor_never_synchronizes_the_device() -> None:
    """A device-wide synchronize per step removed the overlap being measured; the marks are read late instead."""
    import inspect

    from lightning_parallel.monitor import callback

    assert "synchronize(" not in inspect.getsource(callback)
