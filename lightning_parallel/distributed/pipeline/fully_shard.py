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
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel.distributed.checkpoint import FlatPiece, host_copy
from lightning_parallel.distributed.pipeline.consolidate import MASTER_WEIGHTS, local_optimizer_state
from lightning_parallel.distributed.pipeline.layer_registration import Registration
from lightning_parallel.distributed.pipeline.tied import canonical_names
from lightning_parallel.distributed.zero.local_shards import local_piece, local_tensor
from lightning_parallel.distributed.zero.optimizer import check_shardable
from lightning_parallel.distributed.zero.stage3 import cast_parameters, named_sharded_pieces, shard_coordinates

__all__ = [
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
    """ZeRO-3's preparation of a pipeline stage: a rank's layers replaced in ``module`` by copies under one
    :attr:`container`, which the stage's ZeRO backend (``FullyShardBackend``, chosen by
    :func:`~lightning_parallel.distributed.zero.backends.backend_type`) then shards with FSDP2 over the replicas.

    Building it is local; every replica of the stage must build it from equal weights (the split broadcast rank 0's).
    Then ``backend.setup_module(container, device)`` shards the copies, and :meth:`finish` puts the tensors the layers
    hold themselves in place. Do this before the optimizers are created: they must hold the sharded parameters.

    The backend holds the container (whose parameter names are not the model's), and its checkpoint state is the
    whole model's on global rank 0: the stage-keyed state is read here instead, under the model's names, each
    ``DTensor`` gathered over the stage's replicas (``distributed/pipeline/run.py`` asks for it).

    Args:
        module: the user's (split) module.
        layers: this rank's pipeline layers by index (the user's objects).
        registrations: for each layer index, where its modules are registered in ``module``.
        warn: how to warn about an optimizer not known to update element-wise.
    """

    def __init__(
        self,
        module: nn.Module,
        layers: Mapping[int, nn.Module],
        *,
        registrations: Sequence[Sequence[Registration]],
        warn: Callable[[str], Any] = warnings.warn,
    ) -> None:
        self.module = module
        self.warn = warn
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
        """FSDP2's root for the copies (the units of a stage share one communication context)."""
        self.layers = dict(zip(self.indices, copies, strict=True))
        """The sharded copies by layer index: what the stages run."""
        self.names: dict[int, str] = {}
        """``id`` of each sharded parameter -> its canonical name (what the optimizers hold, also after teardown);
        set by :meth:`finish`."""
        self.is_restored = False
        """Whether :meth:`restore` put the user's layers back (after the run; the optimizers keep the shards)."""

    def finish(self, aliases: Mapping[str, str]) -> None:
        """Local, once the backend sharded :attr:`container` (which replaces a module's own parameters): register the
        tensors the layers hold themselves in the module, and record the sharded parameters' names."""
        for registration in self._registrations:
            if registration.is_tensor:
                registration.place(self.module, holder=self._copy_of[id(registration.holder)])
        self.names = canonical_names(self.module, aliases)

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """Local. ``(canonical name, sharded parameter)`` of every parameter this rank holds, once each (also after
        :meth:`restore`: the optimizers step these)."""
        return [(self.names[id(param)], param) for param in self.container.parameters()]

    def check_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Local. Refuse an optimizer whose update needs whole parameters (each replica steps rows of them)."""
        for optimizer in optimizers:
            check_shardable(optimizer, warn=self.warn)

    # ------------------------------------------------------------------ state, by the model's names
    def model_state(self, compute_dtype: torch.dtype | None) -> dict[str, Any]:
        """Collective over the replicas. The stage's ``state_dict`` with whole tensors on the host; with fp32 masters
        (``compute_dtype``: their 16-bit dtype) the 16-bit weights one device holds."""
        state = full_tensors(self.module.state_dict())
        return cast_parameters(self.module, state, compute_dtype) if compute_dtype is not None else state

    def optimizer_state(self, optimizer: Optimizer, names: Mapping[int, str], *, has_masters: bool) -> dict[str, Any]:
        """Collective over the replicas: their rows gathered whole on every replica (after the run too), keyed by
        ``names`` (canonical, the earlier splits' sharded parameters included)."""
        local = local_optimizer_state(optimizer, names, state_dict=whole_optimizer_state(optimizer))
        if has_masters:  # the sharded parameters are the fp32 masters: whole, by name
            params = [param for group in optimizer.param_groups for param in group["params"]]
            local[MASTER_WEIGHTS] = {names[id(p)]: _host_whole(p.detach()) for p in params}
        return local

    def load_optimizer_state(self, optimizer: Optimizer, sliced: dict[str, Any]) -> None:
        """Local. Load this rank's part of the whole model's state (whole tensors), keeping each replica's rows."""
        optimizer.load_state_dict(sliced)
        shard_optimizer_state(optimizer)  # each replica keeps its rows of the whole states
        masters = sliced.get(MASTER_WEIGHTS) or {}
        params = [param for group in optimizer.param_groups for param in group["params"]]
        with torch.no_grad():  # the exact fp32 masters, not the 16-bit weights the model state was loaded from
            for index, param in enumerate(params):
                master = masters.get(index)
                if master is not None and isinstance(param, DTensor):
                    _local(param).copy_(_local(local_shard(master, param)))

    def pieces(
        self, optimizer: Optimizer | None, sharded_names: Mapping[int, str]
    ) -> tuple[list[tuple[str, Tensor]], list[FlatPiece]]:
        """Local. ``(canonical name, shard)`` of this rank's parameters, and each replica's rows for the sharded
        format: the optimizer's (which a later ``validate`` does not replace), and those of the last split it does
        not hold (frozen ones)."""
        by_name = dict(self.named_parameters())
        if optimizer is not None:
            for group in optimizer.param_groups:
                by_name.update((sharded_names[id(param)], param) for param in group["params"])
        named = list(by_name.items())
        return named, named_sharded_pieces(named, optimizer)

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
                # A split weight (tensor parallelism) takes this tensor rank's slice, into the tensor it wraps.
                local_tensor(tensor).data = local_piece(tensor, values[name]).to(tensor.dtype)
        for registration in self._registrations:
            registration.place(self.module)
        self.is_restored = True


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
            local = local_tensor(tensor)  # a split weight's storage is the tensor it wraps
            local.data = local.data.new_empty(0)
