"""Communication accounting for the monitor: what counts as "bytes", and the dispatch mode that counts collectives
issued by code we do not own.

**Definition.** ``bytes`` of a collective is the size of its *full* buffer on this rank: the tensor all-reduced, the
(unsharded) input of a reduce-scatter, the (gathered) output of an all-gather, the tensor sent or received by a P2P
op. That is a property of the call, independent of the backend's algorithm. What a ring algorithm puts on the wire
per rank is ``2(N-1)/N`` of it for all-reduce and ``(N-1)/N`` for reduce-scatter and all-gather, which is why
reduce-scatter + all-gather (ZeRO) moves the same wire bytes as one all-reduce (DDP): :func:`ring_wire_bytes`.
The definitions live in :mod:`lightning_parallel.accounting` (re-exported here); this module adds the tap and the
per-step phase times.

**Where the numbers come from.** Our own code records at each call it makes (``CommunicationStats.record``): DDP's
gradient all-reduce through a communication hook (``DataParallelStrategy(track_communication=True)``), the ZeRO-1/2
buckets' reduce-scatter and all-gather and their "got a gradient" flags (one byte per parameter tensor, all-reduced
at each sync), the pipeline replicas' gradient all-reduce, the P2P sends and receives of the pipeline's stages
(``SideEffectFreePipelineStage`` reports the ops it hands torch's schedules), and the pipeline's ``"broadcast"`` of
each training batch from the first stage's rank to the other ranks of its pipeline (the batch's tensor bytes, on
every rank of the pipeline, counted in the step that trains it; ``replica_batches.py``). For code we do not own,
:class:`CollectiveTap` is a ``TorchDispatchMode`` the monitor enters during training batches around FSDP2's
pre-forward hooks and over backward: it sees every ``c10d`` op (eager ``torch.distributed`` calls go through them)
and counts those issued by FSDP2 (ZeRO-3: all-gather, reduce-scatter, and the all-reduce across replicas under
HSDP), and, around the forward of each layer split by tensor parallelism and over backward, the functional
collectives ``DTensor`` issues for it (counted under the same names); the issuer is read from the Python frame that
made the call, so our own collectives, which we record ourselves, and the user's are never counted twice. Nothing
in torch is replaced. Control messages of a fixed size
(the one-element non-finite-loss flag, the pipeline's 16-byte "my loader has a batch" all-gather and the pickled
description of each broadcast batch, the 16-byte ``requires_grad`` fingerprint of ``distributed/trainable.py``
all-reduced every step, the broadcast of logged values, checkpoint gathers, torch pipelining's one-off shape and
warm-up messages) are not counted: the ledger holds the traffic that scales with the model and the batch, and the
planner predicts exactly that."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode  # private: see `accounting.py`, which uses it too
from torch.utils.hooks import RemovableHandle

from lightning_parallel.accounting import COLLECTIVES, CommunicationStats, ring_wire_bytes, tensor_bytes
from lightning_parallel.monitor import _compat

__all__ = ["COLLECTIVES", "CollectiveTap", "PhaseTimes", "ring_wire_bytes"]


@dataclass
class PhaseTimes:
    """Seconds of one step spent in the phases the monitor can see (``None``: not measurable here)."""

    exposed_communication: float = 0.0
    """Blocked in gradient synchronisation / parameter gathering after backward (ZeRO-1/2, pipeline replicas)."""
    pipeline_busy: float = 0.0
    """Running this rank's stages' forward/backward chunks."""
    pipeline_step: float = 0.0
    """The whole pipeline schedule of the step (busy + idle: waiting for a neighbour stage, torch's bookkeeping)."""
    events: list[tuple[str, int, float, float]] = field(default_factory=list)
    """``(kind, stage, start, end)`` of every F/B/W chunk of the step, in seconds from the step's start."""


class CollectiveTap(TorchDispatchMode):
    """Dispatch mode counting the bytes of the collectives FSDP2 issues (ZeRO-3) while it is entered, and those
    ``DTensor`` issues for tensor parallelism (``tensor_parallel_size``: all-reduces, all-gathers and reduce-scatters
    of activations and their gradients, through torch's functional collectives).

    Every op passes through :meth:`__torch_dispatch__` (a dictionary look-up); a ``c10d`` collective of
    :data:`._compat.COUNTED_OPS` is recorded into ``stats`` when the code that called it is FSDP2's
    (:func:`issuing_module`). A Python call per op is not free (on the tiny GPT under ZeRO-3 on 2 CPU ranks, a mode
    over the whole step added 40-70% to each of forward, backward and optimizer step), so the monitor enters it only
    where FSDP2 issues collectives: around FSDP2's own pre-forward hook of each unit (:meth:`hook_forward`: the
    all-gathers of forward) and over backward (the all-gathers of units resharded after forward, the reduce-scatters,
    HSDP's all-reduce), during training batches. Runs without a monitor and evaluation pay nothing. No public hook
    brackets FSDP2's backward collectives alone, so backward's ops all pass through it.

    Usable as a context manager, or with :meth:`start` / :meth:`stop` (idempotent).

    Args:
        stats: the ledger to record into (the strategy's ``communication_stats``).
    """

    def __init__(self, stats: CommunicationStats) -> None:
        super().__init__()
        self.stats = stats
        self.counting = False
        """Whether :meth:`hook_forward`'s hooks enter the tap (the monitor sets it for training batches)."""
        self._entered = self._entered_by_hook = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        counted = _compat.COUNTED_OPS.get(func)
        if counted is not None and issuing_module(sys._getframe(1)).startswith(_compat.FSDP_ISSUERS):
            collective, tensors = counted
            self.stats.record(collective, sum(tensor_bytes(tensor) for tensor in tensors(args)))
        split = _compat.TENSOR_PARALLEL_OPS.get(func)
        if split is not None and _is_tensor_parallel_traffic(sys._getframe(1)):
            collective, num_bytes = split
            self.stats.record(collective, num_bytes(args))
        return func(*args, **(kwargs or {}))

    def start(self) -> None:
        if not self._entered:
            self.__enter__()
            self._entered = True

    def stop(self) -> None:
        if self._entered:
            self._entered = self._entered_by_hook = False
            self.__exit__(None, None, None)

    def hook_forward(self, module: nn.Module) -> list[RemovableHandle]:
        """Enter the tap (while :attr:`counting`) just before FSDP2's pre-forward hook of every unit in ``module``,
        which all-gathers the unit's parameters, and leave it just after; the forward itself runs without it.

        FSDP2 registers its pre-forward hook with ``prepend=True`` when it shards a unit; ours, registered later, go
        before it (``prepend=True``) and after it. A layer split by tensor parallelism is entered for its whole
        forward (its input and output redistributions are its collectives). Returns the handles (remove them to
        stop)."""
        handles = []
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                handles.append(unit.register_forward_pre_hook(self._enter_before_unshard, prepend=True))
                handles.append(unit.register_forward_pre_hook(self._leave_after_unshard))
            if _splits_over_tensor_axis(unit):  # tensor parallelism: its forward's collectives, around it
                handles.append(unit.register_forward_pre_hook(self._enter_before_unshard))
                handles.append(unit.register_forward_hook(self._leave_after_forward))
        return handles

    def _enter_before_unshard(self, module: nn.Module, args: Any) -> None:
        # Already entered (a unit's forward re-run in backward by activation checkpointing): leave it to its owner.
        if self.counting and not self._entered:
            self.start()
            self._entered_by_hook = True

    def _leave_after_unshard(self, module: nn.Module, args: Any) -> None:
        if self._entered_by_hook:
            self._entered_by_hook = False
            self.stop()

    def _leave_after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._leave_after_unshard(module, args)


def _is_tensor_parallel_traffic(frame: FrameType | None) -> bool:
    """Whether a functional collective being dispatched is ``DTensor``'s redistribution of a split layer's activations
    or gradients: issued by ``torch.distributed._functional_collectives`` for code outside this package (ours,
    e.g. ZeRO-3 lending whole gradients with ``full_tensor()``, records its own bytes: not counted twice)."""
    if not issuing_module(frame).startswith(_compat.TENSOR_PARALLEL_ISSUERS):
        return False
    while frame is not None:  # the first caller outside torch (the tap's own frame aside)
        name = str(frame.f_globals.get("__name__", ""))
        if not (name == "torch" or name.startswith("torch.") or frame.f_code.co_name == "__torch_dispatch__"):
            return not name.startswith("lightning_parallel.")
        frame = frame.f_back
    return True


def _splits_over_tensor_axis(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are split by tensor parallelism (``DTensor``s on a ``tensor`` axis)."""
    return any(
        isinstance(param, DTensor) and "tensor" in (param.device_mesh.mesh_dim_names or ())
        for param in module.parameters(recurse=False)
    )


def issuing_module(frame: FrameType | None) -> str:
    """``__name__`` of the module whose code issued the collective being dispatched: the innermost frame from
    ``frame`` outwards that is neither ``torch.distributed``'s front end nor dispatch machinery ("": none).
    Walked only for the few counted ops of a step."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        transparent = name in _compat.TRANSPARENT_MODULES or name.startswith(_compat.TRANSPARENT_PREFIX)
        if not transparent and frame.f_code.co_name != "__torch_dispatch__":
            return str(name)
        frame = frame.f_back
    return ""
