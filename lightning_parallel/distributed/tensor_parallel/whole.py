"""The layers that tensor parallelism split, whole again for a while: what ``full_module()`` hands a user who calls
the model on one rank alone (sampling, an evaluation on rank 0).

A split layer computes with ``DTensor`` weights and torch's parallel styles' forward hooks, which redistribute its
input and output over the ``tensor`` axis: every call is a collective of the tensor-parallel group, so a rank calling
the model alone would wait for ranks that never come. :func:`whole_layers` gathers each split weight once (a
collective on entry, every rank), puts the whole tensors in place of the ``DTensor`` parameters and lifts the styles'
hooks (those ``parallelize_module`` registered, recorded by :func:`record_style_hooks`; a user's own hooks stay), so
the model computes as the unsplit one, on any rank, without communication. On exit the parameters and hooks are put
back exactly (changes to the whole weights are dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, cast
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["is_split", "record_style_hooks", "whole_layers"]

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_STYLE_HOOKS: WeakKeyDictionary[nn.Module, dict[str, set[int]]] = WeakKeyDictionary()
"""Per split layer, the ids of the forward (pre-)hooks torch's parallel styles registered on it, by hook dict."""


def record_style_hooks(module: nn.Module, split: Callable[[], Any]) -> Any:
    """Run ``split()`` (``parallelize_module`` on ``module``) and remember which forward hooks it registered on each
    submodule; returns what ``split`` returned."""
    before = {id(m): {name: set(getattr(m, name)) for name in _HOOK_DICTS} for m in module.modules()}
    result = split()
    for layer in module.modules():
        known = before.get(id(layer), {})
        added = {name: set(getattr(layer, name)) - known.get(name, set()) for name in _HOOK_DICTS}
        if any(added.values()):
            _STYLE_HOOKS[layer] = added
    return result


def is_split(param: torch.Tensor) -> bool:
    """Whether ``param`` is split by tensor parallelism (a ``DTensor`` on a mesh with a ``tensor`` axis)."""
    return isinstance(param, DTensor) and "tensor" in (param.device_mesh.mesh_dim_names or ())


@contextmanager
def whole_layers(module: nn.Module) -> Generator[nn.Module, None, None]:
    """Collective on entry over each split weight's tensor-parallel group (every rank, same order): ``module`` with
    every weight split over the ``tensor`` axis replaced by the whole tensor (``DTensor.full_tensor()``; a weight tied
    to several layers stays one tensor) and torch's parallel styles' forward hooks lifted, until exit. A module with
    no split weight is yielded as it is. Exit is local."""
    places = [
        (owner, name, param)
        for owner in module.modules()
        for name, param in owner._parameters.items()
        if param is not None and is_split(param)
    ]
    if not places:
        yield module
        return
    whole: dict[int, nn.Parameter] = {}
    for _, _, param in places:
        if id(param) not in whole:
            full = cast(DTensor, param).full_tensor().detach()
            whole[id(param)] = nn.Parameter(full, requires_grad=param.requires_grad)
    lifted = _lift_style_hooks(module)
    for owner, name, param in places:
        owner._parameters[name] = whole[id(param)]
    try:
        yield module
    finally:
        for owner, name, param in places:
            owner._parameters[name] = param
        for layer, name, hooks in lifted:
            table = getattr(layer, name)
            table.clear()
            table.update(hooks)


def _lift_style_hooks(module: nn.Module) -> list[tuple[nn.Module, str, dict[int, Any]]]:
    """Take the parallel styles' hooks out of each split layer's hook dicts; returns each dict's whole former
    content, to put back in its order."""
    lifted = []
    for layer in module.modules():
        recorded = _STYLE_HOOKS.get(layer)
        if recorded is None:
            continue
        for name, ids in recorded.items():
            table = getattr(layer, name)
            if not ids & set(table):
                continue
            lifted.append((layer, name, dict(table)))
            for hook_id in ids:
                table.pop(hook_id, None)
    return lifted
