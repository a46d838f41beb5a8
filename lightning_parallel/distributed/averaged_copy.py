"""A copy of a module (a weight average) held the way a strategy holds the module: as shards or as one stage.

Weight averaging keeps a deep copy of the whole module and updates it from the module parameter by parameter, zipping
``parameters()`` and ``buffers()`` of the two (torch's ``AveragedModel``, Lightning's ``WeightAveraging`` and
``StochasticWeightAveraging``). Under ZeRO-3 the module's parameters are DTensor shards, and under the pipeline a
rank holds only its stage (the other layers are placeholders): the zip would pair whole tensors with shards, or with
another layer's tensors.

:func:`hold_copy` makes the copy hold exactly what the module holds, under the same names in the same order
(:class:`ShardedCopyHolding`: each parameter a DTensor of the module's mesh and placements, in the copy's own dtype and
on its own device; the pipeline's ``StageCopyHolding``, ``distributed/pipeline/stage_copy.py``: the module's
placeholders), so every update the averaging code makes stays local and elementwise, and a rank holds ``1/N`` (ZeRO-3)
or one stage of the averages. Checkpoints still see the whole copy: ``state_dict()`` of the held copy gathers the whole
state to global rank 0 (a collective, as the module's own consolidated state dict is) and ``load_state_dict()`` takes a
whole state and keeps this rank's part (local: every rank reads the same file).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["CopyHolding", "HeldCopy", "ShardedCopyHolding", "hold_copy", "shard_whole_state"]


def __getattr__(name: str) -> Any:
    """``StageCopyHolding`` lives with the pipeline (``distributed/pipeline/stage_copy.py``); importing it from here
    still works, without this module importing any pipeline module (the ZeRO backends import this one)."""
    if name == "StageCopyHolding":
        from lightning_parallel.distributed.pipeline.stage_copy import StageCopyHolding

        return StageCopyHolding
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ATTRIBUTE = "_lightning_parallel_held_copy"


class CopyHolding(Protocol):
    """How a strategy holds its module, applied to a copy of it."""

    def hold_like(self, copy: nn.Module, model: nn.Module) -> None:
        """Local. Make ``copy`` (a deep copy of the whole module) hold what ``model`` holds on this rank."""

    def gather(self, copy: nn.Module) -> dict[str, Any] | None:
        """Collective. The whole state of a held ``copy`` (``copy.state_dict()`` is its local part) under the
        module's own names, complete on global rank 0, ``None`` elsewhere."""

    def localize(self, copy: nn.Module, whole: Mapping[str, Any]) -> dict[str, Any]:
        """Local. This rank's part of ``whole`` (a whole state dict of the module), as ``copy`` loads it."""


@dataclass(frozen=True)
class ShardedCopyHolding:
    """ZeRO-3: every parameter that is a DTensor in the module becomes a DTensor of the same mesh and placements in
    the copy. Buffers are whole in both (FSDP2 does not shard them)."""

    device: torch.device
    """Where the collectives run (the rank's GPU for NCCL); the copy's shards may live elsewhere (Lightning's
    ``device`` argument of the callbacks)."""

    def hold_like(self, copy: nn.Module, model: nn.Module) -> None:
        """Each shard starts from the module's rows (rank 0's weights, broadcast before sharding), not from the copy:
        the copy was taken before that broadcast and, ZeRO-3 restoring checkpoints after set-up, holds nothing else
        yet. DDP's rank 0, which saves, likewise copied its own module."""
        model_params = dict(model.named_parameters())
        model_buffers = dict(model.named_buffers())
        held: dict[int, nn.Parameter] = {}  # a tied parameter is replaced once and registered under every name
        for name, param in list(copy.named_parameters(remove_duplicate=False)):
            like = model_params.get(name)
            if id(param) not in held:
                if not isinstance(like, DTensor) or isinstance(param, DTensor):
                    continue
                held[id(param)] = nn.Parameter(_shard_like(param, like), requires_grad=param.requires_grad)
            _set_tensor(copy, name, held[id(param)], parameter=True)
        # A module created on the meta device (`init_module(empty_init=True)`) was copied on meta: its buffers take
        # the module's materialised values, as its shards above took the module's rows.
        for name, buffer in list(copy.named_buffers()):
            if buffer.is_meta and name in model_buffers:
                _set_tensor(copy, name, model_buffers[name].detach().clone(), parameter=False)

    def gather(self, copy: nn.Module) -> dict[str, Any] | None:
        is_rank_zero = dist.get_rank() == 0
        whole: dict[str, Any] = {}
        for name, value in copy.state_dict().items():  # one all-gather per DTensor, in the same order on every rank
            if isinstance(value, DTensor):
                value = _full_tensor(value, self.device)
            if is_rank_zero:
                whole[name] = value.detach().cpu() if isinstance(value, Tensor) else value
        return whole if is_rank_zero else None

    def localize(self, copy: nn.Module, whole: Mapping[str, Any]) -> dict[str, Any]:
        return shard_whole_state(copy, whole)


