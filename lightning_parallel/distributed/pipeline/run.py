"""One record of what a split of the module made, from the split until the next split replaces it."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lightning_parallel.distributed.pipeline.consolidate import OptimizerLayout
from lightning_parallel.distributed.pipeline.engine import PipelineEngine
from lightning_parallel.distributed.pipeline.partition import Registration, StagePlan
from lightning_parallel.distributed.pipeline.schedule import ParallelDims
from lightning_parallel.distributed.pipeline.sync import PipelineSync
from lightning_parallel.distributed.pipeline.tied import TiedGradientSync

__all__ = ["PipelineRun"]


@dataclass(kw_only=True)
class PipelineRun:
    """A split module's state: created whole by the split, its live part dropped when the module is reassembled.

    The live part (:attr:`engine`, :attr:`layers`, :attr:`registrations`) exists while the module holds only this
    rank's stages. The rest stays after the reassembly (teardown), so that after ``fit`` the strategy still answers
    ``stage_plan`` and writes checkpoints of the stage it trained; the next split replaces the whole record.
    """

    dims: ParallelDims
    """Ranks and process groups (reused by later splits: the groups are created once)."""
    plan: StagePlan
    """Which layers form which stage."""
    tied: TiedGradientSync
    """Tied parameters, the pipeline ranks holding a copy of each, and the groups summing their gradients."""
    aliases: dict[str, str]
    """Other name -> canonical name of every parameter with several names."""
    full_state_keys: list[str]
    """The whole module's ``state_dict`` keys, in order."""
    full_shapes: dict[str, tuple[int, ...]]
    """The whole module's parameter shapes by name."""
    optimizer_layouts: list[OptimizerLayout]
    """Each optimizer's parameter names per group on the whole model (the consolidated checkpoint's numbering)."""
    local_parameter_names: set[str]
    """Canonical names this rank writes in a sharded checkpoint (a tied copy only on its lowest pipeline rank)."""
    sync: PipelineSync
    """How the stage is held over the replicas (chosen once, at the split)."""
    engine: PipelineEngine | None
    """Runs the steps; ``None`` once the module is whole again."""
    layers: list[nn.Module]
    """Every pipeline layer; other ranks' ones on ``meta`` while split."""
    registrations: list[list[Registration]]
    """Where each layer's modules sit in the module."""
    failed: bool = False
    """Training failed: the teardown leaves the split module alone (no collective with failed peers)."""
    pending_grads: list[Tensor | None] | None = None
    """The last training step's gradients, handed over in ``backward`` after Lightning's ``zero_grad``."""

    @property
    def is_split(self) -> bool:
        """Whether the module holds only this rank's stages now."""
        return self.engine is not None

    def drop_split(self) -> None:
        """The module is whole again: forget the engine and the layers."""
        self.engine, self.layers, self.registrations = None, [], []
