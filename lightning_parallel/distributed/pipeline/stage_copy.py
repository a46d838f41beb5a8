"""A weight average's copy of the module held as one pipeline stage (the pipeline's
:class:`~lightning_parallel.distributed.averaged_copy.CopyHolding`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_parallel.distributed.pipeline.consolidate import consolidate_state_dict
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.remote_layer import RemoteLayer

__all__ = ["StageCopyHolding"]


@dataclass(frozen=True)
class StageCopyHolding:
    """Pipeline: the layers other ranks run are :class:`RemoteLayer` placeholders in the copy too."""

    dims: ParallelDims
    full_keys: Sequence[str]
    """The whole module's ``state_dict`` keys, in order (recorded before the split)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Other name -> canonical name of every tied parameter."""

    def hold_like(self, copy: nn.Module, model: nn.Module) -> None:
        for name, submodule in model.named_modules():
            if isinstance(submodule, RemoteLayer) and not isinstance(copy.get_submodule(name), RemoteLayer):
                copy.set_submodule(name, RemoteLayer(submodule.name, submodule.stage))

    def gather(self, copy: nn.Module) -> dict[str, Any] | None:
        whole = consolidate_state_dict(copy, self.full_keys, self.dims, aliases=self.aliases)
        return whole if whole is not None and dist.get_rank() == 0 else None

    def localize(self, copy: nn.Module, whole: Mapping[str, Any]) -> dict[str, Any]:
        local_keys = copy.state_dict(keep_vars=True).keys()
        # A tied parameter held here under another of its names is read from its canonical name when needed.
        named = {**{a: whole[c] for a, c in self.aliases.items() if a not in whole and c in whole}, **whole}
        return {key: value for key, value in named.items() if key in local_keys}
