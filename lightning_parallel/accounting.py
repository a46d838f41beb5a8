"""What a rank holds, sends and consumes: the one place that defines and measures it.

Every layer counts through this module: the torch-only building blocks (``distributed/``), the strategies'
``memory_report()``, the :class:`~lightning_parallel.ParallelismMonitor`, the planner's wire bytes, the demo's
``RunStats`` and the benchmarks. It imports torch only, so ``distributed/`` may use it without a Trainer.

* **Bytes held** (:func:`storage_bytes`, :class:`MemoryReport`, :func:`module_memory_report`): tensor storages, each
  counted once (gradients that are views into a DDP bucket count the bucket; a ``DTensor`` counts its local shard).
  Optimizer state counts tensors with at least one dim (``exp_avg``, ``momentum_buffer``, ...), not the 0-dim
  ``step`` counters (:func:`optimizer_state_tensors`).
* **Peak memory** (:func:`peak_memory_bytes`, :func:`reset_peak_memory`): max allocated on CUDA, peak RSS on CPU.
  RSS depends on the C allocator (glibc keeps freed memory unless ``MALLOC_MMAP_THRESHOLD_`` is set), so on CPU
  :class:`LiveTensorPeak` measures what training really holds: the peak bytes of live tensor storages over a region
  of code, with what held them at that moment (:class:`PeakMemory`).
* **Communication** (:class:`CommunicationStats`, :func:`ring_wire_bytes`): ``bytes`` of a collective is its *full*
  buffer on this rank (the all-reduced tensor, the unsharded input of a reduce-scatter, the gathered output of an
  all-gather, the tensor of a P2P op, the tensors of a broadcast batch); a ring algorithm puts ``2(N-1)/N`` of it on
  the wire for an all-reduce and ``(N-1)/N`` for reduce-scatter, all-gather and broadcast (a rank's average).
* **Batches** (:data:`BatchSizeFn`, :func:`default_batch_size`, :func:`default_length`): samples and tokens of a batch,
  replaceable by the caller's own functions (as Lightning's ``ThroughputMonitor(batch_size_fn, length_fn)``).
"""

from __future__ import annotations

import functools
import gc
import re
import resource
import sys
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# Private torch names, here rather than in a `_compat` module because this module may import no other part of the
# package: `TorchDispatchMode` (torch.utils._python_dispatch) sees every op's tensors, which is how
# `LiveTensorPeak` learns of each new storage (torch's own `torch.distributed._tools.MemTracker` does the same);
# `tree_flatten` (torch.utils._pytree) walks an op's nested arguments.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "COLLECTIVES",
    "BatchSizeFn",
    "CommunicationStats",
    "LiveTensorPeak",
    "MemoryReport",
    "PeakMemory",
    "batch_inputs",
    "dataset_tensors",
    "default_batch_size",
    "default_length",
    "live_tensors",
    "module_memory_report",
    "optimizer_state_tensors",
    "peak_memory_bytes",
    "reset_peak_memory",
    "resident_memory_bytes",
    "ring_wire_bytes",
    "storage_bytes",
    "tensor_bytes",
    "tensor_storages",
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


# ------------------------------------------------------------------------------------------ peak of live tensors
TensorCategories = Callable[[], Mapping[str, Iterable[Tensor]]]
"""``fn() -> {"parameters": tensors, "gradients": tensors, ...}``: what holds memory, asked at each new peak."""


