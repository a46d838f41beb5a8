"""In-rank measurements for the ZeRO benchmark: communicated bytes and the bytes of state each rank holds.

:class:`ZeroProbe` is a Lightning callback. In every rank it installs, for the duration of ``fit``, a counting shim
around torch's collectives (the same shim for our strategy and for the anchors, so both are measured the same way):
``all_reduce``, ``broadcast``, ``all_gather_single`` and ``reduce_scatter_single``. The deprecated spellings
(``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``_all_gather_base``, ...) call the last two through
``torch.distributed.distributed_c10d``'s module globals, so the shim replaces each function both there and in the
``torch.distributed`` namespace and every call is counted exactly once. Lightning's DDP reduces gradients from C++,
invisible to a Python shim: the benchmark therefore gives DDP torch's stock ``allreduce_hook`` (documented as
equivalent to the built-in all-reduce), which calls ``torch.distributed.all_reduce``.

Each call is counted twice: its payload (the full tensor: an all-reduce's tensor, a reduce-scatter's input, an
all-gather's output, a broadcast's tensor) and the bytes the rank receives under the standard bandwidth-optimal
algorithms, which is what makes "reduce-scatter + all-gather moves the same bytes as all-reduce" a measurable
statement: all-reduce ``2 (N - 1) / N * S``, reduce-scatter and all-gather ``(N - 1) / N * S``, broadcast ``S`` on
every rank but the source. Counting starts with the first measured batch (after ``warmup_steps``, as
:class:`~lightning_parallel.demos.stats.RunStats` does) and stops when training ends; figures are per optimizer step.

After the last step it also measures the bytes of parameters, gradients and optimizer state the rank holds: our
strategy's own ``memory_report()``; for the anchors the storages of ``module.parameters()``, their ``.grad`` and
the optimizer's state tensors (the local optimizer's for ``ZeroRedundancyOptimizer``; the local shards of DTensors).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from lightning.pytorch.callbacks import Callback
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.accounting import module_memory_report, resident_memory_bytes, tensor_bytes

__all__ = ["PROBE_FIELDS", "PROBE_PREFIX", "ZeroProbe", "read_probe"]

PROBE_PREFIX = "zero_probe/"
"""Prefix of the keys :class:`ZeroProbe` writes into ``trainer.callback_metrics``."""

PROBE_FIELDS = (
    "received_bytes",
    "all_reduce_bytes",
    "reduce_scatter_bytes",
    "all_gather_bytes",
    "broadcast_bytes",
    "parameter_bytes",
    "gradient_bytes",
    "optimizer_state_bytes",
    "rss_at_setup",
)
"""Per-rank values; the byte counts of collectives are per optimizer step; ``rss_at_setup`` is the process's resident
set size when ``fit`` set up (what the forked rank inherited), the start of ``RunStats``' peak-memory window."""

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single")
_GROUP_POSITION = {"all_reduce": 2, "broadcast": 2, "all_gather_single": 2, "reduce_scatter_single": 3}
"""Index of each collective's positional ``group`` argument."""


class _Counter:
    """Bytes counted by the shim while :attr:`active`."""

    def __init__(self) -> None:
        self.active = False
        self.bytes: dict[str, float] = dict.fromkeys(PROBE_FIELDS[:5], 0.0)

    def add(self, name: str, payload: int, received: float) -> None:
        if self.active:
            self.bytes[name] += payload
            self.bytes["received_bytes"] += received


