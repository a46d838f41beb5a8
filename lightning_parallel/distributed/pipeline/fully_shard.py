"""ZeRO-3 inside the pipeline: each stage's parameters, gradients and optimizer state sharded over its replicas.

Torch-only. The stage is held by ZeRO-3's own backend
(:class:`~lightning_parallel.distributed.zero.backends.FullyShardBackend`: torch's FSDP2 per block, fp32 master weights
of 16-bit parameters, gloo's collectives), on the mesh's ``"shard"`` axis (the data-parallel replicas of one stage,
which hold the same layers; with hybrid sharding FSDP2's HSDP over ``"replicate"`` x ``"shard"``). What differs from
``ShardedOptimizerStrategy(stage=3)``:

* The sharded modules are copies. The rank's layers are deep-copied once (together, so parameters two local layers
  share stay shared), the copies take the layers' places in the user's module for the run and are sharded; the
  user's layers keep their identity and their tensors' storage is released. :meth:`PipelineFullyShard.restore`
  gathers the shards back into them at teardown, so the module is plain and whole afterwards (FSDP2 has no way to
  undo ``fully_shard`` on a module: it changes its class and hooks).
* The copies sit under one container sharded as FSDP2's root, so the units of a stage share one communication
  context; the container's forward never runs, each unit gathers its parameters in its own forward hook (the stage
  calls the layers), reshards after its forward and reduce-scatters its gradients after each micro-batch's backward
  (the mean over the replicas, accumulated into the sharded ``.grad``). torch's schedules special-case a stage whose
  module is an ``FSDPModule`` (no gradient sync until the last micro-batch, then ``post_backward`` by hand); ours is
  a plain ``StageModule`` around the units, so FSDP2's own hooks do every reduction: one reduce-scatter per
  micro-batch and unit instead of one per step (more collectives, the same result). The zero-bubble schedule,
  which computes weight gradients outside autograd's backward where those hooks fire, is refused.
* Tied parameters: every copy is sharded the same way (same shape, same mesh), so replica ``r`` holds the same rows
  of each copy; after FSDP2's reduce-scatter the shards are summed over the pipeline ranks holding a copy
  (``tied.TiedGradientSync`` on the local shards), and the copies stay bitwise equal.
* Clipping: the squares of the local gradient shards summed over the ``"shard"`` group, then the ``"pp"`` group.

Per rank after a step (``dp`` replicas, a stage of ``N`` parameters, sizes divisible by ``dp``): parameters ``4N/dp``
bytes (fp32), gradients ``4N/dp``, optimizer state ``K * 4N/dp`` (``K`` per-element states: 2 for Adam(W)).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel.distributed.checkpoint import FlatPiece, host_copy
from lightning_parallel.distributed.clipping import clip_grad_norm_over_ranks_
from lightning_parallel.distributed.pipeline.consolidate import (
    MASTER_WEIGHTS,
    WholeOptimizerState,
    local_optimizer_state,
)
from lightning_parallel.distributed.pipeline.layer_registration import Registration
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.sync import ReplicatedSync, SyncContext
from lightning_parallel.distributed.pipeline.tied import TiedParameter, canonical_names
from lightning_parallel.distributed.pipeline.zero import check_no_tie_within_a_rank
from lightning_parallel.distributed.zero.backends import FullyShardBackend, StageExtensions, ZeroContext
from lightning_parallel.distributed.zero.optimizer import check_shardable
from lightning_parallel.distributed.zero.stage3 import cast_parameters, named_sharded_pieces, shard_coordinates

__all__ = [
    "FullyShardSync",
    "PipelineFullyShard",
    "full_tensors",
    "load_whole_parameters",
    "local_shard",
    "shard_optimizer_state",
    "whole_optimizer_state",
]


class _StageUnits(nn.Module):
    """The copies of a rank's layers under one module: FSDP2's root for them (its forward never runs)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - the stages call the layers
        raise RuntimeError("The pipeline's ZeRO-3 container is never called; its layers are.")