@dataclass
class PeakMemory:
    """The peak bytes of live tensor storages over a region (:class:`LiveTensorPeak`), and what held them then."""

    peak_bytes: int
    """Largest sum of live storage bytes seen in the region, counting storages that existed before it."""
    start_bytes: int
    """Live storage bytes when the region began (found by the garbage collector or first used in the region)."""
    end_bytes: int
    """Live storage bytes when the region ended."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes at the moment of the peak per category of ``categories``, plus ``"other"`` for the rest (activations,
    autograd's saved tensors, temporaries, communication buffers); they sum to ``peak_bytes``. Empty without
    ``categories``."""
    cuda_max_allocated: int | None = None
    """``torch.cuda.max_memory_allocated`` over the region on a CUDA device (allocator blocks), else ``None``."""
    phase: str | None = None
    """What the code was doing at the peak: the :attr:`LiveTensorPeak.phase` label set then (``None``: none set)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "start_bytes": self.start_bytes,
            "end_bytes": self.end_bytes,
            "breakdown": dict(self.breakdown),
            "cuda_max_allocated": self.cuda_max_allocated,
            "phase": self.phase,
        }


def tensor_storages(tensor: Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``tensor``: its own, or its inner tensors' for a wrapper subclass (``DTensor``)."""
    if type(tensor) not in (Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        inner_names, _ = tensor.__tensor_flatten__()
        for name in inner_names:
            inner = getattr(tensor, name, None)
            if isinstance(inner, Tensor):
                yield from tensor_storages(inner)
        return
    if tensor.device.type != "meta":
        yield tensor.untyped_storage()


def live_tensors() -> list[Tensor]:
    """Every tensor the garbage collector finds now, and the ``.grad`` of each leaf (what :class:`LiveTensorPeak`
    counts as alive at entry)."""
    found: list[Tensor] = []
    with warnings.catch_warnings():  # `isinstance` on some module objects warns (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, Tensor):
                    continue
                grad = obj.grad if obj.is_leaf else None  # a non-leaf's `.grad` warns and is None
            except (RuntimeError, AttributeError, TypeError, NotImplementedError):
                continue
            found.append(obj)
            if grad is not None:
                found.append(grad)
    return found


def dataset_tensors(data: Any, *, max_depth: int = 5) -> list[Tensor]:
    """The tensors a dataset or data loader (or a list or dict of them) holds in memory: its attributes' tensors, and
    those of the containers and datasets it wraps (``DataLoader.dataset``, ``Subset.dataset``,
    ``ConcatDataset.datasets``, lists, tuples and dicts of them), to ``max_depth`` levels.

    What :class:`LiveTensorPeak`'s ``exclude`` leaves out of a training step's peak: a GPU run keeps its data set on the
    host, and a data set's size is the user's choice, not what a strategy costs (the demo's 400 kB corpus, held as
    int64 tokens, is 3 MiB: 2.5% of its data-parallel peak).
    """
    found: dict[int, Tensor] = {}
    seen: set[int] = set()

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, Tensor):
            found.setdefault(id(value), value)
            return
        if depth > max_depth or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, nn.Module)):
            return
        seen.add(id(value))
        if isinstance(value, Mapping):
            children: Iterable[Any] = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            children = getattr(value, "__dict__", {}).values()
        for child in children:
            visit(child, depth + 1)

    visit(data, 0)
    return list(found.values())