def _counting(name: str, original: Callable[..., Any], counter: _Counter) -> Callable[..., Any]:
    """Wrap collective ``name`` so that each call adds its payload and received bytes to ``counter``."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        position = _GROUP_POSITION[name]
        group = args[position] if len(args) > position else kwargs.get("group")
        world_size = dist.get_world_size(group)
        share = (world_size - 1) / world_size
        if name == "all_reduce":
            size = tensor_bytes(args[0] if args else kwargs["tensor"])
            counter.add("all_reduce_bytes", size, 2 * share * size)
        elif name == "broadcast":
            size = tensor_bytes(args[0] if args else kwargs["tensor"])
            src = args[1] if len(args) > 1 else kwargs.get("src")
            counter.add("broadcast_bytes", size, 0 if src == dist.get_rank() else size)
        elif name == "all_gather_single":
            size = tensor_bytes(args[0] if args else kwargs["output_tensor"])  # the gathered (full) tensor
            counter.add("all_gather_bytes", size, share * size)
        else:  # reduce_scatter_single
            size = tensor_bytes(args[1] if len(args) > 1 else kwargs["input"])  # the full tensor before scattering
            counter.add("reduce_scatter_bytes", size, share * size)
        return original(*args, **kwargs)

    return wrapper


def held_bytes(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[int, int, int]:
    """Bytes of ``(parameters, gradients, optimizer state)`` this rank holds now."""
    report = getattr(trainer.strategy, "memory_report", None)
    if callable(report):  # ShardedOptimizerStrategy measures its own flat buckets and shards
        measured = report()
        return measured.parameters, measured.gradients, measured.optimizer_state
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim  # the local optimizer over this rank's partition
    measured = module_memory_report(pl_module, optimizer)
    return measured.parameters, measured.gradients, measured.optimizer_state


class ZeroProbe(Callback):
    """Count communicated bytes per optimizer step and measure held state bytes, in every rank (see module doc).

    Results are all-gathered at the end of training and written into ``trainer.callback_metrics`` (which Lightning's
    fork launcher brings back to the parent) as ``zero_probe/<field>_rank<r>``; read them with :func:`read_probe`.

    Args:
        warmup_steps: Training batches before counting starts; use the same value as ``RunStats``.
    """

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self._counter = _Counter()
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []
        self._batches_seen = 0
        self._start_step = 0
        self._held = (0, 0, 0)
        self._rss_at_setup = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._saved:
            return
        self._rss_at_setup = resident_memory_bytes()
        self._counter, self._batches_seen = _Counter(), 0
        for name in _COLLECTIVES:
            original = getattr(c10d, name)
            wrapper = _counting(name, original, self._counter)
            for namespace in (c10d, dist):
                self._saved.append((namespace, name, getattr(namespace, name)))
                setattr(namespace, name, wrapper)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):  # Lightning registers no comm hook on CPU; see module doc
            model.register_comm_hook(state=None, hook=allreduce_hook)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for namespace, name, original in reversed(self._saved):
            setattr(namespace, name, original)
        self._saved.clear()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._batches_seen == self.warmup_steps:
            self._counter.active = True
            self._start_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches_seen += 1
        if self._counter.active:
            active, self._counter.active = True, False  # our memory_report may not communicate, but be safe
            self._held = held_bytes(trainer, pl_module)
            self._counter.active = active

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counter.active = False
        steps = max(trainer.global_step - self._start_step, 1)
        comm = [self._counter.bytes[name] / steps for name in PROBE_FIELDS[:5]]
        local = torch.tensor([*comm, *self._held, self._rss_at_setup], dtype=torch.float64)
        if trainer.world_size > 1:
            parts = [torch.empty_like(local) for _ in range(trainer.world_size)]
            dist.all_gather(parts, local)  # the list form: not counted (and counting is off)
            gathered = torch.stack(parts)  # (world_size, num_fields)
        else:
            gathered = local.unsqueeze(0)
        for rank, row in enumerate(gathered):
            for name, value in zip(PROBE_FIELDS, row.tolist(), strict=True):
                trainer.callback_metrics[f"{PROBE_PREFIX}{name}_rank{rank}"] = torch.tensor(value, dtype=torch.float64)


def read_probe(trainer: pl.Trainer) -> dict[str, list[float]]:
    """Field -> per-rank values that :class:`ZeroProbe` left in ``trainer.callback_metrics`` (also in the parent)."""
    metrics = trainer.callback_metrics
    result: dict[str, list[float]] = {}
    for name in PROBE_FIELDS:
        values, rank = [], 0
        while f"{PROBE_PREFIX}{name}_rank{rank}" in metrics:
            values.append(float(metrics[f"{PROBE_PREFIX}{name}_rank{rank}"]))
            rank += 1
        if not values:
            raise RuntimeError(f"No ZeroProbe results in `trainer.callback_metrics` (missing `{name}`).")
        result[name] = values
    return result
