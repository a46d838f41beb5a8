"""The pipeline layers of one split, as one record: what the split replaces in the module and what puts it back.

Torch-only. The layers, where each sits in the user's module, which stage (and so which pipeline rank) holds it, and
the ranks: the four travel together from the split (:func:`~.stage_split.keep_local_layers`) to the views of the
whole model during a run (:class:`~.whole_model_view.WholeModelView`) and its reassembly afterwards
(:func:`~.reassemble.reassemble`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_parallel.distributed.pipeline.layer_registration import Registration
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan

__all__ = ["SplitLayers"]


@dataclass(frozen=True, kw_only=True)
class SplitLayers:
    """Every pipeline layer of a split module and where it lives."""

    layers: list[nn.Module]
    """Every pipeline layer, in order: this rank's real ones, the others' on ``meta`` while split."""
    registrations: list[list[Registration]]
    """Where each layer's modules (and the tensors it holds itself) are registered in the module."""
    plan: StagePlan
    """Which layers form which stage."""
    dims: ParallelDims
    """Ranks and process groups."""

    @property
    def local_stages(self) -> list[int]:
        """The stages this pipeline rank holds."""
        return list(self.plan.stages_of(self.dims.pipeline_rank))

    @property
    def local(self) -> set[int]:
        """The indices of this pipeline rank's layers."""
        return {i for stage in self.local_stages for i in self.plan.layers_of(stage)}
