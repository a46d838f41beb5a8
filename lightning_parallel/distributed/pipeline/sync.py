"""How a pipeline holds its stage over the data-parallel replicas: the ``GradientSync`` protocol, pipeline side.

Torch-only. ``PipelineParallelStrategy`` picks one implementation once per split (:func:`.sync_type.pipeline_sync_type`
from ``zero_stage`` and the data-parallel size) and afterwards calls only :class:`PipelineSync`:

* :class:`ReplicatedSync` (``zero_stage=0``, or any stage without data parallelism): every replica holds its stage
  whole; after the schedule the replicas' gradients are averaged by one all-reduce, then the copies of tied weights
  summed over the pipeline ranks that hold one (``tied.TiedGradientSync``).
* ``zero.FlatBucketSync`` (``zero_stage`` 1-2): ZeRO-1/2's own backend holding the stage (flat buckets
  reduce-scattered after the schedule, this replica's shard stepped, the buckets all-gathered).
* ``fully_shard.FullyShardSync`` (``zero_stage=3``): sharded copies of the rank's layers (FSDP2) run the stages.

Each implementation also answers for its part of the checkpoints (the stage's whole state, its optimizer state in
the named layout of :mod:`.consolidate`, the pieces of the sharded format) and clips by the norm over the mesh.
Built at the split (the parameters are placed then); :meth:`PipelineSync.setup_optimizers` follows once the
optimizers exist (fitting only).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_parallel.accounting import CommunicationStats, MemoryReport, module_memory_report
from lightning_parallel.distributed.checkpoint import FlatPiece, replicated_pieces
from lightning_parallel.distributed.clipping import clip_grad_norm_over_ranks_
from lightning_parallel.distributed.gradient_sync import GradientSync
from lightning_parallel.distributed.pipeline.consolidate import WholeOptimizerState, local_optimizer_state
from lightning_parallel.distributed.pipeline.layer_registration import Registration
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.tied import TiedGradientSync, TiedParameter, canonical_names, split_counted
from lightning_parallel.distributed.zero.config import ZeroConfig

__all__ = ["PipelineSync", "ReplicatedSync", "SyncContext", "average_across_replicas"]


@dataclass(frozen=True, kw_only=True)
class SyncContext:
    """What a split hands its sync: the split module, this rank's layers, its ranks and groups."""

    module: nn.Module
    """The user's (split) module."""
    layers: Mapping[int, nn.Module]
    """This rank's pipeline layers by index (the user's objects)."""
    registrations: Sequence[Sequence[Registration]]
    """For each layer index, where its modules are registered in ``module``."""
    dims: ParallelDims
    """Ranks and process groups (the replicas of a stage on ``dims.data_parallel_group``)."""
    mesh: DeviceMesh
    """The strategy's device mesh, axes ``("replicate", "shard", "pp")``."""
    tied: TiedGradientSync
    """The tied parameters, the pipeline ranks holding a copy of each, and their groups."""
    aliases: Mapping[str, str]
    """Other name -> canonical name of every parameter with several names."""
    zero_config: ZeroConfig | None
    """``PipelineParallelStrategy``'s ZeRO settings (``None``: ``zero_stage=0``): the ZeRO backend holding the stage
    is built from them, as ``ShardedOptimizerStrategy``'s is."""
    device: torch.device
    """This rank's device (norms are reduced there)."""
    stats: Callable[[], CommunicationStats | None] = lambda: None
    """Where to count collective bytes now (``None``: not counted; the monitor switches counting on per run)."""
    warn: Callable[[str], Any] = warnings.warn
    """How to warn about an optimizer we do not know to be element-wise (the strategy's rank-zero warning)."""
    sharded_names: Mapping[int, str] = field(default_factory=dict)
    """``id`` -> canonical name of the sharded parameters of earlier splits (see :attr:`PipelineSync.sharded_names`)."""
    previous: PipelineSync | None = None
    """The last split's sync (a ``fit`` before this ``validate``): its optimizers' shards are still the state a
    checkpoint saves."""


