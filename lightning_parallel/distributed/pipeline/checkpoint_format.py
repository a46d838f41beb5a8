"""The pipeline's two checkpoint formats, chosen once from ``PipelineParallelStrategy(checkpoint_format=...)``.

Torch-only. :class:`ConsolidatedCheckpoint` gathers the whole model's ``state_dict`` and the single-device optimizer
layout onto rank 0 (one Lightning ``.ckpt``, written by the caller); :class:`ShardedCheckpoint` gathers nothing and
writes a ``torch.distributed.checkpoint`` directory from every rank (the package's shared sharded layout). Every
method is a collective: call it on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from torch import nn
from torch.optim import Optimizer

from lightning_parallel.distributed.checkpoint import gather_scalar_states, save_sharded_checkpoint, scalar_states
from lightning_parallel.distributed.pipeline.consolidate import (
    consolidate_buffers,
    consolidate_optimizer_state,
    consolidate_state_dict,
    sharded_meta,
)
from lightning_parallel.distributed.pipeline.run import PipelineRun

__all__ = [
    "CHECKPOINT_FORMATS",
    "CheckpointFormat",
    "CheckpointWrite",
    "ConsolidatedCheckpoint",
    "ShardedCheckpoint",
    "whole_model_state",
]


@dataclass(frozen=True)
class CheckpointWrite:
    """One checkpoint to write, as the strategy's ``save_checkpoint`` receives it."""

    module: nn.Module
    """The (split) module."""
    checkpoint: Mapping[str, Any]
    """Lightning's checkpoint dict (the consolidated states already in it, or empty ones for the sharded format)."""
    filepath: Any
    """Where to write (rank 0's path counts)."""
    optimizer: Optimizer | None
    """The optimizer whose state the sharded format writes (one at most)."""
    write: Callable[[], None]
    """Save the checkpoint as one ``.ckpt`` (Lightning's way)."""
    broadcast: Callable[[str], str]
    """Collective. Rank 0's path on every rank."""


class CheckpointFormat(Protocol):
    """What a checkpoint holds and who writes it."""

    name: str
    """``PipelineParallelStrategy(checkpoint_format=...)``."""

    def model_state(self, module: nn.Module, run: PipelineRun) -> dict[str, Any] | None:
        """The checkpoint's ``state_dict`` on the first rank of each pipeline (``None`` elsewhere)."""
        ...

    def optimizer_state(
        self, run: PipelineRun, optimizer: Optimizer, optimizers: Sequence[Optimizer]
    ) -> dict[str, Any] | None:
        """The checkpoint's state of ``optimizer`` (one of ``optimizers``) on the first rank of each pipeline."""
        ...

    def save(self, run: PipelineRun, request: CheckpointWrite) -> None:
        """Write ``request.checkpoint`` to ``request.filepath`` (:class:`CheckpointWrite`)."""
        ...


def whole_model_state(module: nn.Module, run: PipelineRun | None) -> dict[str, Any] | None:
    """The whole model's ``state_dict`` under its own names on pipeline rank 0 (``None`` elsewhere): a collective
    while ``run`` holds the module split; otherwise the module is whole and nothing is exchanged."""
    aliases = run.aliases if run is not None else {}
    if run is None or not run.is_split:
        whole = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        whole.update({alias: whole[name] for alias, name in aliases.items() if alias in whole})
        return whole
    local = run.stage_model_state()
    return consolidate_state_dict(module, run.full_state_keys, run.dims, aliases=aliases, local=local)


class ConsolidatedCheckpoint:
    """One ``.ckpt`` exactly as single-device training writes it, gathered to rank 0."""

    name = "consolidated"

    def model_state(self, module: nn.Module, run: PipelineRun) -> dict[str, Any] | None:
        return whole_model_state(module, run)

    def optimizer_state(
        self, run: PipelineRun, optimizer: Optimizer, optimizers: Sequence[Optimizer]
    ) -> dict[str, Any] | None:
        layout = run.optimizer_layouts[list(optimizers).index(optimizer)]
        local = run.stage_optimizer_state(optimizer)
        return consolidate_optimizer_state(optimizer, run.parameter_names(), layout, run.dims, local=local)

    def save(self, run: PipelineRun, request: CheckpointWrite) -> None:
        request.write()


class ShardedCheckpoint:
    """A ``torch.distributed.checkpoint`` directory written by every rank: its stage's parameters and optimizer
    state; the replicas of a stage split each tensor evenly, so nothing is written twice. Names, not indices, so any
    layout can read it. Nothing is gathered into the ``.ckpt`` dicts."""

    name = "sharded"

    def model_state(self, module: nn.Module, run: PipelineRun) -> dict[str, Any] | None:
        return {}

    def optimizer_state(
        self, run: PipelineRun, optimizer: Optimizer, optimizers: Sequence[Optimizer]
    ) -> dict[str, Any] | None:
        return {}

    def save(self, run: PipelineRun, request: CheckpointWrite) -> None:
        dims, optimizer = run.dims, request.optimizer
        named, pieces = run.stage_pieces(optimizer)
        # After teardown the module is whole again: each rank still writes only the stage it trained. A tied
        # parameter is written once, under its canonical name, by the lowest pipeline rank holding a copy.
        pieces = [replace(piece, name=run.aliases.get(piece.name, piece.name)) for piece in pieces]
        pieces = [piece for piece in pieces if piece.name in run.local_parameter_names]
        buffers = consolidate_buffers(request.module, dims) or {}
        # Each parameter's own 0-dim state (Adam's `step`), from the stage that holds it.
        scalars = gather_scalar_states(scalar_states(named, optimizer), group=dims.pipeline_group)
        meta = sharded_meta(
            request.checkpoint,
            optimizer,
            layout=run.optimizer_layouts[0] if run.optimizer_layouts else None,
            shapes=run.full_shapes,
            state_keys=run.full_state_keys,
            scalars=scalars,
            aliases=run.aliases,
        )
        save_sharded_checkpoint(request.broadcast(str(request.filepath)), pieces, buffers=buffers, meta=meta)


CHECKPOINT_FORMATS: dict[str, CheckpointFormat] = {
    "consolidated": ConsolidatedCheckpoint(),
    "sharded": ShardedCheckpoint(),
}
"""``checkpoint_format`` -> its format."""
