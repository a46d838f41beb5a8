"""ZeRO-3's collectives on gloo, given to FSDP2 through its public ``set_custom_all_gather`` and
``set_custom_reduce_scatter``: parameter all-gathers built from broadcasts, gradient reductions kept in flight.

Why our own, not FSDP2's: on gloo both of FSDP2's collectives are the slow ones. Its all-gather: gloo's
``all_gather_into_tensor`` takes about three times as long as one broadcast per rank
(``distributed/gloo_collectives.py``: 20.5M fp32 elements at 2 ranks, 27 against 85 ms); :class:`GlooAllGather`
broadcasts (FSDP2 has already copied this rank's shard into its slice of the output) and hands FSDP2 one ``Work``, also
when FSDP2 asks for a synchronous gather, so FSDP2 waits for it only at its copy-out; with :class:`ForwardPrefetch` each
unit's forward starts the next unit's gather, which then moves while this unit computes (FSDP2 overlaps forward gathers
through CUDA streams only; backward it prefetches itself). Its reduce-scatter: FSDP2 (torch 2.13) calls it synchronously
and ignores what it returns, so on gloo every unit's reduction blocks backward, and gloo's ``reduce_scatter_tensor`` is
slower than its all-reduce (``distributed/zero/buckets.py``, ``default_gradient_reduction``; stages 1-2 all-reduce and
slice on gloo for the same reason). :class:`GlooGradientReduction` gives each unit an object with FSDP2's
``ReduceScatter`` interface (``allocate(size, *, dtype, device)``, ``__call__(output_tensor, input_tensor, group,
op)``). Measured (``benchmarks/zero3_async_reduce.py``, 13.8M-parameter GPT, 2 gloo ranks): 0.89-0.93x FSDP2's step
time, bit-identical weights.

The call starts an exchange (``distributed/gloo_collectives.py``, :func:`reduce_scatter_by_exchange`): each rank
sends every other rank that rank's slice of FSDP2's input (the unit's whole gradients, laid out rank by rank) and
receives its own slice from each, into FSDP2's output (at two ranks; into shard-sized buffers from the others); a
reduce-scatter's bytes, where the async all-reduce used before (gloo's ``reduce_scatter_tensor`` being slower still)
moved twice as many. The received slices are summed into the output with this rank's own, in rank order, and divided
by the group size later: when more than ``max_in_flight`` reductions are in flight (memory: each holds its unit's
whole gradients), and at the end of the backward (an autograd end-of-backward callback, queued at the first deferred
reduction, which runs before ``backward()`` returns and so before any hook, clipping or optimizer step reads a
gradient).

FSDP2 assigns each sharded parameter's ``.grad`` as a view of that output without reading it, except in cases that
read it at once; a reduction is completed before the call returns (no overlap) when
any holds, checked at every call:

* the unit's group is HSDP (``replicated``: an all-reduce across replica groups follows on the output),
* the op is not ``AVG`` (FSDP2 then divides the output itself: fp16 reductions, a custom divide factor),
* the gradients are reduced in another dtype than the sharded parameters' (FSDP2 casts the output),
* a sharded parameter already has a ``.grad`` (FSDP2 adds the output to it: no ``zero_grad`` between two
  backwards, or a second backward in one step), or a post-accumulate-grad hook, or is offloaded to CPU,
* the unit has an all-reduce hook (``FSDPModule.set_all_reduce_hook``), or no backward is running.

Every call posts its messages at once, in FSDP2's order, on every rank: deferring changes only when a rank sums its
slice, never which messages are sent or their order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.accounting import CommunicationStats
from lightning_parallel.distributed.gloo_collectives import (
    ReduceScatterExchange,
    all_gather_by_broadcasts,
    reduce_scatter_by_exchange,
)
from lightning_parallel.distributed.zero.stage3_compat import (
    has_all_reduce_hook,
    post_accumulate_grad_hooks,
    queue_at_end_of_backward,
    sharded_gradient_params,
)

__all__ = ["ForwardPrefetch", "GlooAllGather", "GlooGradientReduction", "install_gloo_collectives"]


def install_gloo_collectives(
    units: Sequence[FSDPModule],
    group: dist.ProcessGroup | None,
    *,
    replicated: bool,
    stats: CommunicationStats | None = None,
) -> GlooGradientReduction | None:
    """On gloo with more than one rank in ``group`` (the units' shard group), give every unit the broadcast
    all-gather and the in-flight gradient reduction, and return the reduction (its owner finishes or abandons it);
    elsewhere (NCCL, one rank) leave FSDP2's own collectives and return ``None``. ``replicated``: HSDP (an all-reduce
    across replica groups follows each reduction, which is then never deferred). ``stats``: see :class:`GlooAllGather`.
    """
    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) == 1:
        return None
    GlooAllGather(stats).install(units)
    ForwardPrefetch(units)
    reduction = GlooGradientReduction(stats=stats)
    reduction.install(units, replicated=replicated)
    return reduction


def _allocate(size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """FSDP2's ``Comm.allocate``: a plain uninitialised tensor."""
    return torch.empty(*size, dtype=dtype, device=device)


