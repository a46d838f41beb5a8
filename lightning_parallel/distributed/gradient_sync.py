"""One gradient-sync protocol for every way a strategy holds gradients, parameters and optimizer state over ranks.

A strategy chooses one implementation once in ``setup`` and calls only this protocol afterwards; it never asks which
one it holds (DeepSpeed picks its ZeRO optimizer once in the same way). The protocol is torch-only: no Lightning
type appears in it, so the same implementations serve ``ShardedOptimizerStrategy`` (through thin Lightning adapters
for precision plugins) and ``PipelineParallelStrategy``.

Implementations:

* flat buckets (ZeRO-1/2): parameters in flat buckets, reduce-scattered as backward produces gradients (or after a
  pipeline schedule), the optimizer stepping this rank's shard, then the buckets all-gathered;
* fully-shard (ZeRO-3): torch's FSDP2 ``fully_shard`` units reduce-scatter during backward;
* replicated (ZeRO off): each rank holds everything; gradients averaged over the replicas by an all-reduce (and, in
  a pipeline, the copies of tied weights summed over the stages that hold them).

Every method says whether it is *collective* (every rank of the sync's groups must call it, in the same order) or
*local*.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.accounting import MemoryReport

__all__ = ["GradientSync"]


class GradientSync(Protocol):
    """How gradients are reduced and parameters brought up to date across ranks; built once per ``setup``."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Local. Context: no gradient communication (non-final micro-batches of a gradient-accumulation window)."""

    def reduce_gradients(self) -> Iterable[Tensor]:
        """Collective. Finish the gradient sync of the last backward: afterwards every rank holds the reduced
        gradients of what it steps. Returns gradient holders beside the parameters' ``.grad`` to drop when the step
        is skipped (a non-finite loss)."""

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Collective. torch's ``clip_grad_norm_`` over ``optimizer``'s parameters, with the norm over every rank of
        the mesh that holds a part of them (shards, stages; tied copies counted once). Returns the total norm."""

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Collective. Bring every rank's parameters up to date after ``optimizer`` stepped (or start doing so:
        then :meth:`wait_for_parameters` finishes it)."""

    def wait_for_parameters(self, *, everywhere: bool = True) -> None:
        """Local. Finish bringing the parameters up to date: all of them, or (``everywhere=False``, before a training
        step) those read outside the forward pre-hooks that wait for the rest."""

    def gradient_buffers(self) -> list[Tensor]:
        """Local. Gradient tensors held beside the parameters' ``.grad`` (ZeRO-1/2 buckets), now."""

    def memory_report(self, optimizers: Sequence[Optimizer]) -> MemoryReport:
        """Local. Bytes this rank holds: parameters, gradients and ``optimizers``' state (summed)."""

    def abandon_in_flight(self) -> None:
        """Local. Training failed: forget collectives still in flight without waiting for them (a failed peer never
        completes them), so the teardown that follows cannot hang."""

    def teardown(self) -> None:
        """Local. Stop hooking the module; keep what :meth:`memory_report` needs after the run."""
