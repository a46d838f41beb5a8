"""Putting the whole model back together on every rank after a pipeline run.

During a run each rank's module holds only its stages' layers; the others are :class:`RemoteLayer` placeholders.
When the split happens, the layers that leave a rank are moved to the ``meta`` device in place (their memory is
freed, their structure and identity kept). At the end of ``fit``/``validate``/``test``/``predict`` every rank
receives each such layer's parameters and buffers from the rank that trained it and the original layer objects take
the placeholders' places again, so the user's module is a normal, whole module on every rank: ``state_dict()`` has
every key, ``model(x)`` works, and a new Trainer can load a checkpoint into it.

The whole module is assembled on the host, where Lightning's ``Strategy.teardown`` moves every strategy's module
after a run: each tensor passes through the device alone (:func:`.transfer.broadcast_tensor`) and is copied to the
host as it arrives, and the rank's own layers follow. A model pipelined because it does not fit on one accelerator
never exists whole on one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.distributed.pipeline.remote_layer import RemoteLayer
from lightning_parallel.distributed.pipeline.split_layers import SplitLayers
from lightning_parallel.distributed.pipeline.tied import TiedParameter
from lightning_parallel.distributed.pipeline.transfer import broadcast_tensor

__all__ = ["TensorSignature", "mark_orphaned", "offload_layers", "reassemble"]


@dataclass(frozen=True)
class TensorSignature:
    """One parameter or buffer of a layer as the rank that holds it describes it."""

    name: str
    """Name inside the layer (``"0.weight"``)."""
    is_parameter: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    alias_of: str | None
    """The first name of the same tensor inside the layer (tied weights), else ``None``."""


def offload_layers(layers: Sequence[nn.Module], indices: Sequence[int], *, keep: Collection[int] = ()) -> None:
    """Move ``layers[i]`` for ``i`` in ``indices`` to the ``meta`` device in place (frees them, keeps their shapes).

    ``keep``: ids of modules that a layer of this rank also holds (a module shared by two layers); they stay.
    """
    for index in indices:
        for submodule in layers[index].modules():
            if id(submodule) not in keep:
                submodule._apply(lambda t: t.to("meta"), recurse=False)


def reassemble(
    module: nn.Module, split: SplitLayers, *, device: torch.device, tied: Sequence[TiedParameter] = ()
) -> None:
    """Give every rank of the pipeline the whole model back, on the host (a collective over the pipeline group).

    ``split.layers`` are all pipeline layers: this rank's real ones and the others as left by :func:`offload_layers`.
    Each layer's owner first tells the others what it holds (one ``all_gather_object``), then broadcasts every
    tensor through ``device`` (the device the pipeline group communicates on), one at a time; the receivers copy each
    to the host as it arrives, assign the tensors to the offloaded layer (``requires_grad`` as on the owner) and put
    it back under each of its registrations in ``module``, replacing the :class:`RemoteLayer` placeholders (and
    filling the empty slots of the tensors an adapter holds itself). Then ``module`` moves to the host (this rank's
    own layers and whatever else it holds): afterwards no accelerator holds any of it, and during the exchange one
    tensor beyond this rank's stage.

    A parameter of ``tied`` is sent once, with its first user's layer; afterwards every user holds one and the same
    ``nn.Parameter`` again: this rank's own copy where it held one, else the one received.
    """
    layers, plan, dims = split.layers, split.plan, split.dims
    p = dims.pipeline_parallel_size
    local = split.local
    if p == 1:  # nothing left this rank (ZeRO-3's restore already put the user's layers back, on the host)
        module.cpu()
        return
    later_users = {user for t in tied for user in t.users[1:]}  # sent with the first user's layer instead
    mine = {i: _signatures(layers[i]) for i in sorted(local)}
    gathered: list[Any] = [None] * p
    dist.all_gather_object(gathered, mine, group=dims.pipeline_group)
    for index, layer in enumerate(layers):
        owner = plan.rank_of_layer(index)
        source = dims.pipeline_global_rank(owner)
        signatures: list[TensorSignature] = gathered[owner][index]
        signatures = [s for s in signatures if (index, s.name) not in later_users]
        held = _tensors(layer) if index in local else None
        received = {}
        for signature in (s for s in signatures if s.alias_of is None):
            own = held[signature.name] if held is not None else None
            tensor = broadcast_tensor(
                own,
                shape=signature.shape,
                dtype=signature.dtype,
                src=source,
                group=dims.pipeline_group,
                device=device,
                keep=True,
            )
            if tensor is not None:
                received[signature.name] = tensor
        if held is None:
            _assign(layer, signatures, received)
    for t in tied:
        _retie(layers, t, local)
    # After the ties: a tensor an adapter holds itself is registered as the adapter holds it now (a tied one, the
    # one parameter every user holds).
    for registration in (r for i, rs in enumerate(split.registrations) if i not in local for r in rs):
        registration.place(module)
    module.cpu()  # this rank's own layers and what the module holds besides (the received layers are there already)


def _retie(layers: Sequence[nn.Module], tied: TiedParameter, local: set[int]) -> None:
    """Make every user of ``tied`` hold one ``nn.Parameter``: this rank's copy if it ran a user, else the first
    user's (received)."""
    holder = next(((i, n) for i, n in tied.users if i in local), tied.users[0])
    parameter = layers[holder[0]].get_parameter(holder[1])
    for index, inner in tied.users:
        prefix, _, leaf = inner.rpartition(".")
        setattr(layers[index].get_submodule(prefix), leaf, parameter)


def _tensors(layer: nn.Module) -> dict[str, Tensor]:
    return {
        **dict(layer.named_parameters(remove_duplicate=False)),
        **dict(layer.named_buffers(remove_duplicate=False)),
    }


def _signatures(layer: nn.Module) -> list[TensorSignature]:
    first_name: dict[int, str] = {}
    result = []
    parameters = {name for name, _ in layer.named_parameters(remove_duplicate=False)}
    for name, tensor in _tensors(layer).items():
        alias_of = first_name.setdefault(id(tensor), name)
        result.append(
            TensorSignature(
                name=name,
                is_parameter=name in parameters,
                shape=tuple(tensor.shape),
                dtype=tensor.dtype,
                requires_grad=tensor.requires_grad,
                alias_of=None if alias_of == name else alias_of,
            )
        )
    return result


def _assign(layer: nn.Module, signatures: Sequence[TensorSignature], received: dict[str, Tensor]) -> None:
    values: dict[str, Tensor] = {}
    for signature in signatures:
        if signature.alias_of is not None:
            value = values[signature.alias_of]
        elif signature.is_parameter:
            value = nn.Parameter(received[signature.name], requires_grad=signature.requires_grad)
        else:
            value = received[signature.name]
        values[signature.name] = value
        prefix, _, leaf = signature.name.rpartition(".")
        setattr(layer.get_submodule(prefix), leaf, value)


def mark_orphaned(module: nn.Module, *, orphaned: bool = True) -> None:
    """Make the placeholders of a module that could not be reassembled (a run that failed) raise on any access,
    ``state_dict()`` included, instead of silently returning this rank's part (``orphaned=False`` undoes it)."""
    for submodule in module.modules():
        if isinstance(submodule, RemoteLayer):
            submodule.orphaned = orphaned
