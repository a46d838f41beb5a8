"""Point the user's own ``torch.optim`` optimizer at this rank's shard, and convert its state to/from plain layout.

We keep the user's optimizer object (so Lightning, LR schedulers and ``param_groups`` keep working) and only swap
each group's ``params`` for the 1-D views of the pieces this rank owns. That is correct exactly for optimizers whose
update is element-wise; :func:`check_shardable` refuses the ones that need a parameter's whole shape.

The *consolidated* layout is what ``optimizer.state_dict()`` of the unsharded optimizer would return: state indexed
by the position of each parameter in ``configure_optimizers``' param groups, every per-element tensor in the
parameter's shape. It loads into plain single-device training and into any of our strategies at any world size.

Several optimizers may hold the same parameter (a layer shared by a GAN's generator and discriminator): each one's
groups then hold the same shard views, so each steps them with its own state (torch keys state per optimizer) and
reads the one ``.grad`` they share, exactly as two optimizers share a parameter on one device.

With fp32 master weights (16-bit parameters, :class:`ShardedParameterBuckets` ``master_dtype``) the optimizer steps
views of the master shard, so its state is fp32, and the consolidated state dict has one more top-level entry,
``"master_weights"``: ``{index: fp32 tensor in the parameter's shape}`` for every parameter of the optimizer that
has a master. ``torch.optim.Optimizer.load_state_dict`` ignores it (and casts the fp32 state to its parameters'
dtype), so the state still loads into plain single-device training; our strategies restore the master from it,
so a resume continues exactly. Without it (a plain bf16 checkpoint) the master is the upcast bf16 weights.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.distributed.checkpoint import FlatPiece, ShardedCheckpointReader, host_copy, place_scalar_state
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.flat_bucket import ShardView
from lightning_parallel.distributed.zero.local_shards import local_piece, local_tensor, whole_tensor

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedOptimizer", "check_shardable"]


class _GatherStaging:
    """Device buffers a consolidation gathers into, one set per dtype, reused for every bucket and state key.

    Fresh buffers per bucket would bound the device bytes only as well as the backend frees a finished collective's
    tensors: gloo drops its references on a worker thread a moment after ``wait()`` returns, so under load several
    buckets' buffers were alive at once. Reused buffers make the bound exact: this rank's shard and one gathered bucket.
    """

    def __init__(self, max_shard_numel: int) -> None:
        self.max_shard_numel = max_shard_numel
        self._shards: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._gathered: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def shard(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A ``numel``-long device buffer to fill with this rank's shard."""
        key = (dtype, torch.device(device))
        if key not in self._shards:
            self._shards[key] = torch.empty(self.max_shard_numel, dtype=dtype, device=device)
        return self._shards[key][:numel]

    def pieces(self, numel: int, world_size: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        """``world_size`` contiguous ``numel``-long views of one device buffer, to gather into."""
        key = (dtype, torch.device(device))
        if key not in self._gathered:
            self._gathered[key] = torch.empty(world_size * self.max_shard_numel, dtype=dtype, device=device)
        flat = self._gathered[key][: world_size * numel]
        return list(flat.view(world_size, numel).unbind())


ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")
    if hasattr(torch.optim, name)
)
_SHAPE_DEPENDENT = {
    "LBFGS": "it needs the whole flattened gradient and re-evaluates a closure",
    "Adafactor": "it factorises each parameter's second moment over the parameter's rows and columns",
    "SparseAdam": "it needs sparse gradients of whole embedding tables",
    "Muon": "it orthogonalises each whole weight matrix",
}


def check_shardable(optimizer: torch.optim.Optimizer, *, warn: Callable[[str], Any] = warnings.warn) -> None:
    """Raise ``TypeError`` for an optimizer whose update is not element-wise (stages 1-2 split parameters).

    An optimizer we do not know is accepted with a ``warn`` (a strategy passes its rank-zero warning).
    """
    name = type(optimizer).__name__
    if name in _SHAPE_DEPENDENT:
        raise TypeError(
            f"ShardedOptimizerStrategy cannot shard `{name}`: {_SHAPE_DEPENDENT[name]}, but stages 1-2 give each rank"
            " arbitrary slices of parameters. Use an element-wise optimizer (AdamW, Adam, SGD, RMSprop, Adagrad, ...),"
            " or `DataParallelStrategy`, which keeps whole parameters on every rank."
        )
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        warn(
            f"ShardedOptimizerStrategy assumes `{name}` updates each element independently (as AdamW or SGD do)."
            " If its update needs a parameter's whole shape, results will be wrong: use DataParallelStrategy."
        )