class GlooAllGather:
    """FSDP2's parameter all-gather as one async broadcast per rank (FSDP2's ``AllGather`` interface).

    Args:
        stats: where to count each all-gather's output bytes as ``"all_gather"`` (the monitor's tap counts FSDP2's own
            collectives; it does not see these broadcasts as one); ``None``: not counted.
    """

    def __init__(self, stats: CommunicationStats | None = None) -> None:
        self.stats = stats

    def install(self, units: Sequence[FSDPModule]) -> None:
        """Make every unit all-gather its parameters through this object."""
        for unit in units:
            unit.set_custom_all_gather(cast(Any, self))

    allocate = staticmethod(_allocate)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = output_tensor.view(-1)[rank * input_tensor.numel() : (rank + 1) * input_tensor.numel()]
        if mine.data_ptr() != input_tensor.data_ptr():  # FSDP2 copies in place; anything else gets copied here
            mine.copy_(input_tensor.view(-1))
        assert output_tensor.numel() == size * input_tensor.numel()
        if self.stats is not None:
            self.stats.record("all_gather", output_tensor.numel() * output_tensor.element_size())
        # Returned even when FSDP2 asks for a synchronous gather (its default, `unshard_async_op=False`): FSDP2 waits
        # on any `Work` it gets back before its copy-out (`foreach_all_gather_copy_out`), so the broadcasts run in
        # gloo's threads while this rank computes until then (a prefetched unit's gather: during the unit before).
        return all_gather_by_broadcasts(output_tensor, group)


