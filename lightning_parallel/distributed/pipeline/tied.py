"""Tied weights across pipeline stages: one parameter used by layers that land on different ranks.

Torch-only. Most language models tie the input embedding to the output head; with the layers on different stages,
both stages need the weight. Each pipeline rank that runs a user of the parameter keeps its own copy (the original
``nn.Parameter`` object of that process: the copies start equal because rank 0's weights are broadcast before the
split); before the optimizer step the copies' gradients are summed over exactly the ranks that hold one (one process
group per set of ranks and data-parallel replica), so every copy takes the same step, and the run equals one device.
Where all users of a parameter land on one rank (the plan's placement, :meth:`.StagePlan.rank_of_stage`, can put
two stages together: stages ``s`` and ``s + p`` in the looped placement of the interleaved schedules, the first and
the last stage in a V), there is no copy and nothing to communicate.

Checkpoints name a tied parameter once, by its first name in ``module.named_parameters()`` (its *canonical* name),
as single-device training does; the gradient norm for clipping counts it on one rank only (its lowest pipeline rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel.accounting import CommunicationStats
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan

__all__ = [
    "TiedGradientSync",
    "TiedLayout",
    "TiedParameter",
    "canonical_names",
    "find_tied_parameters",
    "parameter_aliases",
    "split_counted",
]


@dataclass(frozen=True)
class TiedParameter:
    """One parameter used by two or more pipeline layers."""

    name: str
    """Its canonical name: the first name in the whole module's ``named_parameters()`` (what checkpoints use)."""
    users: tuple[tuple[int, str], ...]
    """Every ``(layer index, name inside that layer)`` under which a pipeline layer holds it, in layer order."""

    @property
    def layers(self) -> tuple[int, ...]:
        """The indices of the layers that use it, in order, without repeats."""
        return tuple(dict.fromkeys(index for index, _ in self.users))


def parameter_aliases(module: nn.Module) -> dict[str, str]:
    """Each other name of a parameter registered under several names -> its canonical (first) name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(parameter), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def canonical_names(module: nn.Module, aliases: Mapping[str, str]) -> dict[int, str]:
    """``id(parameter) -> canonical name`` for the parameters ``module`` holds now (a split module holds its stages'
    layers only, so a tied parameter may be found under another of its names there)."""
    return {id(p): aliases.get(name, name) for name, p in module.named_parameters()}


def find_tied_parameters(module: nn.Module, layers: Sequence[nn.Module]) -> list[TiedParameter]:
    """The parameters of ``module`` that more than one of ``layers`` uses, in ``named_parameters()`` order.

    Run on the whole module before the split (every rank gets the same answer from the same module).
    """
    users: dict[int, list[tuple[int, str]]] = {}
    for index, layer in enumerate(layers):
        for inner, parameter in layer.named_parameters(remove_duplicate=False):
            users.setdefault(id(parameter), []).append((index, inner))
    return [
        TiedParameter(name=name, users=tuple(users[id(parameter)]))
        for name, parameter in module.named_parameters()
        if len({index for index, _ in users.get(id(parameter), [])}) > 1
    ]


@dataclass(frozen=True)
class TiedLayout:
    """Which pipeline ranks hold a copy of each tied parameter under a stage plan (local: no communication)."""

    parameters: tuple[TiedParameter, ...]
    plan: StagePlan

    def ranks_of(self, tied: TiedParameter) -> tuple[int, ...]:
        """The pipeline ranks that run a user of ``tied``, ascending."""
        return tuple(sorted({self.plan.rank_of_layer(index) for index in tied.layers}))

    @property
    def copied(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> the pipeline ranks holding a copy, for the parameters held by more than one rank."""
        return {t.name: self.ranks_of(t) for t in self.parameters if len(self.ranks_of(t)) > 1}

    def rank_sets(self) -> dict[tuple[int, ...], list[str]]:
        """Each set of pipeline ranks that shares copies -> the canonical names it shares (one all-reduce each)."""
        sets: dict[tuple[int, ...], list[str]] = {}
        for name, ranks in self.copied.items():
            sets.setdefault(ranks, []).append(name)
        return sets

    def uncounted(self, pipeline_rank: int) -> set[str]:
        """Canonical names of the copies ``pipeline_rank`` holds but another rank counts (norms, sharded writes):
        each tied parameter is counted by the lowest pipeline rank that holds it."""
        return {name for name, ranks in self.copied.items() if pipeline_rank in ranks and ranks[0] != pipeline_rank}