class ShardedOptimizer:
    """Makes ``optimizer`` step only this rank's pieces of its parameters; converts state to plain layout."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: ShardedParameterBuckets) -> None:
        if optimizer.state:
            raise RuntimeError("The optimizer already holds state; shard it before its first step.")
        self.optimizer = optimizer
        self.buckets = buckets
        self.group_params: list[list[nn.Parameter]] = [list(group["params"]) for group in optimizer.param_groups]
        held = {param for params in self.group_params for param in params}
        outside = len(held - set(buckets.parameters))
        if outside:
            raise ValueError(
                f"The optimizer holds {outside} parameter(s) that are not parameters of the LightningModule, so"
                " ZeRO-1/2 cannot shard them. Register them on the module (as `nn.Parameter` attributes or submodules)"
                " before `configure_optimizers` returns."
            )
        # Every parameter an optimizer holds is bucketed (frozen ones too), so each has its views on some rank.
        views_of: dict[nn.Parameter, list[ShardView]] = defaultdict(list)
        for view in buckets.views():
            if view.param in held:
                views_of[view.param].append(view)
                # `toggle_optimizer` switches `requires_grad` of these views: off means "ignore this gradient".
                view.tensor.requires_grad_(True)
        self.views_of = views_of
        self.views: list[ShardView] = [view for view in buckets.views() if view.param in held]
        """This rank's pieces of this optimizer's parameters."""
        self.bucket_indices: list[int] = buckets.bucket_indices(held)
        """The buckets holding this optimizer's parameters: the ones to all-gather after its step."""
        for group, params in zip(optimizer.param_groups, self.group_params, strict=True):
            group["params"] = [view.tensor for param in params for view in views_of[param]]

    def _indexed_params(self) -> list[nn.Parameter]:
        return [param for params in self.group_params for param in params]

    # ------------------------------------------------------------------ save
    def consolidated_state_dict(self, *, destination: int = 0) -> dict[str, Any]:
        """Collective. The unsharded ``optimizer.state_dict()`` on ``destination``, on the CPU; ``{}`` on other ranks.

        Exactly torch's: a parameter never stepped (no gradient yet) has no entry, and each parameter keeps its own
        0-dim state (Adam's ``step`` counts only the steps in which that parameter had a gradient).

        Assembled on the CPU one bucket and state key at a time: the device holds at most one gathered bucket (and
        this rank's shard of it) beyond what training holds, so saving fits wherever training fits.
        """
        state_of = self._state_by_index()
        keys = sorted({key for element_keys, _ in state_of.values() for key in element_keys})
        state: dict[int, dict[str, Any]] = defaultdict(dict)
        is_destination = self.buckets.rank == destination
        index_of = {param: index for index, param in enumerate(self._indexed_params())}
        staging = _GatherStaging(max((self.buckets.buckets[i].shard_numel for i in self.bucket_indices), default=0))
        for bucket_index in self.bucket_indices:
            bucket = self.buckets.buckets[bucket_index]
            for key in keys:
                full = self._gather_bucket_state(bucket, key, destination, staging)
                if full is None:
                    continue
                for segment in bucket.segments:
                    index = index_of.get(segment.param)
                    if index is None or key not in state_of.get(index, ((), {}))[0]:
                        continue
                    piece = full[segment.offset : segment.offset + segment.numel]
                    state[index][key] = piece.view(local_tensor(segment.param).shape).clone()
        masters = self._gather_master_weights(destination, index_of, staging)
        del staging
        if not is_destination:
            return {}
        self._gather_split_parameters(state, masters)
        for index, (_, scalars) in state_of.items():
            state[index].update({key: value.clone() for key, value in scalars.items()})
        groups = []
        offset = 0
        for group, params in zip(self.optimizer.param_groups, self.group_params, strict=True):
            saved = {key: value for key, value in group.items() if key != "params"}
            saved["params"] = list(range(offset, offset + len(params)))
            offset += len(params)
            groups.append(saved)
        consolidated: dict[str, Any] = {
            "state": {index: state[index] for index in sorted(state)},
            "param_groups": groups,
        }
        if masters:
            consolidated["master_weights"] = masters
        return consolidated

    def _gather_split_parameters(self, state: dict[int, dict[str, Any]], masters: dict[int, Tensor]) -> None:
        """Collective over the tensor ranks (every destination of a tensor-parallel group, the same parameters and
        keys in the same order). Each split weight's state and master, in its local shape so far, gathered whole: the
        single-device layout (``distributed/zero/local_shards.py``; a plain parameter is left as it is)."""
        params = self._indexed_params()
        for index in sorted(state):
            for key, value in state[index].items():
                if value.dim() > 0:
                    state[index][key] = whole_tensor(params[index], value)
        for index in sorted(masters):
            masters[index] = whole_tensor(params[index], masters[index])

    def _gather_master_weights(
        self, destination: int, index_of: dict[nn.Parameter, int], staging: _GatherStaging
    ) -> dict[int, Tensor]:
        """Collective. The fp32 master of each of this optimizer's parameters, in its shape, on ``destination``'s
        CPU."""
        masters: dict[int, Tensor] = {}
        for bucket_index in self.bucket_indices:
            bucket = self.buckets.buckets[bucket_index]
            if bucket.master is None:
                continue
            full = self._gather_to_host(bucket.master, destination, staging)
            if full is None:
                continue
            for segment in bucket.segments:
                index = index_of.get(segment.param)
                if index is not None:
                    piece = full[segment.offset : segment.offset + segment.numel]
                    masters[index] = piece.view(local_tensor(segment.param).shape).clone()
        return masters

    def sharded_pieces(self) -> list[FlatPiece]:
        """This rank's pieces of parameters and per-element optimizer state, for a sharded checkpoint."""
        pieces = []
        for view in self.views:
            pieces.append(FlatPiece("param", view.name, view.start, view.stop, view.tensor))
            for key, value in self.optimizer.state.get(view.tensor, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    pieces.append(FlatPiece(key, view.name, view.start, view.stop, value))
        return pieces

    def scalar_states_by_name(self) -> dict[str, dict[str, Tensor]]:
        """Collective. Each parameter's own 0-dim optimizer state (e.g. Adam's ``step``) by name, for the parameters
        that have state."""
        params = self._indexed_params()
        name_of = {segment.param: segment.name for bucket in self.buckets.buckets for segment in bucket.segments}
        return {name_of[params[index]]: scalars for index, (_, scalars) in self._state_by_index().items()}

    def _state_by_index(self) -> dict[int, tuple[list[str], dict[str, Tensor]]]:
        """Collective. For each parameter (by index) with state on any rank: its per-element state keys and its
        0-dim state values. Every rank holding a piece of a parameter steps it at the same steps, so they agree."""
        index_of = {param: index for index, param in enumerate(self._indexed_params())}
        local: dict[int, tuple[list[str], dict[str, Tensor]]] = {}
        for view in self.views:
            state = self.optimizer.state.get(view.tensor)
            if state:
                keys = sorted(key for key, value in state.items() if isinstance(value, Tensor) and value.dim() > 0)
                # Host copies before the object collective: a fused or capturable Adam keeps `step` on the device.
                scalars = {
                    key: host_copy(value) if isinstance(value, Tensor) else torch.tensor(value)
                    for key, value in state.items()
                    if not (isinstance(value, Tensor) and value.dim())
                }
                local[index_of[view.param]] = (keys, scalars)
        gathered: list[Any] = [None] * self.buckets.world_size
        dist.all_gather_object(gathered, local, group=self.buckets.group)
        merged: dict[int, tuple[list[str], dict[str, Tensor]]] = {}
        for entries in gathered:
            merged.update(entries)
        return dict(sorted(merged.items()))

    def _gather_bucket_state(self, bucket: Any, key: str, destination: int, staging: _GatherStaging) -> Tensor | None:
        """Collective. The whole flat bucket of state ``key`` on ``destination``'s CPU (``None`` elsewhere)."""
        # The state has the dtype of what the optimizer steps: the fp32 master's, else the parameters'.
        shard = staging.shard(bucket.shard_numel, bucket.shard_grads.dtype, bucket.flat_params.device)
        shard.zero_()
        for view in bucket.views:
            value = self.optimizer.state.get(view.tensor, {}).get(key)
            if value is not None:
                shard[view.grad_offset : view.grad_offset + value.numel()].copy_(value.reshape(-1))
        return self._gather_to_host(shard, destination, staging)

    def _gather_to_host(self, shard: Tensor, destination: int, staging: _GatherStaging) -> Tensor | None:
        """Collective. Every rank's ``shard`` (on the device, as the group's backend needs), concatenated in rank
        order on ``destination``'s CPU; ``None`` on the other ranks.

        The pieces are received into ``staging``'s buffer, reused for every bucket, and copied to the CPU: the device
        holds one gathered bucket at most, and the concatenation, the per-parameter slices and the checkpoint are the
        CPU's."""
        if self.buckets.rank != destination:
            dist.gather(shard, None, group_dst=destination, group=self.buckets.group)
            return None
        pieces = staging.pieces(shard.numel(), self.buckets.world_size, shard.dtype, shard.device)
        dist.gather(shard, pieces, group_dst=destination, group=self.buckets.group)
        return torch.cat([host_copy(piece) for piece in pieces])

    # ------------------------------------------------------------------ load
    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's slices of a plain (unsharded) optimizer state dict. Local: no collective."""
        check_matching_optimizer_state(state_dict, self.group_params)
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"], strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"})
        self.optimizer.state.clear()
        saved_state = state_dict["state"]
        index = -1
        for group, params in zip(self.optimizer.param_groups, self.group_params, strict=True):
            for param in params:
                index += 1
                entry = saved_state.get(index, saved_state.get(str(index)))
                if not entry:
                    continue
                for view in self.views_of[param]:
                    state = {key: _slice_state(key, value, view, group) for key, value in entry.items()}
                    self.optimizer.state[view.tensor] = state
        masters = state_dict.get("master_weights") or {}
        for index, param in enumerate(self._indexed_params()):
            master = masters.get(index, masters.get(str(index)))
            if master is None:
                continue
            for view in self.views_of[param]:
                if _is_master(view):
                    with torch.no_grad():
                        view.tensor.copy_(local_piece(view.param, master).reshape(-1)[view.start : view.stop])


