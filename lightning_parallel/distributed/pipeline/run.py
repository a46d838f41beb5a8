"""One record of what a split of the module made, from the split until the next split replaces it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.accounting import CommunicationStats
from lightning_parallel.distributed.checkpoint import FlatPiece, replicated_pieces
from lightning_parallel.distributed.pipeline.consolidate import (
    OptimizerLayout,
    WholeOptimizerState,
    load_local_state,
    local_optimizer_state,
)
from lightning_parallel.distributed.pipeline.engine import PipelineEngine
from lightning_parallel.distributed.pipeline.fully_shard import load_whole_parameters
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.reassemble import mark_orphaned, reassemble
from lightning_parallel.distributed.pipeline.split_layers import SplitLayers
from lightning_parallel.distributed.pipeline.stage_holder import HeldStage
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.tensor_parallel_stage import (
    StageTensorParallel,
    place_optimizer_state,
    placed_like_parameters,
)
from lightning_parallel.distributed.pipeline.tied import TiedGradientSync, canonical_names
from lightning_parallel.distributed.pipeline.whole_model_view import WholeModelView
from lightning_parallel.distributed.trainable import check_same_trainable_parameters_within
from lightning_parallel.distributed.zero.backends import ZeroBackend

__all__ = ["PipelineRun"]


@dataclass(kw_only=True)
class PipelineRun:
    """A split module's state: created whole by the split, its live part dropped when the module is reassembled.

    Made by :func:`~.stage_split.split_into_stages`; :meth:`reassemble` gives the module back whole.

    The live part (:attr:`engine`, the layers of :attr:`split`) exists while the module holds only this
    rank's stages. The rest stays after the reassembly (teardown), so that after ``fit`` the strategy still answers
    ``stage_plan`` and writes checkpoints of the stage it trained; the next split replaces the whole record.
    """

    module: nn.Module
    """The split module (whole again after :meth:`reassemble`)."""
    split: SplitLayers
    """Every pipeline layer (other ranks' on ``meta`` while split), where each sits in the module, the stage plan and
    the ranks (reused by later splits: the groups are created once); the layers and their registrations are dropped
    when the module is whole again."""
    tied: TiedGradientSync
    """Tied parameters, the pipeline ranks holding a copy of each, and the groups summing their gradients."""
    aliases: dict[str, str]
    """Other name -> canonical name of every parameter with several names."""
    full_state_keys: list[str]
    """The whole module's ``state_dict`` keys, in order."""
    full_shapes: dict[str, tuple[int, ...]]
    """The whole module's parameter shapes by name."""
    optimizer_layouts: list[OptimizerLayout]
    """Each optimizer's parameter names per group on the whole model (the consolidated checkpoint's numbering)."""
    local_parameter_names: set[str]
    """Canonical names this rank writes in a sharded checkpoint (a tied copy only on its lowest pipeline rank)."""
    held: HeldStage
    """How the stage is held over the replicas (:func:`~.stage_holder.hold_stage`, at the split): the ZeRO backend the
    one chooser picked and, at ZeRO-3, the stage's sharded copies."""
    engine: PipelineEngine | None
    """Runs the steps; ``None`` once the module is whole again."""
    tensor_parallel: StageTensorParallel | None = None
    """The stage's layers split over the ``tensor`` axis (``None``: no tensor parallelism); made whole again first
    when the module is reassembled."""
    failed: bool = False
    """Training failed: the teardown leaves the split module alone (no collective with failed peers)."""
    pending_grads: list[Tensor | None] | None = None
    """The last training step's gradients, handed over in ``backward`` after Lightning's ``zero_grad``."""

    @property
    def dims(self) -> ParallelDims:
        """Ranks and process groups."""
        return self.split.dims

    @property
    def plan(self) -> StagePlan:
        """Which layers form which stage."""
        return self.split.plan

    @property
    def backend(self) -> ZeroBackend:
        """The ZeRO backend holding the stage (the ``GradientSync`` protocol: ``reduce_gradients`` after the schedule,
        ``after_optimizer_step``, clipping)."""
        return self.held.backend

    @property
    def is_split(self) -> bool:
        """Whether the module holds only this rank's stages now."""
        return self.engine is not None

    def drop_split(self) -> None:
        """The module is whole again: forget the engine and the layers."""
        self.engine, self.split = None, replace(self.split, layers=[], registrations=[])

    @contextmanager
    def gradients_set_aside(self, module: nn.Module) -> Iterator[None]:
        """Local. Run a step with ``.grad`` cleared: afterwards its gradients wait in :attr:`pending_grads` and the
        earlier ones are back, for a loop that zeroes gradients between the step and its backward (Lightning's);
        :meth:`hand_over_gradients` adds them then."""
        params = list(module.parameters())
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            self.pending_grads = [p.grad for p in params]
            if self.tensor_parallel is not None:  # each split weight's gradient on its own shard
                self.pending_grads = placed_like_parameters(params, self.pending_grads)
            for p, grad in zip(params, previous, strict=True):
                p.grad = grad

    def hand_over_gradients(self, module: nn.Module) -> None:
        """Local. Add the gradients :meth:`gradients_set_aside` kept to ``.grad`` (nothing if none wait)."""
        pending, self.pending_grads = self.pending_grads, None
        for p, grad in zip(module.parameters(), pending, strict=True) if pending is not None else ():
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad

    def reassemble(self, module: nn.Module, *, device: torch.device) -> None:
        """Collective over the pipeline (and, at ZeRO-3, the replicas). Give every rank the whole ``module`` back:
        the stages' parameters gathered into the user's layers, the placeholders replaced, then :meth:`drop_split`.
        A run that :attr:`failed` is left split instead, its placeholders raising on access (no collective)."""
        if self.engine is not None:
            self.engine.clear()  # the stages' receive buffers
        if self.failed:
            mark_orphaned(module)
            return
        self.backend.wait_for_parameters()
        if self.held.copies is not None:  # ZeRO-3: the shards gathered into the user's layers, back in the module
            self.held.copies.restore()
        if self.tensor_parallel is not None:  # the stage's layers whole again (a collective over the tensor group)
            self.tensor_parallel.gather(module)
        reassemble(module, self.split, device=device, tied=self.tied.layout.parameters)
        self.drop_split()

    def whole_model_view(
        self, module: nn.Module, *, device: torch.device, stats: Callable[[], CommunicationStats | None]
    ) -> WholeModelView:
        """Local. A view that puts the whole model in the split ``module`` for the length of a hook (opening it is a
        collective; :mod:`.whole_model_view`)."""
        return WholeModelView(module, self.split, aliases=self.aliases, device=device, stats=stats)

    def load_model_state(self, module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Local. Load this rank's entries of the whole model's ``state_dict`` into the split ``module``."""
        load_local_state(
            module,
            state_dict,
            self.full_state_keys,
            strict=strict,
            aliases=self.aliases,
            load=self._load_entries,
        )

    def _load_entries(self, module: nn.Module, entries: dict[str, Any]) -> None:
        """Local. Whole tensors of this rank's entries (ZeRO-3 keeps its rows of each; ZeRO-1/2's fp32 masters restart
        from them)."""
        if self.held.copies is not None:
            load_whole_parameters(module, entries)
        else:
            self.backend.load_model_state(entries, strict=False)

    def load_optimizer_states(self, optimizers: Sequence[Optimizer], states: Sequence[dict[str, Any]]) -> None:
        """Local. Load each optimizer's part of the whole model's single-device ``state_dict`` (in the order of
        :attr:`optimizer_layouts`)."""
        for optimizer, state, layout in zip(optimizers, states, self.optimizer_layouts, strict=True):
            self.load_stage_optimizer_state(optimizer, WholeOptimizerState(state, layout))

    # ------------------------------------------------------------------ the stage's state, over the backend
    def setup_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Collective (ZeRO-1/2: the stage's buckets) or local. The unwrapped optimizers of this rank's parameters,
        before their first step."""
        if self.held.copies is not None:
            self.held.copies.check_optimizers(optimizers)
        self.backend.setup_optimizers(list(optimizers))

    def parameter_names(self) -> dict[int, str]:
        """Local. ``id(parameter)`` -> canonical name of what the module (and so the optimizers) holds now."""
        return canonical_names(self.module, self.aliases)

    def stage_model_state(self) -> dict[str, Any]:
        """Collective over the replicas (ZeRO-3) or local. This rank's ``state_dict`` with whole tensors."""
        if self.held.copies is not None:
            return self.held.copies.model_state(self.backend.compute_dtype)
        self.backend.wait_for_parameters()
        return self.module.state_dict()

    def stage_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective over the stage's replicas (ZeRO) or local. The stage's part of ``optimizer``'s state keyed by
        canonical name (:func:`~.consolidate.local_optimizer_state`), complete on the stage's first replica, which
        the consolidated checkpoint gathers over the pipeline (the other replicas' parts are dropped)."""
        names = self.parameter_names()
        if self.held.copies is not None:
            has_masters = self.backend.compute_dtype is not None
            return self.held.copies.optimizer_state(
                optimizer, {**names, **self.held.sharded_names}, has_masters=has_masters
            )
        stepped = self.backend.parameters_stepped_by(optimizer)  # what the plain state numbers
        if _same_tensors(stepped, [param for group in optimizer.param_groups for param in group["params"]]):
            # The optimizer steps the parameters themselves: its own state, where it lives (the consolidation moves
            # each tensor through the pipeline group's device, not through a host copy).
            return local_optimizer_state(optimizer, names)
        plain = self.backend.optimizer_state(optimizer) or {
            "state": {},
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
        }
        return local_optimizer_state(optimizer, names, state_dict=plain, group_params=[stepped])

    def load_stage_optimizer_state(self, optimizer: Optimizer, state: WholeOptimizerState) -> None:
        """Local (ZeRO-1/2 waits for its all-gather). Keep this rank's part of the whole model's single-device
        optimizer state."""
        names = self.parameter_names()
        if self.held.copies is not None:
            self.held.copies.load_optimizer_state(optimizer, state.slice_for(optimizer, names))
            return
        groups = [set(group) for group in state.layout]
        stepped = self.backend.parameters_stepped_by(optimizer)
        group_params = [[param for param in stepped if names[id(param)] in group] for group in groups]
        self.backend.load_optimizer_state(optimizer, state.slice_for(optimizer, names, group_params=group_params))
        if self.tensor_parallel is not None:  # the split weights' moments cut into their slices
            place_optimizer_state(optimizer)

    def stage_pieces(self, optimizer: Optimizer | None) -> tuple[list[tuple[str, Tensor]], list[FlatPiece]]:
        """Local. ``(canonical name, parameter)`` of what this rank holds, and the pieces of the sharded format this
        replica writes (ZeRO-3: its rows; else an even slice of each whole tensor)."""
        if self.held.copies is not None:
            return self.held.copies.pieces(optimizer, self.held.sharded_names)
        names = self.parameter_names()
        named: list[tuple[str, Tensor]] = [(names[id(param)], param) for param in self.module.parameters()]
        rank, size = self.dims.data_parallel_rank, self.dims.data_parallel_size
        return named, replicated_pieces(self.module, optimizer, rank=rank, world_size=size)

    def check_same_trainable_parameters(self, module: nn.Module, *, group: dist.ProcessGroup, owner: str) -> None:
        """Collective over ``group`` (a CPU group of every rank: ``HostGroups.world``) with data parallelism, else
        nothing. The replicas of a stage average its gradients, so they must agree on which parameters require grad
        (user code may change ``requires_grad`` between steps); a disagreement raises on every rank, naming the
        parameters and ranks. On the host: no device sync."""
        if self.dims.data_parallel_size == 1:
            return
        layout = self.dims.layout
        cohorts = [layout.pipeline_rank(rank) for rank in range(self.dims.world_size)]
        check_same_trainable_parameters_within(module, cohorts=cohorts, owner=owner, group=group)


def _same_tensors(first: Sequence[Tensor], second: Sequence[Tensor]) -> bool:
    return len(first) == len(second) and all(a is b for a, b in zip(first, second, strict=True))