class PipelineFullyShard:
    """A rank's layers replaced in ``module`` by copies sharded with FSDP2 over ``mesh`` (the replicas of the stage).

    Building it is local (FSDP2's ``fully_shard`` communicates nothing); every replica of the stage must build it
    from equal weights (the split broadcast rank 0's). Call it before the optimizers are created: they must hold the
    sharded parameters.

    Args:
        module: the user's (split) module.
        layers: this rank's pipeline layers by index (the user's objects).
        registrations: for each layer index, where its modules are registered in ``module``.
        backend: ZeRO-3's own backend (``ShardedOptimizerStrategy(stage=3)``'s), built for this stage: it shards the
            copies with FSDP2 over the mesh's ``shard`` axis (with hybrid sharding FSDP2's HSDP over ``replicate`` x
            ``shard``), with fp32 master weights of 16-bit parameters, gloo's collectives and the access guard.
        device: this rank's device.
        aliases: other name -> canonical name of parameters with several names.
    """

    def __init__(
        self,
        module: nn.Module,
        layers: Mapping[int, nn.Module],
        *,
        registrations: Sequence[Sequence[Registration]],
        backend: FullyShardBackend,
        device: torch.device,
        aliases: Mapping[str, str],
    ) -> None:
        self.module = module
        self.indices = sorted(layers)
        self.originals = [layers[i] for i in self.indices]
        memo: dict[int, Any] = {}
        copies = copy.deepcopy(self.originals, memo)  # one call: what two layers share stays shared
        self._copy_of = {id(m): memo[id(m)] for layer in self.originals for m in layer.modules()}
        self._registrations = [r for i in self.indices for r in registrations[i]]
        for registration in self._registrations:
            if not registration.is_tensor:
                registration.place(module, holder=self._copy_of[id(registration.holder)])
        _release(self.originals)
        self.container = _StageUnits(copies)
        self.backend = backend
        backend.setup_module(self.container, device)  # FSDP2's root: the units of a stage share one context
        self.units = backend.units
        for registration in self._registrations:  # after sharding, which replaces a module's own parameters
            if registration.is_tensor:
                registration.place(module, holder=self._copy_of[id(registration.holder)])
        self.gloo_reduction = backend.gloo_reduction
        """On gloo, ZeRO-3's all-gathers and gradient reductions (``distributed/zero/stage3_gloo.py``), as outside the
        pipeline; not counted by the monitor (FSDP2's traffic in the pipeline is not)."""
        self.layers = dict(zip(self.indices, copies, strict=True))
        """The sharded copies by layer index: what the stages run."""
        self.names = canonical_names(module, aliases)
        """``id`` of each sharded parameter -> its canonical name (what the optimizers hold, also after teardown)."""
        self.is_restored = False
        """Whether :meth:`restore` put the user's layers back (after the run; the optimizers keep the shards)."""

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """Local. ``(canonical name, sharded parameter)`` of every parameter this rank holds, once each (also after
        :meth:`restore`: the optimizers step these)."""
        return [(self.names[id(param)], param) for param in self.container.parameters()]

    # ------------------------------------------------------------------ step
    def clip_grad_norm(
        self,
        counted: Sequence[Tensor],
        copies: Sequence[Tensor],
        max_norm: float,
        *,
        groups: Sequence[Any],
        device: torch.device,
    ) -> Tensor:
        """Collective over ``groups``. torch's clip with the norm of the local gradient shards of ``counted`` over
        the ranks of ``groups``; the shards of ``copies`` (tied copies another rank counts) are scaled, not counted."""
        return clip_grad_norm_over_ranks_(
            _local_views(counted), max_norm, groups=groups, device=device, copies=_local_views(copies)
        )

    # ------------------------------------------------------------------ teardown
    @torch.no_grad()
    def restore(self) -> None:
        """Collective over the replicas. Gather every shard into the user's layers and put them back in the module
        in place of the copies (the module is plain again; the optimizers still hold the sharded copies).

        The user's layers come back on the host (:func:`full_tensors`: one whole tensor on the device at a time), where
        the reassembly after the run leaves the whole module: a stage that fits only sharded never exists whole on the
        device."""
        if self.is_restored:
            return
        for original, sharded in zip(self.originals, self.container.layers, strict=True):
            values = full_tensors(_named_tensors(sharded))
            for name, tensor in _named_tensors(original).items():
                tensor.data = values[name].to(tensor.dtype)
        for registration in self._registrations:
            registration.place(self.module)
        self.is_restored = True