class PipelineSync(GradientSync, Protocol):
    """:class:`~lightning_parallel.distributed.gradient_sync.GradientSync` plus what a pipeline's split needs.

    In a pipeline the optimizer state is the stage's: :meth:`stage_optimizer_state` gives it keyed by canonical
    name (:func:`~lightning_parallel.distributed.pipeline.consolidate.local_optimizer_state`, complete on the first
    replica), which the consolidated checkpoint then gathers over the pipeline; :meth:`load_stage_optimizer_state` takes
    the whole model's single-device state with its layout (a
    :class:`~lightning_parallel.distributed.pipeline.consolidate.WholeOptimizerState`) and keeps this rank's part.
    Gradients are reduced once the schedule ran (:meth:`reduce_gradients`), never during its backward.
    """

    sharded_names: dict[int, str]
    """``id`` -> canonical name of the sharded parameters of this and earlier splits (ZeRO-3: the optimizers of a
    ``fit`` keep its shards after a later ``validate`` splits afresh); empty when nothing is sharded."""

    def __init__(self, context: SyncContext) -> None: ...

    @staticmethod
    def check_split(tied: Sequence[TiedParameter], plan: StagePlan, pipeline_parallel_size: int) -> None:
        """Local, the same verdict on every rank, before any collective: raise ``ValueError`` for a split this
        sync cannot hold."""

    @property
    def layers(self) -> dict[int, nn.Module]:
        """Local. The layers the stages run, by index (ZeRO-3: the sharded copies)."""
        ...

    def setup_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Collective (flat buckets: groups of the tied copies) or local. The unwrapped optimizers of this rank's
        parameters, before their first step."""

    def restore_layers(self) -> None:
        """Collective over the replicas (ZeRO-3) or nothing. Put the user's layers back whole in the module."""

    def parameter_names(self) -> dict[int, str]:
        """Local. ``id(parameter)`` -> canonical name of what the module and the optimizers hold now."""
        ...

    def model_state(self) -> dict[str, Any]:
        """Collective over the replicas (ZeRO-3) or local. This rank's ``state_dict`` with whole tensors."""
        ...

    def load_model_entries(self, module: nn.Module, entries: dict[str, Any]) -> None:
        """Local. Load whole tensors of this rank's entries (``load_state_dict(strict=False)``; ZeRO-3 keeps its
        rows of each)."""

    def stage_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective over the stage's replicas (ZeRO) or local. The stage's part of ``optimizer``'s state keyed by
        canonical parameter name (:func:`~lightning_parallel.distributed.pipeline.consolidate.local_optimizer_state`),
        complete on the stage's first replica, which the consolidated checkpoint gathers over the pipeline."""
        ...

    def load_stage_optimizer_state(self, optimizer: Optimizer, state: WholeOptimizerState) -> None:
        """Local. Keep this rank's part of the whole model's single-device optimizer state."""

    def stage_pieces(self, optimizer: Optimizer | None) -> tuple[list[tuple[str, Tensor]], list[FlatPiece]]:
        """Local. ``(canonical name, parameter)`` of what this rank holds, and the pieces of the sharded format
        this replica writes."""
        ...