class LiveTensorPeak(TorchDispatchMode):
    """Context manager: the peak bytes of live tensor storages while it is entered, exact and allocator-independent.

    Every storage is counted once with its full size (a view counts its base; a ``DTensor`` its local shard), from
    the moment an op creates it until it is freed (a weak reference on the storage says when). Storages alive at
    entry that the garbage collector finds (tensors and their ``.grad``) count from the start; one held only in C++
    (DDP's buckets) counts from the first op that uses it. Not counted: memory that never becomes a tensor seen by
    a torch op on this thread (a communication library's internal buffers, the C allocator's overhead). On CUDA,
    ``torch.cuda.max_memory_allocated`` over the region is reported next to it.

    It sees each op through a ``TorchDispatchMode``, a Python call per op: cheap around a few training steps
    (forward, backward and optimizer step), not meant to stay on for a whole run.

    Args:
        categories: asked at each new peak for the tensors of each category (e.g. ``"parameters"``, ``"gradients"``,
            ``"optimizer_state"``); the bytes of live storages in each are the :attr:`PeakMemory.breakdown` at the
            peak (a storage in several categories counts in the first). ``None``: no breakdown, no extra cost.
        device: a CUDA device also resets and reads its allocator's peak.
        exclude: tensors whose storages never count, asked once at entry: the training data a dataset holds in memory
            (:func:`dataset_tensors`), which a GPU run keeps on the host and which is not what a strategy costs.

    Set :attr:`phase` (``"forward"``, ``"backward"``, ``"optimizer_step"``, ...) while inside the region to learn
    in which phase the peak happened (:attr:`PeakMemory.phase`).

    Example::

        with LiveTensorPeak(categories=lambda: {"parameters": model.parameters()}) as peak:
            loss = model(x).sum()
            loss.backward()
        print(peak.result().peak_bytes)
    """

    def __init__(
        self,
        *,
        categories: TensorCategories | None = None,
        device: torch.device | None = None,
        exclude: Callable[[], Iterable[Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self.categories = categories
        self.device = device
        self.exclude = exclude
        self._excluded: set[int] = set()  # storage keys that never count
        self._live: dict[int, tuple[int, weakref.ref]] = {}  # storage key -> (bytes, weak reference)
        self._current = self._peak = self._start = 0
        self._breakdown: dict[str, int] = {}
        self._result: PeakMemory | None = None
        self._scanning = False
        self._original_resize: Any = None
        self.phase: str | None = None
        """A label of what runs now; the one set at the moment of the peak is reported."""
        self._peak_phase: str | None = None

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, storage: torch.UntypedStorage, *, existed: bool) -> None:
        key = storage._cdata  # the StorageImpl's address: one per storage, whichever Python object wraps it
        if key in self._excluded:
            return
        nbytes = storage.nbytes()
        known = self._live.get(key)
        if known is not None:
            if known[0] != nbytes:  # resized in place (`resize_`, an `out=` op)
                self._current += nbytes - known[0]
                self._live[key] = (nbytes, known[1])
            return
        self._live[key] = (nbytes, weakref.ref(storage, functools.partial(self._on_free_ref, key)))
        self._current += nbytes
        if existed:  # found at entry: part of every moment of the region
            self._start += nbytes
            self._peak += nbytes

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        """A storage resized in place outside any op (FSDP2 frees and re-allocates its gathered parameters so)."""
        known = self._live.get(storage._cdata)
        if known is not None and known[0] != storage.nbytes():
            self._current += storage.nbytes() - known[0]
            self._live[storage._cdata] = (storage.nbytes(), known[1])
            self._record_peak()

    def _on_free_ref(self, key: int, _ref: weakref.ref) -> None:
        self._on_free(key)

    def _on_free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._current -= entry[0]

    def _attribute(self, keys: Iterable[int]) -> dict[str, int]:
        """Bytes of the live storages ``keys`` per category (first category wins), the rest under ``"other"``."""
        assert self.categories is not None
        remaining = {key: self._live[key][0] for key in keys if key in self._live}
        breakdown: dict[str, int] = {}
        for name, tensors in self.categories().items():
            total = 0
            for tensor in tensors:
                for storage in tensor_storages(tensor):
                    total += remaining.pop(storage._cdata, 0)
            breakdown[name] = breakdown.get(name, 0) + total
        breakdown["other"] = sum(remaining.values())
        return breakdown

    def _record_peak(self) -> None:
        if self._current > self._peak:
            self._peak = self._current
            self._peak_phase = self.phase
            if self.categories is not None:
                # A copy of the keys: a storage freed meanwhile (by `categories()`) leaves `_live` as we iterate.
                self._breakdown = self._attribute(list(self._live))

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # A storage first seen here (input or output) counts from now on. One seen first as an input was made
        # where no op of this thread shows it (C++-held buffers such as DDP's buckets, a communication library's
        # copies on its own thread): counting it from now rather than from the region's start never overstates the
        # peak with a temporary made mid-region.
        for tensor in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(tensor, Tensor):
                for storage in tensor_storages(tensor):
                    self._add(storage, existed=False)
        self._record_peak()
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, Tensor):
                for storage in tensor_storages(tensor):
                    self._add(storage, existed=False)
        self._record_peak()
        return out

    def __enter__(self) -> LiveTensorPeak:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        gc.collect()
        if self.exclude is not None:  # held for the whole region, so their keys stay theirs
            self._excluded = {storage._cdata for tensor in self.exclude() for storage in tensor_storages(tensor)}
        self._scanning = True
        for tensor in live_tensors():
            try:
                for storage in tensor_storages(tensor):
                    self._add(storage, existed=True)
            except (RuntimeError, AttributeError, TypeError, NotImplementedError):
                continue  # a tensor without storage (sparse, functional or fake tensors)
        self._scanning = False
        self._result = None
        if self.categories is not None:
            self._breakdown = self._attribute(list(self._live))
        # `UntypedStorage.resize_` is not an op the dispatch mode sees; FSDP2 frees a unit's gathered parameters
        # with `resize_(0)` and re-allocates them with `resize_(n)`. Wrapped for the region only (restored on exit).
        # No public hook or dispatcher op reports it, which is why torch's own MemTracker wraps it the same way
        # (torch/distributed/_tools/mem_tracker.py); allow-listed in tests/test_no_patching.py.
        self._original_resize = original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            self._on_resize(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        cuda_peak = None
        if self.device is not None and self.device.type == "cuda":
            cuda_peak = int(torch.cuda.max_memory_allocated(self.device))
        self._result = PeakMemory(
            peak_bytes=self._peak,
            start_bytes=self._start,
            end_bytes=self._current,
            breakdown=dict(self._breakdown),
            cuda_max_allocated=cuda_peak,
            phase=self._peak_phase,
        )
        self._live = {}  # dropping the weak references stops their callbacks: nothing counts after the region
        self._excluded = set()

    def result(self) -> PeakMemory:
        """The region's :class:`PeakMemory`; available once the context has exited."""
        if self._result is None:
            raise RuntimeError("LiveTensorPeak.result() is available after the `with` block has exited.")
        return self._result


# ------------------------------------------------------------------------------------------------- communication
COLLECTIVES: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather", "send", "recv", "broadcast")
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