class FullyShardSync(ReplicatedSync):
    """``zero_stage=3`` with data parallelism: a :class:`PipelineFullyShard` of the rank's layers, built at the split.

    FSDP2's hooks reduce-scatter each micro-batch's gradients during the schedule; afterwards only the tied copies'
    shards are summed over the pipeline ranks holding one. Clipping: the replicas hold disjoint rows of each stage's
    gradients, so the norm is reduced over the ``"shard"`` group, then the ``"pp"`` group.
    """

    def __init__(self, context: SyncContext) -> None:
        super().__init__(context)
        assert context.zero_config is not None, "zero_stage=3 has ZeRO settings"
        dims = context.dims
        self.backend = FullyShardBackend(
            context.zero_config,
            ZeroContext(
                rank=dims.global_rank,
                world_size=dims.world_size,
                mesh=context.mesh,
                warn=context.warn,
                # The tied copies' sum over the stages runs in `reduce_gradients`; clipping reduces its norm here.
                stage=StageExtensions(reduce_after_backward=False),
            ),
        )
        self.stage = PipelineFullyShard(
            context.module,
            context.layers,
            registrations=context.registrations,
            backend=self.backend,
            device=context.device,
            aliases=context.aliases,
        )
        self.sharded_names.update(self.stage.names)

    @staticmethod
    def check_split(tied: Sequence[TiedParameter], plan: StagePlan, pipeline_parallel_size: int) -> None:
        check_no_tie_within_a_rank(tied, plan, pipeline_parallel_size)

    @property
    def layers(self) -> dict[int, nn.Module]:
        return dict(self.stage.layers)

    def setup_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        super().setup_optimizers(optimizers)  # they hold the shards: the parameters were sharded at the split
        for optimizer in self.optimizers:
            check_shardable(optimizer, warn=self.context.warn)

    # ------------------------------------------------------------------ step
    def reduce_gradients(self) -> list[Tensor]:
        """Collective over the tied sets: FSDP2 reduce-scattered each micro-batch; the tied sum on the shards."""
        self.backend.reduce_gradients()
        self.sum_tied_copies()
        return []

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        counted, copies = self.counted_and_copies(optimizer)
        # The shard group holds disjoint rows of the stage's gradients (replica groups the same ones), the pipeline
        # ranks the stages.
        groups = [self.context.mesh.get_group("shard"), self.dims.pipeline_group]
        return self.stage.clip_grad_norm(counted, copies, max_norm, groups=groups, device=self.context.device)

    def abandon_in_flight(self) -> None:
        self.backend.abandon_in_flight()

    def teardown(self) -> None:
        self.backend.teardown()

    def restore_layers(self) -> None:
        """Collective over the replicas: the shards gathered into the user's layers, back in the module."""
        self.stage.restore()

    # ------------------------------------------------------------------ state
    def model_state(self) -> dict[str, Any]:
        state = full_tensors(self.module.state_dict())
        if self.backend.compute_dtype is not None:  # the 16-bit weights one device holds, not the fp32 masters
            state = cast_parameters(self.module, state, self.backend.compute_dtype)
        return state

    def load_model_entries(self, module: nn.Module, entries: dict[str, Any]) -> None:
        load_whole_parameters(module, entries)

    def stage_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective over the replicas: their rows gathered whole on every replica (after the run too)."""
        names = {**self.parameter_names(), **self.sharded_names}
        local = local_optimizer_state(optimizer, names, state_dict=whole_optimizer_state(optimizer))
        if self.backend.compute_dtype is not None:  # the sharded parameters are the fp32 masters: whole, by name
            params = [param for group in optimizer.param_groups for param in group["params"]]
            local[MASTER_WEIGHTS] = {names[id(p)]: _host_whole(p.detach()) for p in params}
        return local

    def load_stage_optimizer_state(self, optimizer: Optimizer, state: WholeOptimizerState) -> None:
        sliced = state.slice_for(optimizer, self.parameter_names())
        optimizer.load_state_dict(sliced)
        shard_optimizer_state(optimizer)  # each replica keeps its rows of the whole states
        masters = sliced.get(MASTER_WEIGHTS) or {}
        params = [param for group in optimizer.param_groups for param in group["params"]]
        with torch.no_grad():  # the exact fp32 masters, not the 16-bit weights the model state was loaded from
            for index, param in enumerate(params):
                master = masters.get(index)
                if master is not None and isinstance(param, DTensor):
                    _local(param).copy_(_local(local_shard(master, param)))

    def stage_pieces(self, optimizer: Optimizer | None) -> tuple[list[tuple[str, Tensor]], list[FlatPiece]]:
        """Each replica's rows (of the copies, also after the run)."""
        named = self._sharded_parameters(optimizer)
        return named, named_sharded_pieces(named, optimizer)

    def _sharded_parameters(self, optimizer: Optimizer | None) -> list[tuple[str, Tensor]]:
        """``(canonical name, shard)`` of this rank's parameters: the optimizer's (which a later ``validate`` does
        not replace), and those of the last split it does not hold (frozen ones)."""
        by_name = dict(self.stage.named_parameters())
        if optimizer is not None:
            for group in optimizer.param_groups:
                by_name.update((self.sharded_names[id(param)], param) for param in group["params"])
        return list(by_name.items())