def average_across_replicas(
    grads: Sequence[Tensor], *, group: Any, size: int, stats: CommunicationStats | None = None
) -> None:
    """Average ``grads`` in place over the data-parallel replicas of a stage (one flat all-reduce, counted in
    ``stats`` when given)."""
    if size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if stats is not None:
        stats.record("all_reduce", flat.numel() * flat.element_size())
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class ReplicatedSync:
    """Every replica holds its stage whole (``zero_stage=0``, or no data parallelism).

    After the schedule the replicas' gradients are averaged (one flat all-reduce over ``dims.data_parallel_group``),
    then the copies of tied weights summed over the pipeline ranks holding one: the copies stay bitwise equal.
    Clipping: the replicas hold equal gradients, so the norm is reduced over the pipeline group only.
    """

    def __init__(self, context: SyncContext) -> None:
        self.context = context
        self.module = context.module
        self.dims = context.dims
        self.optimizers: list[Optimizer] = []
        self.sharded_names: dict[int, str] = dict(context.sharded_names)

    @staticmethod
    def check_split(tied: Sequence[TiedParameter], plan: StagePlan, pipeline_parallel_size: int) -> None:
        return None

    @property
    def layers(self) -> dict[int, nn.Module]:
        return dict(self.context.layers)

    def setup_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        self.optimizers = list(optimizers)

    # ------------------------------------------------------------------ step
    def no_sync(self) -> AbstractContextManager[None]:
        return nullcontext()  # the schedule's backward communicates nothing: gradients are reduced after it

    def reduce_gradients(self) -> Iterable[Tensor]:
        grads = [p.grad for o in self.optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
        dims = self.dims
        average_across_replicas(grads, group=dims.data_parallel_group, size=dims.data_parallel_size, stats=self.stats)
        self.sum_tied_copies()  # after the replica average: the copies then stay bitwise equal
        return []

    def sum_tied_copies(self) -> None:
        """Collective over each set of ranks sharing tied copies: every copy's ``.grad`` becomes their sum."""
        self.context.tied.all_reduce(self.module, self.context.aliases, stats=self.stats)

    @property
    def stats(self) -> CommunicationStats | None:
        return self.context.stats()

    def counted_and_copies(self, optimizer: Optimizer) -> tuple[list[Tensor], list[Tensor]]:
        """Local. ``optimizer``'s parameters with a gradient: those this rank counts in the norm, and the copies of
        tied parameters that another rank counts (the lowest pipeline rank holding one)."""
        names = canonical_names(self.module, self.context.aliases)
        uncounted = self.context.tied.layout.uncounted(self.dims.pipeline_rank)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return split_counted([(p, p) for p in params], {id(p) for p in params if names.get(id(p)) in uncounted})

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        counted, copies = self.counted_and_copies(optimizer)
        # Replicas of a stage hold equal, already averaged gradients: the pipeline group splits them.
        groups = [self.dims.pipeline_group]
        return clip_grad_norm_over_ranks_(counted, max_norm, groups=groups, device=self.context.device, copies=copies)

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        return None  # every replica stepped its whole stage

    def wait_for_parameters(self, *, everywhere: bool = True) -> None:
        return None

    def abandon_in_flight(self) -> None:
        return None  # nothing runs asynchronously

    def teardown(self) -> None:
        return None

    def restore_layers(self) -> None:
        return None  # the module holds the user's layers

    # ------------------------------------------------------------------ state
    def gradient_buffers(self) -> list[Tensor]:
        return []

    def memory_report(self, optimizers: Sequence[Optimizer]) -> MemoryReport:
        return module_memory_report(self.module, optimizers[0] if optimizers else None)

    def parameter_names(self) -> dict[int, str]:
        return canonical_names(self.module, self.context.aliases)

    def model_state(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_model_entries(self, module: nn.Module, entries: dict[str, Any]) -> None:
        module.load_state_dict(entries, strict=False)

    def stage_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Local here. The stage's optimizer state keyed by canonical name, as
        :func:`~lightning_parallel.distributed.pipeline.consolidate.local_optimizer_state` gives it."""
        return local_optimizer_state(optimizer, self.parameter_names())

    def load_stage_optimizer_state(self, optimizer: Optimizer, state: WholeOptimizerState) -> None:
        """Local. ``state``: a :class:`~.consolidate.WholeOptimizerState`; this rank keeps its stage's part."""
        optimizer.load_state_dict(state.slice_for(optimizer, self.parameter_names()))

    def stage_pieces(self, optimizer: Optimizer | None) -> tuple[list[tuple[str, Tensor]], list[FlatPiece]]:
        names = self.parameter_names()
        named: list[tuple[str, Tensor]] = [(names[id(param)], param) for param in self.module.parameters()]
        dims = self.dims
        pieces = replicated_pieces(
            self.module, optimizer, rank=dims.data_parallel_rank, world_size=dims.data_parallel_size
        )
        return named, pieces
