"""Point the user's own ``torch.optim`` optimizer at this rank's shard, and convert its state to/from plain layout.

We keep the user's optimizer object (so Lightning, LR schedulers and ``param_groups`` keep working) and only swap
each group's ``params`` for the 1-D views of the pieces this rank owns. That is correct exactly for optimizers whose
update is element-wise; :func:`check_shardable` refuses the ones that need a parameter's whole shape.

The *consolidated* layout is what ``optimizer.state_dict()`` of the unsharded optimizer would return: state indexed
by the position of each parameter in ``configure_optimizers``' param groups, every per-element tensor in the
parameter's shape. It loads into plain single-device training and into any of our strategies at any world size.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_parallel.distributed.checkpoint import FlatPiece, ShardedCheckpointReader
from lightning_parallel.distributed.zero import ShardedParameterBuckets, ShardView

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedOptimizer", "check_shardable"]

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


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``TypeError`` for an optimizer whose update is not element-wise (stages 1-2 split parameters)."""
    name = type(optimizer).__name__
    if name in _SHAPE_DEPENDENT:
        raise TypeError(
            f"ShardedOptimizerStrategy cannot shard `{name}`: {_SHAPE_DEPENDENT[name]}, but stages 1-2 give each rank"
            " arbitrary slices of parameters. Use an element-wise optimizer (AdamW, Adam, SGD, RMSprop, Adagrad, ...),"
            " or `DataParallelStrategy`, which keeps whole parameters on every rank."
        )
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        rank_zero_warn(
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
        # Frozen parameters (requires_grad=False) are not bucketed and get no view: like torch, they never step.
        views_of: dict[nn.Parameter, list[ShardView]] = defaultdict(list)
        for view in buckets.views():
            views_of[view.param].append(view)
        self.views_of = views_of
        for group, params in zip(optimizer.param_groups, self.group_params, strict=True):
            group["params"] = [view.tensor for param in params for view in views_of[param]]

    def _indexed_params(self) -> list[nn.Parameter]:
        return [param for params in self.group_params for param in params]

    # ------------------------------------------------------------------ save
    def consolidated_state_dict(self, *, destination: int = 0) -> dict[str, Any]:
        """Collective. The unsharded ``optimizer.state_dict()`` on ``destination``; ``{}`` on other ranks."""
        keys, scalars = self._state_keys_and_scalars()
        state: dict[int, dict[str, Any]] = defaultdict(dict)
        is_destination = self.buckets.rank == destination
        index_of = {param: index for index, param in enumerate(self._indexed_params())}
        for bucket in self.buckets.buckets:
            for key in keys:
                full = self._gather_bucket_state(bucket, key, destination)
                if not is_destination:
                    continue
                for segment in bucket.segments:
                    piece = full[segment.offset : segment.offset + segment.numel]
                    state[index_of[segment.param]][key] = piece.view_as(segment.param).clone()
        if not is_destination:
            return {}
        if keys or scalars:
            for index in range(len(index_of)):
                state[index].update({key: value.clone() for key, value in scalars.items()})
        groups = []
        offset = 0
        for group, params in zip(self.optimizer.param_groups, self.group_params, strict=True):
            saved = {key: value for key, value in group.items() if key != "params"}
            saved["params"] = list(range(offset, offset + len(params)))
            offset += len(params)
            groups.append(saved)
        return {"state": dict(state), "param_groups": groups}

    def sharded_pieces(self) -> list[FlatPiece]:
        """This rank's pieces of parameters and per-element optimizer state, for a sharded checkpoint."""
        pieces = []
        for view in self.buckets.views():
            pieces.append(FlatPiece("param", view.name, view.start, view.stop, view.tensor))
            for key, value in self.optimizer.state.get(view.tensor, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    pieces.append(FlatPiece(key, view.name, view.start, view.stop, value))
        return pieces

    def scalar_states(self) -> dict[str, Tensor]:
        """Collective. 0-dim optimizer state (e.g. Adam's ``step``), the same for every parameter."""
        return self._state_keys_and_scalars()[1]

    def _state_keys_and_scalars(self) -> tuple[list[str], dict[str, Tensor]]:
        """Per-element state keys and 0-dim state values, agreed across ranks (ranks may own no piece)."""
        local_keys: list[str] = []
        local_scalars: dict[str, Tensor] = {}
        for state in self.optimizer.state.values():
            local_keys = sorted(key for key, value in state.items() if isinstance(value, Tensor) and value.dim() > 0)
            local_scalars = {
                key: value for key, value in state.items() if not (isinstance(value, Tensor) and value.dim())
            }
            break
        gathered: list[Any] = [None] * self.buckets.world_size
        dist.all_gather_object(gathered, (local_keys, local_scalars), group=self.buckets.group)
        for keys, scalars in gathered:
            if keys or scalars:
                return keys, {k: v if isinstance(v, Tensor) else torch.tensor(v) for k, v in scalars.items()}
        return [], {}

    def _gather_bucket_state(self, bucket: Any, key: str, destination: int) -> Tensor:
        shard = torch.zeros(bucket.shard_numel, dtype=bucket.flat_params.dtype, device=bucket.flat_params.device)
        shard_start = self.buckets.rank * bucket.shard_numel
        for view in bucket.views:
            value = self.optimizer.state.get(view.tensor, {}).get(key)
            if value is not None:
                begin = _bucket_offset(bucket, view) - shard_start
                shard[begin : begin + value.numel()].copy_(value.reshape(-1))
        pieces = None
        if self.buckets.rank == destination:
            pieces = [torch.empty_like(shard) for _ in range(self.buckets.world_size)]
        dist.gather(shard, pieces, dst=destination, group=self.buckets.group)
        return torch.cat(pieces) if pieces is not None else shard

    # ------------------------------------------------------------------ load
    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's slices of a plain (unsharded) optimizer state dict. Local: no collective."""
        check_matching_optimizer_state(state_dict, self.group_params)
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"], strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"})
        self.optimizer.state.clear()
        saved_state = state_dict["state"]
        for index, param in enumerate(self._indexed_params()):
            entry = saved_state.get(index, saved_state.get(str(index)))
            if not entry:
                continue
            for view in self.views_of[param]:
                self.optimizer.state[view.tensor] = {key: _slice_state(value, view) for key, value in entry.items()}