class HeldCopy:
    """A copy made to hold what its module holds (:func:`hold_copy`), its ``state_dict()``/``load_state_dict()``
    hooked to speak whole states for as long as the copy lives (a checkpoint saved after ``fit`` still needs them).

    ``state_dict()`` of the copy is then a collective: call it on every rank (as Lightning's checkpointing does).
    """

    def __init__(self, copy: nn.Module, layout: CopyHolding) -> None:
        self.copy = copy
        self.layout = layout
        self._local = False  # while set, the hooks leave the copy's own (local) state alone
        # torch marks a hook registered through the public API by setting an attribute on it, which a bound method
        # cannot take: register partials.
        copy.register_state_dict_post_hook(partial(HeldCopy._gather_whole, self))
        copy.register_load_state_dict_pre_hook(partial(HeldCopy._keep_local, self))

    def _gather_whole(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
        if self._local:
            return
        self._local = True
        try:
            whole = self.layout.gather(module)
        finally:
            self._local = False
        for key in [key for key in state_dict if key.startswith(prefix)]:
            del state_dict[key]
        # Other ranks keep none of the copy's entries, as the module's consolidated state dict is empty there.
        state_dict.update({prefix + key: value for key, value in (whole or {}).items()})

    def _keep_local(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if self._local:
            return
        entries = {key[len(prefix) :]: state_dict.pop(key) for key in list(state_dict) if key.startswith(prefix)}
        self._local = True
        try:
            local = self.layout.localize(module, entries)
        finally:
            self._local = False
        state_dict.update({prefix + key: value for key, value in local.items()})


def hold_copy(copy: nn.Module, model: nn.Module, layout: CopyHolding) -> HeldCopy:
    """Local. Make ``copy`` (a deep copy of the whole ``model``, taken before the strategy sharded or split it) hold
    what ``model`` holds on this rank, and hook its state dicts to whole states (see the module's docstring).

    Idempotent: a copy held already keeps its hooks (another ``setup`` of the same run).

    Raises:
        ValueError: If the copy's parameters or buffers then differ from the model's in names or order, so that
            zipping them (as averaging code does) would pair different tensors.
    """
    previous = copy.__dict__.get(_ATTRIBUTE)
    if isinstance(previous, HeldCopy):
        return previous
    layout.hold_like(copy, model)
    for kind, of_copy, of_model in (
        ("parameters", [n for n, _ in copy.named_parameters()], [n for n, _ in model.named_parameters()]),
        ("buffers", [n for n, _ in copy.named_buffers()], [n for n, _ in model.named_buffers()]),
    ):
        if of_copy != of_model:
            differing = sorted(set(of_copy) ^ set(of_model))[:3] or "their order"
            raise ValueError(
                f"The averaged copy of `{type(model).__name__}` does not hold the same {kind} as the module (differing:"
                f" {differing}): the module changed after the weight-averaging callback copied it in its `setup`."
                " Build every layer in `__init__` or `configure_model`, not in `setup` or a hook that runs later."
            )
    held = HeldCopy(copy, layout)
    copy.__dict__[_ATTRIBUTE] = held
    return held


def shard_whole_state(module: nn.Module, whole: Mapping[str, Any]) -> dict[str, Any]:
    """Local. ``whole`` (a state dict of whole tensors, the same on every rank) with the entry of every DTensor
    parameter of ``module`` replaced by this rank's shard of it (same mesh, placements, dtype and device), so that
    ``module.load_state_dict`` copies shard into shard. Other entries, and entries of another shape (which
    ``load_state_dict`` then reports), are kept as they are.
    """
    local = dict(whole)
    for name, param in module.named_parameters(remove_duplicate=False):
        value = whole.get(name)
        if not isinstance(param, DTensor) or not isinstance(value, Tensor) or isinstance(value, DTensor):
            continue
        if tuple(value.shape) == tuple(param.shape):
            # Every rank holds the same whole tensor: keep this rank's rows, without communication.
            rows = distribute_tensor(value.detach(), param.device_mesh, param.placements, src_data_rank=None)
            local[name] = rows.to(device=param.device, dtype=param.dtype)
    return local


def _shard_like(param: Tensor, like: DTensor) -> DTensor:
    """A DTensor of ``like``'s mesh, placements and shape holding ``like``'s local values in ``param``'s dtype and on
    ``param``'s device (``like``'s device when ``param`` is on meta)."""
    device = like.device if param.is_meta else param.device
    local = like.to_local().detach().to(device=device, dtype=param.dtype, copy=True)
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _full_tensor(value: DTensor, device: torch.device) -> Tensor:
    """Collective: the whole tensor, gathered on ``device`` (the copy's shards may live on another one)."""
    local = value.to_local()
    if local.device != device:
        value = DTensor.from_local(
            local.to(device),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value.full_tensor()


def _set_tensor(module: nn.Module, name: str, tensor: Tensor, *, parameter: bool) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if parameter:
        owner._parameters[leaf] = tensor  # type: ignore[assignment]  # an nn.Parameter
    else:
        owner._buffers[leaf] = tensor
