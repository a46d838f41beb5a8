"""What a rank holds, sends and consumes: the one place that defines and measures it.

Every layer counts through this module: the torch-only building blocks (``distributed/``), the strategies'
``memory_report()``, the :class:`~lightning_parallel.ParallelismMonitor`, the planner's wire bytes, the demo's
``RunStats`` and the benchmarks. It imports torch only, so ``distributed/`` may use it without a Trainer.

* **Bytes held** (:func:`storage_bytes`, :class:`MemoryReport`, :func:`module_memory_report`): tensor storages, each
  counted once (gradients that are views into a DDP bucket count the bucket; a ``DTensor`` counts its local shard).
  Optimizer state counts tensors with at least one dim (``exp_avg``, ``momentum_buffer``, ...), not the 0-dim
  ``step`` counters (:func:`optimizer_state_tensors`).
* **Peak memory** (:func:`peak_memory_bytes`, :func:`reset_peak_memory`): max allocated on CUDA, peak RSS on CPU.
* **Communication** (:class:`CommunicationStats`, :func:`ring_wire_bytes`): ``bytes`` of a collective is its *full*
  buffer on this rank (the all-reduced tensor, the unsharded input of a reduce-scatter, the gathered output of an
  all-gather, the tensor of a P2P op); a ring algorithm puts ``2(N-1)/N`` of it on the wire for an all-reduce and
  ``(N-1)/N`` for reduce-scatter and all-gather.
* **Batches** (:data:`BatchSizeFn`, :func:`default_batch_size`, :func:`default_length`): samples and tokens of a batch,
  replaceable by the caller's own functions (as Lightning's ``ThroughputMonitor(batch_size_fn, length_fn)``).
"""

from __future__ import annotations

import re
import resource
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "COLLECTIVES",
    "BatchSizeFn",
    "CommunicationStats",
    "MemoryReport",
    "batch_inputs",
    "default_batch_size",
    "default_length",
    "module_memory_report",
    "optimizer_state_tensors",
    "peak_memory_bytes",
    "reset_peak_memory",
    "resident_memory_bytes",
    "ring_wire_bytes",
    "storage_bytes",
    "tensor_bytes",
]

# ---------------------------------------------------------------------------------------------------- bytes held


def tensor_bytes(tensor: Tensor) -> int:
    """Bytes of ``tensor``'s elements (not of its storage)."""
    return tensor.numel() * tensor.element_size()


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``; a ``DTensor`` counts its local shard."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
) -> Iterator[Tensor]:
    """The per-element state tensors (at least one dim) of ``optimizers``; 0-dim ``step`` counters are skipped."""
    if optimizers is None:
        return
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, Tensor) and v.dim() > 0)


@dataclass
class MemoryReport:
    """Bytes this rank really holds, measured from its tensors' storages (each storage counted once)."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "total": self.total,
        }


def module_memory_report(
    module: nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None
) -> MemoryReport:
    """Bytes of ``module``'s parameters, their ``.grad`` and the per-element state of ``optimizer`` (one or several)
    on this rank; a sharded parameter (``DTensor``) counts its local shard."""
    params = list(module.parameters())
    grads = (p.grad for p in params if p.grad is not None)
    return MemoryReport(
        parameters=storage_bytes(params),
        gradients=storage_bytes(grads),
        optimizer_state=storage_bytes(optimizer_state_tensors(optimizer)),
    )


# --------------------------------------------------------------------------------------------------- peak memory
_VM_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)
_VM_RSS = re.compile(r"^VmRSS:\s+(\d+)\s+kB", re.MULTILINE)


def _proc_status_bytes(pattern: re.Pattern[str]) -> int | None:
    try:
        match = pattern.search(Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match is not None else None


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of this process in bytes.

    Args:
        device: On a CUDA device, the peak of ``torch.cuda.max_memory_allocated``; otherwise (CPU) the process's peak
            resident set size: ``VmHWM`` from ``/proc/self/status``, or ``resource.getrusage`` where there is no
            ``/proc``.
    """
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _proc_status_bytes(_VM_HWM)
    if peak is not None:
        return peak
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(max_rss) if sys.platform == "darwin" else int(max_rss) * 1024


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak-memory window now, so peaks of earlier work in this process (or its parent) are not counted."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        # "5" resets VmHWM to the current RSS (Linux >= 4.0, see `man 5 proc`, /proc/pid/clear_refs).
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # getrusage's peak cannot be reset; the window then starts at process start


def resident_memory_bytes() -> int:
    """This process's current resident set size (``VmRSS``), or 0 where there is no ``/proc``."""
    return _proc_status_bytes(_VM_RSS) or 0


# ------------------------------------------------------------------------------------------------- communication
COLLECTIVES: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather", "send", "recv")
"""The collective names the ledger uses."""


@dataclass
class CommunicationStats:
    """Bytes handed to collectives by our code, per collective type (the definition is in the module docstring).

    ``bytes_by_collective`` holds payload bytes (the size of the tensors passed to the collective on this rank),
    which is what a backend's ring or tree algorithm then moves ``~2(N-1)/N`` times (:func:`ring_wire_bytes`).
    """

    bytes_by_collective: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Payload bytes per collective name (``"all_reduce"``, ...) since the last :meth:`reset`."""
    calls: int = 0
    """Number of collective calls since the last :meth:`reset`."""

    def record(self, collective: str, num_bytes: int) -> None:
        self.bytes_by_collective[collective] += num_bytes
        self.calls += 1

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_collective.values())

    def reset(self) -> None:
        self.bytes_by_collective = defaultdict(int)
        self.calls = 0


def ring_wire_bytes(collective: str, num_bytes: int, world_size: int) -> float:
    """Bytes a rank puts on the wire for ``num_bytes`` of ``collective`` under a ring algorithm of ``world_size``."""
    if collective in ("send", "recv"):
        return float(num_bytes)
    if world_size <= 1:
        return 0.0
    factor = 2.0 if collective == "all_reduce" else 1.0
    return factor * (world_size - 1) / world_size * num_bytes


# ------------------------------------------------------------------------------------------------------- batches
BatchSizeFn = Callable[[Any], int]
"""``fn(batch) -> int``: samples (``batch_size_fn``) or tokens (``length_fn``) of one local batch."""


def batch_inputs(batch: Any) -> Tensor | None:
    """The input tensor of a batch: the first element of a tuple/list, ``input_ids``/``inputs`` of a dict, or itself."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        return batch[0]
    if isinstance(batch, Mapping):
        for key in ("input_ids", "inputs", "input"):
            if isinstance(batch.get(key), Tensor):
                return batch[key]
    return None


def default_batch_size(batch: Any) -> int:
    """Samples of a batch: dim 0 of its input tensor (:func:`batch_inputs`); 0 when there is none or it is a scalar."""
    inputs = batch_inputs(batch)
    return int(inputs.shape[0]) if inputs is not None and inputs.dim() > 0 else 0


def default_length(batch: Any) -> int:
    """Tokens of a batch: elements of its input tensor when it has a sequence dim (``(B, T, ...)``), else 0."""
    inputs = batch_inputs(batch)
    return int(inputs.numel()) if inputs is not None and inputs.dim() >= 2 else 0
