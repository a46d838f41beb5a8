"""Consolidated checkpoints: the stages' state dicts and optimizer states as one single-device state.

The interchange format shared with the other strategies of this package is what single-device training saves:
``state_dict`` with the model's own parameter names, and ``optimizer.state_dict()`` whose integer parameter ids
follow the param_groups of the user's ``configure_optimizers`` on the *whole* model. A pipeline rank holds only its
stage's parameters, so we record that whole-model layout (by parameter name) once before splitting and translate
between it and each rank's local optimizer.

The stages' parts reach pipeline rank 0 one rank and one tensor at a time (:func:`.transfer.gather_to_pipeline_root`),
each copied to its host as it arrives: the consolidated state is the host's, and no accelerator holds more than one
tensor beyond what training holds (an object collective would put every stage's pickled tensors on rank 0's GPU).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.transfer import gather_to_pipeline_root

__all__ = [
    "OptimizerLayout",
    "WholeOptimizerState",
    "consolidate_buffers",
    "consolidate_optimizer_state",
    "consolidate_state_dict",
    "load_local_state",
    "local_optimizer_state",
    "optimizer_layout",
    "sharded_meta",
    "slice_optimizer_state",
]

MASTER_WEIGHTS = "master_weights"
"""The optimizer state's entry of ZeRO's fp32 master weights (``distributed/zero/optimizer.py``), carried through the
pipeline's consolidation by parameter name like the per-parameter state."""

OptimizerLayout = list[list[str]]
"""Parameter names of every param group of one optimizer, in the order of the whole model's optimizer."""