# ---------------------------------------------------------------------- plain <-> sharded
def full_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    """Collective over each DTensor's mesh (in ``state``'s order on every replica). ``state`` with every tensor
    replaced by a host copy of its whole value (a plain tensor; a ``DTensor`` gathered first); other values as they
    are.

    One tensor at a time: each ``DTensor`` is gathered whole on the device, copied to the host (ZeRO's
    :func:`~lightning_parallel.distributed.checkpoint.host_copy`) and dropped before the next is gathered, as torch's
    ``get_model_state_dict(..., cpu_offload=True)`` does; gathering them all first would need the whole stage on the
    device at the moment of a save, which a stage that fits only sharded does not have."""
    return {key: _host_whole(value) if isinstance(value, Tensor) else value for key, value in state.items()}


def whole_optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """Collective over the replicas. ``optimizer.state_dict()`` with each state tensor a host copy of its whole value
    (:func:`full_tensors`: one on the device at a time)."""
    state_dict = optimizer.state_dict()
    return {**state_dict, "state": {index: full_tensors(state) for index, state in state_dict["state"].items()}}


def local_shard(whole: Tensor, like: DTensor) -> Tensor:
    """Local. This rank's rows of ``whole`` as FSDP2 shards ``like`` (``torch.chunk`` on dim 0), as a ``DTensor``."""
    rank, size = shard_coordinates(like)
    chunks = torch.chunk(whole, size, dim=0)
    rows = chunks[rank] if rank < len(chunks) else whole.new_empty((0, *whole.shape[1:]))
    local = rows.to(device=like.device, dtype=like.dtype).contiguous()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


@torch.no_grad()
def load_whole_parameters(module: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Local. Copy this rank's rows of each whole tensor of ``state`` into ``module``'s sharded parameters; other
    entries (buffers, plain parameters) are loaded as ``load_state_dict`` does (``strict=False``)."""
    sharded = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if isinstance(param, DTensor):
            sharded.add(name)
            if name in state:
                _local(param).copy_(_local(local_shard(state[name], param)))
    module.load_state_dict({k: v for k, v in state.items() if k not in sharded}, strict=False)


def shard_optimizer_state(optimizer: Optimizer) -> None:
    """Local. After ``optimizer.load_state_dict`` of whole tensors: each per-element state of a sharded parameter
    becomes this rank's rows, as a ``DTensor`` like the parameter (0-dim states such as Adam's ``step`` stay)."""
    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                state[key] = local_shard(value, param)


def _local_views(parameters: Sequence[Tensor]) -> list[Tensor]:
    """Plain tensors standing for the local shards of ``parameters``, each with ``.grad`` the local shard of the
    parameter's gradient (the same storage: scaling it scales the gradient)."""
    views = []
    for param in parameters:
        if param.grad is None:
            continue
        if not isinstance(param, DTensor):
            views.append(param)
            continue
        view = _local(param.detach())
        view.grad = _local(param.grad)
        views.append(view)
    return views


def _host_whole(tensor: Tensor) -> Tensor:
    """Collective over a ``DTensor``'s mesh. A host copy of ``tensor``'s whole value (gathered, copied, dropped)."""
    return host_copy(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _named_tensors(layer: nn.Module) -> dict[str, Tensor]:
    return {
        **dict(layer.named_parameters(remove_duplicate=False)),
        **dict(layer.named_buffers(remove_duplicate=False)),
    }


def _release(layers: Sequence[nn.Module]) -> None:
    """Local. Free the storage of the layers' tensors in place (the objects, their ``requires_grad`` and ties stay)."""
    for layer in layers:
        for tensor in _named_tensors(layer).values():
            tensor.data = tensor.data.new_empty(0)
