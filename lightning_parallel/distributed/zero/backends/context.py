"""What a ZeRO backend is given beside the user's settings: this run's ranks, mesh and listeners, and the few things
the Lightning side supplies (how to warn, how to broadcast rank 0's weights, the Trainer's parameter callbacks).

The backends import no Lightning (``tests/test_layers.py``); the strategy passes Lightning's helpers here as plain
callables and objects, and the defaults let a backend run without a strategy.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.distributed.averaged_copy import CopyHolding, HeldCopy
from lightning_parallel.distributed.broadcast import broadcast_from_rank0
from lightning_parallel.distributed.clipping import clip_grad_norm_over_ranks_
from lightning_parallel.distributed.compression import CommunicationStats
from lightning_parallel.distributed.zero.replica_reduction import ReplicaReduction
from lightning_parallel.instrumentation import StrategyEvents

__all__ = ["NoParameterCallbacks", "ParameterCallbacks", "StageExtensions", "ZeroContext", "broadcast_on_its_device"]


class ParameterCallbacks(Protocol):
    """The Trainer's callbacks that copy or prune the module's parameters (weight averaging, pruning), as a backend
    that shards the parameters must treat them (``strategies/parameter_callbacks.py`` implements it)."""

    def check(self, *, strategy_name: str, layout: str) -> None:
        """Local. Raise ``ValueError`` for a callback that cannot run while the parameters are held as ``layout``
        (``strategy_name`` is quoted in the error)."""

    def hold_averaged_copies(self, module: nn.Module, layout: CopyHolding) -> list[HeldCopy]:
        """Local. Make each weight-averaging callback's copy hold what ``module`` now holds on this rank."""


class NoParameterCallbacks:
    """No callback copies or prunes the parameters (a backend used without a Trainer)."""

    def check(self, *, strategy_name: str, layout: str) -> None:
        del strategy_name, layout

    def hold_averaged_copies(self, module: nn.Module, layout: CopyHolding) -> list[HeldCopy]:
        del module, layout
        return []


def broadcast_on_its_device(module: nn.Module) -> None:
    """Collective over the default group. Rank 0's parameters and buffers on every rank, one tensor at a time
    through the device they are on (``distributed/broadcast.py``)."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    if first is not None:
        broadcast_from_rank0(module, first.device)


@dataclass(frozen=True, kw_only=True)
class StageExtensions:
    """What a pipeline adds when a ZeRO backend holds one of its stages (``distributed/pipeline/stage_holder.py``).

    The backend is the one ``ShardedOptimizerStrategy`` runs (:func:`~.choice.backend_type` picks it for both), on the
    mesh's data axes of the stage (``shard`` and ``replicate``); these are the only points where a stage differs from
    a whole model.
    """

    reduce_after_backward: bool = True
    """Stages 1-2: the caller's backward leaves every gradient in ``.grad`` (torch's pipeline schedules: the
    zero-bubble ones compute weight gradients outside autograd's accumulation, where a backward hook would not fire),
    so no backward hook is installed and ``reduce_gradients`` first takes the ``.grad`` into the buckets. (Stage 3's
    FSDP2 reduces in its own hooks.)"""
    after_reduction: Callable[[Sequence[Any] | None], None] | None = None
    """Collective. Called by ``reduce_gradients`` once the stage's gradients are averaged over its replicas, with
    the reduced shard views (stages 1-2: :class:`~lightning_parallel.distributed.zero.flat_bucket.ShardView`), or
    ``None`` where the reduced gradients are the parameters' own ``.grad`` (replicated; stage 3's local shards): the
    pipeline sums the copies of tied weights over the stages holding one there."""
    norm_groups: tuple[Any, ...] = ()
    """Process groups over which the clipping norm is reduced beside the shard group (the pipeline's ``pp`` group:
    each pipeline rank holds other stages)."""
    uncounted: frozenset[str] = frozenset()
    """Parameter names (every name the held module gives them) whose gradients clipping scales but leaves out of the
    norm: the copies of a tied weight that another pipeline rank counts."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """This rank's device, where the clipping norm is reduced."""

    def clip_grad_norm_(self, named: Iterable[tuple[str, Tensor]], max_norm: float, *, groups: Sequence[Any]) -> Tensor:
        """Collective over ``groups`` and :attr:`norm_groups`. torch's clip of the ``.grad`` of ``named`` (``(name,
        tensor)`` in the optimizer's order) with the norm over those ranks, the :attr:`uncounted` scaled but not
        counted."""
        counted: list[Tensor] = []
        copies: list[Tensor] = []
        for name, tensor in named:
            (copies if name in self.uncounted else counted).append(tensor)
        all_groups = [*groups, *self.norm_groups]
        return clip_grad_norm_over_ranks_(
            counted, float(max_norm), groups=all_groups, device=self.device, copies=copies
        )


@dataclass(frozen=True, kw_only=True)
class ZeroContext:
    """What the strategy's ``setup`` hands a backend beside the user's
    :class:`~lightning_parallel.distributed.zero.config.ZeroConfig`: this run's ranks, its mesh, who listens and the
    Lightning side's helpers. The defaults are one rank, no listener and no callbacks (a backend used without a
    strategy)."""

    rank: int = 0
    world_size: int = 1
    mesh: DeviceMesh | None = None
    """The strategy's mesh (axes ``replicate``, ``shard``, ``pp``): the sharded backends shard over its ``shard``
    axis and average across its ``replicate`` axis; ``None`` at world size 1."""
    events: StrategyEvents = field(default_factory=StrategyEvents)
    """Where the stage 1-2 sync waits are timed (``events.timed("exposed_communication")``)."""
    stats: CommunicationStats | None = None
    """Where to count the bytes of our own collectives (the monitor's ledger), or ``None``."""
    parameter_callbacks: ParameterCallbacks = field(default_factory=NoParameterCallbacks)
    """The Trainer's weight-averaging and pruning callbacks (stage 3 refuses pruning and holds the averaged copies as
    shards)."""
    warn: Callable[[str], None] = warnings.warn
    """How to warn the user (the strategy passes Lightning's ``rank_zero_warn``: once, on rank 0)."""
    sync_module_states: Callable[[nn.Module], None] = broadcast_on_its_device
    """Collective. Start every rank from rank 0's parameters and buffers, the module being on its device (stages 1-2
    and world size 1). The strategy passes Lightning's ``_sync_module_states`` (a coalesced broadcast, as
    ``DDPStrategy``'s); the default broadcasts tensor by tensor."""
    stage: StageExtensions | None = None
    """Set when the backend holds one stage of a pipeline (:class:`StageExtensions`); ``None``: a whole model."""
    replicas: ReplicaReduction | None = None
    """Stages 1-2: who averages the reduced gradient shards across replicas that are not in this job's mesh
    (``FaultTolerance``: torchft across replica groups, each its own job). ``None``: the mesh's ``replicate`` axis."""
    host_group: Any = None
    """Stages 1-2: a CPU (gloo) group of the mesh's ``replicate`` x ``shard`` ranks (``HostGroups.data_parallel``),
    where the buckets' "got a gradient" flags are all-reduced with no device sync; ``None``: on the device."""
    data_parallel_group: Any = None
    """:class:`~.replicated.ReplicatedBackend` at world size > 1 (a pipeline stage at ``zero_stage=0``): the group of
    every replica of what it holds, over which ``reduce_gradients`` averages the gradients (one flat all-reduce, as
    DDP's); ``None``: nothing to average."""
