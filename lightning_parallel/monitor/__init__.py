"""ParallelismMonitor: what a parallel run really holds, sends and spends its time on, per rank and per step."""

from lightning_parallel.monitor.callback import ParallelismMonitor, StepRecord
from lightning_parallel.monitor.figure import write_figure
from lightning_parallel.monitor.ledger import COLLECTIVES, CollectiveTap, ring_wire_bytes
from lightning_parallel.monitor.report import format_table

__all__ = [
    "COLLECTIVES",
    "CollectiveTap",
    "ParallelismMonitor",
    "StepRecord",
    "format_table",
    "ring_wire_bytes",
    "write_figure",
]