class ForwardPrefetch:
    """Each unit starts the next unit's all-gather in its forward (FSDP2's public ``set_modules_to_forward_prefetch``),
    in the order the units ran in the first forward.

    Why: FSDP2 overlaps a unit's all-gather with the previous unit's forward only through CUDA streams; on the CPU the
    gather is issued at the unit's own pre-forward and waited for at once. With a prefetch issued one unit ahead (and
    :class:`GlooAllGather` returning its ``Work``), gloo's threads move the next unit's parameters while this one
    computes. Backward needs nothing: FSDP2 prefetches there itself (the next unit in reverse forward order).

    The order is recorded by forward pre-hooks until a unit runs a second time (the second forward, or a unit called
    twice in one forward), then the hooks are removed. A unit prefetched and not run (a later forward taking another
    path) is waited for and freed by FSDP2 at the end of backward. Every rank runs the same forward, so every rank
    issues the same gathers in the same order. Costs one unit's gathered parameters more at a time in forward.
    """

    def __init__(self, units: Sequence[FSDPModule]) -> None:
        self.order: list[FSDPModule] = []
        self._handles = [cast(Any, unit).register_forward_pre_hook(self._record) for unit in units]

    def _record(self, unit: Any, args: Any) -> None:
        if any(seen is unit for seen in self.order):
            self._apply()
            return
        self.order.append(unit)

    def _apply(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit, following in zip(self.order, self.order[1:], strict=False):
            unit.set_modules_to_forward_prefetch([following])


@dataclass
class _InFlight:
    exchange: ReduceScatterExchange
    output: Tensor  # (shard_numel,): FSDP2's output, which the sharded `.grad`s view
    world_size: int
    average: bool

    def complete(self) -> None:
        self.exchange.finish()
        if self.average:
            self.output.div_(self.world_size)


class GlooGradientReduction:
    """The gradient reductions of every FSDP2 unit of one module: exchanges kept in flight through backward.

    Args:
        max_in_flight: reductions in flight at once (each holds its unit's whole gradients).
        stats: see :attr:`stats`.
    """

    def __init__(self, *, max_in_flight: int = 2, stats: CommunicationStats | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"`max_in_flight={max_in_flight!r}` must be at least 1.")
        self.max_in_flight = max_in_flight
        self.stats = stats
        """Where each reduction's input bytes are counted as ``"reduce_scatter"`` (the monitor's tap does not see the
        point-to-point messages as one); ``None``: not counted."""
        self._in_flight: deque[_InFlight] = deque()
        self._finish_queued = False

    def install(self, units: Sequence[FSDPModule], *, replicated: bool) -> None:
        """Make every unit reduce its gradients through this object (``replicated``: HSDP, never deferred)."""
        for unit in units:
            unit.set_custom_reduce_scatter(cast(Any, _UnitReduction(self, unit, replicated=replicated)))

    @property
    def in_flight(self) -> int:
        """Reductions started and not yet copied into their outputs."""
        return len(self._in_flight)

    def finish(self) -> None:
        """Wait for every reduction in flight and fill its output. Local; runs at the end of each backward."""
        self._finish_queued = False
        while self._in_flight:
            self._in_flight.popleft().complete()

    def abandon(self) -> None:
        """Training failed: forget the reductions in flight without waiting (a failed peer never completes them)."""
        self._in_flight.clear()
        self._finish_queued = False

    def _start(self, reduction: _InFlight, *, deferrable: bool) -> None:
        if deferrable and not self._finish_queued:
            self._finish_queued = queue_at_end_of_backward(self.finish)
            deferrable = self._finish_queued
        self._in_flight.append(reduction)
        if not deferrable:
            self.finish()  # this one and every older one: FSDP2 reads this output before the call returns
            return
        while len(self._in_flight) > self.max_in_flight:
            self._in_flight.popleft().complete()


class _UnitReduction:
    """What FSDP2 calls in place of ``reduce_scatter_tensor`` for one unit (its ``ReduceScatter`` interface)."""

    def __init__(self, owner: GlooGradientReduction, unit: FSDPModule, *, replicated: bool) -> None:
        self.owner = owner
        self.unit = unit
        self.replicated = replicated

    allocate = staticmethod(_allocate)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # a custom divide factor (PREMUL_SUM): FSDP2's own way
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return
        average = op == dist.ReduceOp.AVG
        exchange = reduce_scatter_by_exchange(output_tensor, input_tensor, group)
        if self.owner.stats is not None:
            self.owner.stats.record("reduce_scatter", input_tensor.numel() * input_tensor.element_size())
        reduction = _InFlight(exchange, output_tensor, dist.get_world_size(group), average)
        self.owner._start(reduction, deferrable=average and self._output_unread(input_tensor.dtype))

    def _output_unread(self, reduce_dtype: torch.dtype) -> bool:
        """Whether FSDP2 leaves this unit's output unread until the end of backward (the module docstring's list)."""
        if self.replicated or has_all_reduce_hook(self.unit):
            return False
        for fsdp_param in sharded_gradient_params(self.unit):
            sharded = fsdp_param.sharded_param
            if (
                sharded.dtype != reduce_dtype
                or sharded.grad is not None
                or fsdp_param.offload_to_cpu
                or post_accumulate_grad_hooks(sharded)
            ):
                return False
        return True