def load_from_reader(sharded: ShardedOptimizer, reader: ShardedCheckpointReader, module: nn.Module) -> None:
    """Collective. Load this rank's slices of optimizer state straight from a sharded checkpoint (no full state)."""
    name_of = {param: name for name, param in module.named_parameters()}
    check_matching_groups(reader.meta.get("param_groups"), [[name_of[p] for p in ps] for ps in sharded.group_params])
    for group, saved in zip(sharded.optimizer.param_groups, reader.meta["param_groups"], strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})
    views = sharded.buckets.views()
    requests = [
        (key, view.name, view.start, view.stop) for view in views for key in reader.keys_of(view.name) if key != "param"
    ]
    values = reader.read(requests)
    sharded.optimizer.state.clear()
    for view in views:
        state = {
            key: values[(key, view.name, view.start, view.stop)].to(view.tensor.device, view.tensor.dtype)
            for key in reader.keys_of(view.name)
            if key != "param"
        }
        if state:
            scalars = reader.meta["scalars"].get(view.name, {})
            state.update({k: v.clone() if isinstance(v, Tensor) else v for k, v in scalars.items()})
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


def _bucket_offset(bucket: Any, view: ShardView) -> int:
    for segment in bucket.segments:
        if segment.param is view.param:
            return segment.offset + view.start
    raise AssertionError("view not in bucket")


def _slice_state(value: Any, view: ShardView) -> Any:
    if isinstance(value, Tensor) and value.dim() > 0:
        piece = value.reshape(-1)[view.start : view.stop]
        return piece.to(device=view.tensor.device, dtype=view.tensor.dtype).clone()
    return value.clone() if isinstance(value, Tensor) else value


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