def load_from_reader(sharded: ShardedOptimizer, reader: ShardedCheckpointReader, module: nn.Module) -> None:
    """Collective. Load this rank's slices of optimizer state straight from a sharded checkpoint (no full state)."""
    name_of = {param: name for name, param in module.named_parameters()}
    check_matching_groups(reader.meta.get("param_groups"), [[name_of[p] for p in ps] for ps in sharded.group_params])
    for group, saved in zip(sharded.optimizer.param_groups, reader.meta["param_groups"], strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})
    views = sharded.views
    requests = [
        (key, view.name, view.start, view.stop) for view in views for key in reader.keys_of(view.name) if key != "param"
    ]
    # With fp32 master weights the sharded checkpoint's "param" pieces are the masters (see `sharded_pieces`).
    masters = [("param", view.name, view.start, view.stop) for view in views if _is_master(view)]
    values = reader.read(requests + masters)
    with torch.no_grad():
        for key in masters:
            view = next(v for v in views if (v.name, v.start, v.stop) == key[1:])
            view.tensor.copy_(values[key])
    sharded.optimizer.state.clear()
    group_of = {id(tensor): group for group in sharded.optimizer.param_groups for tensor in group["params"]}
    for view in views:
        state = {
            key: values[(key, view.name, view.start, view.stop)].to(view.tensor.device, view.tensor.dtype)
            for key in reader.keys_of(view.name)
            if key != "param"
        }
        if state:
            scalars = reader.meta["scalars"].get(view.name, {})
            group = group_of[id(view.tensor)]
            state.update({k: place_scalar_state(k, v, param=view.tensor, group=group) for k, v in scalars.items()})
            sharded.optimizer.state[view.tensor] = state