def optimizer_layout(optimizer: Optimizer, names: Mapping[int, str]) -> OptimizerLayout:
    """The names of ``optimizer``'s parameters per group (``names`` maps ``id(param)`` to its name)."""
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def consolidate_state_dict(
    module: nn.Module,
    full_keys: Sequence[str],
    dims: ParallelDims,
    *,
    aliases: Mapping[str, str] | None = None,
    local: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The whole model's ``state_dict`` in its original key order, on pipeline rank 0 (a collective).

    Keys not held by any layer (buffers of metrics, ...) exist on every rank; pipeline rank 0's copy is used.
    ``aliases`` (other name -> canonical name of a tied parameter) makes every name of a tied parameter hold the
    same tensor, as in a single-device ``state_dict`` (so ``torch.save`` writes it once), whichever stages held it.
    ``local``: this rank's state dict with whole tensors (default ``module.state_dict()``; ZeRO-3 gathers its shards).
    """
    merged = _merged_on_pipeline_root(dict(module.state_dict() if local is None else local), dims)
    if merged is None:
        return None
    for alias, canonical in (aliases or {}).items():
        if canonical in merged:
            merged[alias] = merged[canonical]
    missing = [key for key in full_keys if key not in merged]
    assert not missing, f"no stage holds {missing}"
    return {key: merged[key] for key in full_keys}


def local_optimizer_state(
    optimizer: Optimizer,
    names: Mapping[int, str],
    *,
    state_dict: Mapping[str, Any] | None = None,
    group_params: Sequence[Sequence[nn.Parameter]] | None = None,
) -> dict[str, Any]:
    """This rank's optimizer state keyed by parameter name, with its param groups' settings.

    ``state_dict`` and ``group_params``: a plain state dict of this rank's parameters and the parameters it numbers,
    for an optimizer that steps something else (ZeRO's shard views); default ``optimizer``'s own. The tensors are
    ``state_dict``'s own (no copy: :func:`consolidate_optimizer_state` moves them to the root's host one at a time).
    """
    if state_dict is None:
        state_dict = optimizer.state_dict()
    if group_params is None:
        group_params = [group["params"] for group in optimizer.param_groups]
    index_to_name = {}
    index = 0
    for params in group_params:
        for param in params:
            index_to_name[index] = names[id(param)]
            index += 1
    local = {
        "state": {index_to_name[i]: dict(s) for i, s in state_dict["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]],
    }
    masters = state_dict.get(MASTER_WEIGHTS)
    if masters:  # ZeRO's fp32 masters of 16-bit parameters (``distributed/zero/optimizer.py``), by name like the state
        local[MASTER_WEIGHTS] = {index_to_name[int(i)]: t.detach() for i, t in masters.items()}
    return local


def consolidate_optimizer_state(
    optimizer: Optimizer,
    names: Mapping[int, str],
    layout: OptimizerLayout,
    dims: ParallelDims,
    *,
    local: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The single-device ``optimizer.state_dict()`` of the whole model, on pipeline rank 0 (a collective).

    ``local``: this rank's part as :func:`local_optimizer_state` returns it (default: from ``optimizer``).
    """
    if local is None:
        local = local_optimizer_state(optimizer, names)
    gathered = gather_to_pipeline_root(local, dims)
    if gathered is None:
        return None
    state_by_name: dict[str, Any] = {}
    masters_by_name: dict[str, Any] = {}
    for part in gathered:
        state_by_name.update(part["state"])
        masters_by_name.update(part.get(MASTER_WEIGHTS, {}))
    state: dict[int, Any] = {}
    masters: dict[int, Any] = {}
    param_groups = []
    index = 0
    for group_index, group_names in enumerate(layout):
        settings = copy.deepcopy(gathered[0]["groups"][group_index])
        ids = []
        for name in group_names:
            if name in state_by_name:
                state[index] = state_by_name[name]
            if name in masters_by_name:
                masters[index] = masters_by_name[name]
            ids.append(index)
            index += 1
        param_groups.append({**settings, "params": ids})
    whole = {"state": state, "param_groups": param_groups}
    if masters:
        whole[MASTER_WEIGHTS] = masters
    return whole


def slice_optimizer_state(
    full_state: Mapping[str, Any],
    optimizer: Optimizer,
    names: Mapping[int, str],
    layout: OptimizerLayout,
    *,
    group_params: Sequence[Sequence[nn.Parameter]] | None = None,
) -> dict[str, Any]:
    """This rank's part of a single-device optimizer state dict, as ``optimizer.load_state_dict`` expects it.

    ``group_params``: the parameters to number per group instead of ``optimizer``'s (ZeRO's optimizer steps shard
    views: its plain state dict numbers the whole parameters it was given).

    Raises:
        ValueError: If the saved state's param groups do not match the model's optimizer layout.
    """
    saved_groups = full_state["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g) for g in layout]:
        raise ValueError(
            "The checkpoint's optimizer has param groups of sizes"
            f" {[len(g['params']) for g in saved_groups]}, but `configure_optimizers` builds"
            f" {[len(g) for g in layout]}; the checkpoint belongs to a different model or optimizer set-up."
        )
    name_to_saved_id = {
        name: saved_id
        for group_names, group in zip(layout, saved_groups, strict=True)
        for name, saved_id in zip(group_names, group["params"], strict=True)
    }
    state: dict[int, Any] = {}
    saved_masters = full_state.get(MASTER_WEIGHTS) or {}
    masters: dict[int, Any] = {}
    param_groups = []
    index = 0
    if group_params is None:
        group_params = [group["params"] for group in optimizer.param_groups]
    for params, saved in zip(group_params, saved_groups, strict=True):
        ids = []
        for param in params:
            saved_id = name_to_saved_id[names[id(param)]]
            if saved_id in full_state["state"]:
                state[index] = full_state["state"][saved_id]
            master = saved_masters.get(saved_id, saved_masters.get(str(saved_id)))
            if master is not None:
                masters[index] = master
            ids.append(index)
            index += 1
        param_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    sliced = {"state": state, "param_groups": param_groups}
    if masters:
        sliced[MASTER_WEIGHTS] = masters
    return sliced


@dataclass(frozen=True)
class WholeOptimizerState:
    """A single-device ``optimizer.state_dict()`` of the whole model and the layout its integer ids follow."""

    state: Mapping[str, Any]
    """As single-device training saves it (``"state"``, ``"param_groups"``)."""
    layout: OptimizerLayout
    """The whole model's parameter names per group (:func:`optimizer_layout`), recorded before the split."""

    def slice_for(
        self,
        optimizer: Optimizer,
        names: Mapping[int, str],
        *,
        group_params: Sequence[Sequence[nn.Parameter]] | None = None,
    ) -> dict[str, Any]:
        """This rank's part, as ``optimizer.load_state_dict`` expects it (:func:`slice_optimizer_state`)."""
        return slice_optimizer_state(self.state, optimizer, names, self.layout, group_params=group_params)


def consolidate_buffers(module: nn.Module, dims: ParallelDims) -> dict[str, Any] | None:
    """Every state entry that is not a parameter (buffers of all stages, metric states), on pipeline rank 0."""
    parameters = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return _merged_on_pipeline_root({k: v for k, v in module.state_dict().items() if k not in parameters}, dims)


def _merged_on_pipeline_root(local: dict[str, Any], dims: ParallelDims) -> dict[str, Any] | None:
    """Collective over the pipeline group: every rank's ``local`` entries merged on pipeline rank 0 (``None``
    elsewhere); where several ranks hold a key (buffers of metrics), the lowest pipeline rank's value wins."""
    gathered = gather_to_pipeline_root(local, dims)
    if gathered is None:
        return None
    merged: dict[str, Any] = {}
    for part in reversed(gathered):
        merged.update(part)
    return merged


def load_local_state(
    module: nn.Module,
    saved: Mapping[str, Any],
    full_keys: Sequence[str],
    *,
    strict: bool,
    aliases: Mapping[str, str] | None = None,
    load: Callable[[nn.Module, dict[str, Any]], None] | None = None,
) -> None:
    """Load this rank's entries of a whole-model ``state_dict`` into its (split) ``module``.

    A tied parameter held here under another of its names (``aliases``: other name -> canonical name) is read from
    that name, or from its canonical name when the checkpoint names it once. ``load(module, entries)`` loads the
    entries (default: ``module.load_state_dict(entries, strict=False)``; ZeRO-3 keeps its rows of each).

    Raises:
        RuntimeError: With ``strict``, if a local entry is missing or the checkpoint has entries the model lacks.
    """
    saved = {**{a: saved[c] for a, c in (aliases or {}).items() if a not in saved and c in saved}, **saved}
    local_keys = list(module.state_dict().keys())
    missing = [k for k in local_keys if k not in saved]
    unexpected = [k for k in saved if k not in set(full_keys) and k not in (aliases or {})]
    if strict and (missing or unexpected):
        raise RuntimeError(f"The checkpoint does not match the model: missing {missing}, unexpected {unexpected}.")
    entries = {k: saved[k] for k in local_keys if k in saved}
    if load is None:
        module.load_state_dict(entries, strict=False)
    else:
        load(module, entries)


def sharded_meta(
    checkpoint: Mapping[str, Any],
    optimizer: Optimizer | None,
    *,
    layout: OptimizerLayout | None,
    shapes: Mapping[str, tuple[int, ...]],
    state_keys: Sequence[str],
    scalars: Mapping[str, Mapping[str, Any]],
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``meta.pt`` of the package's sharded format (``lightning_parallel.distributed.checkpoint``) for the whole model.

    A pipeline rank's module holds one stage, so shapes, key order and param groups come from what was recorded on
    the whole model before splitting; param groups name their parameters (any layout can read them). A tied
    parameter is written once under its canonical name; ``aliases`` (other name -> canonical name) restores its other
    names on reading. ``scalars`` holds each parameter's own 0-dim optimizer state (Adam's ``step``) by canonical
    name, gathered from every stage.
    """
    groups = None
    if optimizer is not None and layout is not None:
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        groups = [{**s, "params": list(names)} for s, names in zip(settings, layout, strict=True)]
    return {
        "lightning": {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")},
        "shapes": dict(shapes),
        "aliases": dict(aliases or {}),
        "state_dict_order": list(state_keys),
        "param_groups": groups,
        "scalars": {name: dict(state) for name, state in scalars.items()},
    }