class TiedGradientSync:
    """Sums the gradients of tied-parameter copies across the ranks that hold them.

    Building it is a collective: every rank creates, in the same order, one process group per set of pipeline ranks
    that shares copies and per data-parallel replica (``torch.distributed.new_group`` must be called by every rank).
    A set that is the whole pipeline reuses the pipeline's group instead. With no copies it creates nothing.
    """

    def __init__(self, layout: TiedLayout, dims: ParallelDims) -> None:
        self.layout = layout
        p, t = dims.pipeline_parallel_size, dims.tensor_parallel_size
        self._groups: list[tuple[Any, list[str]]] = []
        """(process group, canonical names) of the sets this rank belongs to."""
        for ranks, names in layout.rank_sets().items():
            for replica in range(dims.data_parallel_size):
                for tensor_rank in range(t):
                    # pipeline ranks `ranks` of data-parallel replica `replica`, at tensor rank `tensor_rank`
                    members = [(replica * p + r) * t + tensor_rank for r in ranks]
                    group = dims.pipeline_group if len(ranks) == p else dist.new_group(members)
                    mine = replica == dims.data_parallel_rank and tensor_rank == dims.tensor_rank
                    if mine and dims.pipeline_rank in ranks:
                        self._groups.append((group, names))

    def all_reduce(
        self, module: nn.Module, aliases: Mapping[str, str], *, stats: CommunicationStats | None = None
    ) -> None:
        """Collective over each tied set: every copy's ``.grad`` becomes the sum of all copies' gradients.

        Call it after the data-parallel average (the all-reduce gives the same bits on every member, so the copies
        stay bitwise equal). A copy without a gradient counts as zeros; if no copy has one, ``.grad`` stays ``None``
        (as on one device, where a parameter no step used is not stepped). One flat all-reduce per set, carrying one
        "has a gradient" flag per parameter.
        """
        if not self._groups:
            return
        by_name = {aliases.get(name, name): p for name, p in module.named_parameters()}
        for group, names in self._groups:
            params = [by_name[name] for name in names]
            # ZeRO-3 (`fully_shard.py`): DTensor copies, sharded alike on every stage: their local rows are summed.
            grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
            # Filled on the device: `torch.tensor([...], device=...)` would copy from the host and wait for it.
            flags = [
                torch.full((1,), float(p.grad is not None), dtype=grads[0].dtype, device=grads[0].device)
                for p in params
            ]
            flat = torch.cat([*(g.reshape(-1) for g in grads), *flags])
            if stats is not None:
                stats.record("all_reduce", flat.numel() * flat.element_size())
            dist.all_reduce(flat, group=group)
            # Only a copy without a local gradient needs to know whether another one had one: those flags are read
            # in one transfer, and not at all when every copy here has a gradient (the common case). A read per
            # parameter was a device sync per parameter (issue 36, item 5).
            used = flat[-len(params) :].tolist() if any(p.grad is None for p in params) else None
            offset = 0
            for index, (p, g) in enumerate(zip(params, grads, strict=True)):
                summed = flat[offset : offset + g.numel()].view_as(g)
                offset += g.numel()
                if p.grad is not None:
                    _local(p.grad).copy_(summed)
                elif used is not None and used[index] > 0:
                    value = summed.to(p.dtype).clone()
                    p.grad = _like(value, p)

    @property
    def num_groups(self) -> int:
        """How many tied sets this rank all-reduces per step (0 when it holds no copy)."""
        return len(self._groups)


def split_counted(
    grads: Sequence[tuple[nn.Parameter, Tensor]], uncounted: set[int]
) -> tuple[list[Tensor], list[Tensor]]:
    """``(gradients counted in this rank's norm, gradients of copies counted on another rank)``; ``uncounted`` holds
    the ``id`` of this rank's copies that another rank counts."""
    counted = [g for p, g in grads if id(p) not in uncounted]
    copies = [g for p, g in grads if id(p) in uncounted]
    return counted, copies


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(local: Tensor, param: Tensor) -> Tensor:
    """``local`` as a gradient of ``param``: a ``DTensor`` with its placements when ``param`` is one."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