def check_matching_groups(saved_groups: list[dict] | None, group_names: list[list[str]]) -> None:
    """Raise ``ValueError`` when a checkpoint's param groups do not name these parameters (another model)."""
    saved = [list(group["params"]) for group in saved_groups or []]
    if saved != group_names:
        raise ValueError(
            f"The checkpoint's optimizer param groups hold parameters {[len(g) for g in saved]} ({_first(saved)}...),"
            f" this model's {[len(g) for g in group_names]} ({_first(group_names)}...): the checkpoint comes from a"
            " different model or `configure_optimizers`."
        )


def _first(groups: list[list[str]]) -> str:
    return next((group[0] for group in groups if group), "none")


def _is_master(view: ShardView) -> bool:
    """Whether ``view`` is a piece of an fp32 master (the parameter itself is 16-bit)."""
    return view.tensor.dtype != view.param.dtype


def _slice_state(key: str, value: Any, view: ShardView, group: dict[str, Any]) -> Any:
    if isinstance(value, Tensor) and value.dim() > 0:
        piece = local_piece(view.param, value).reshape(-1)[view.start : view.stop]
        return piece.to(device=view.tensor.device, dtype=view.tensor.dtype).clone()
    return place_scalar_state(key, value, param=view.tensor, group=group)


def check_matching_optimizer_state(state_dict: dict[str, Any], group_params: list[list[nn.Parameter]]) -> None:
    """Raise ``ValueError`` when a saved optimizer state does not fit these param groups (a different model)."""
    saved_groups = state_dict.get("param_groups", [])
    saved_sizes = [len(group["params"]) for group in saved_groups]
    sizes = [len(params) for params in group_params]
    if saved_sizes != sizes:
        raise ValueError(
            f"The checkpoint's optimizer has param groups of sizes {saved_sizes}, this model's optimizer {sizes}:"
            " the checkpoint comes from a different model or `configure_optimizers`. Load a checkpoint of this model."
        )
    saved_state = state_dict.get("state", {})
    index = 0
    for params in group_params:
        for param in params:
            entry = saved_state.get(index, saved_state.get(str(index), {}))
            for key, value in entry.items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.numel() != param.numel():
                    raise ValueError(
                        f"The checkpoint's optimizer state `{key}` of parameter #{index} has {value.numel()} elements,"
                        f" this model's parameter has {param.numel()} (shape {tuple(param.shape)}): the checkpoint"
                        " comes from a different model."
                    )
            index += 1
