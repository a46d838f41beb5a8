"""Checkpoint plumbing shared by our strategies: write the sharded format, read either format.

A strategy supplies its pieces (what this rank owns); everything about files lives in
``lightning_parallel.distributed.checkpoint``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH

from lightning_parallel.distributed.checkpoint import (
    DamagedCheckpointError,
    ShardedPieces,
    build_meta,
    is_sharded_checkpoint,
    param_groups_by_name,
    save_sharded_checkpoint,
    sharded_to_consolidated,
)

__all__ = ["load_checkpoint_any_format", "save_sharded"]


def save_sharded(
    strategy: Any,
    checkpoint: dict[str, Any],
    filepath: _PATH,
    *,
    parts: ShardedPieces,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Collective. Write ``checkpoint`` (Lightning's dict, minus weights and optimizer state) as a sharded directory,
    with this rank's ``parts`` of the weights and of ``optimizer``'s state."""
    checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    module = strategy.lightning_module
    path = Path(strategy.broadcast(str(filepath)))
    groups = None
    if optimizer is not None and parts.group_params is not None:
        groups = param_groups_by_name(module, parts.group_params, optimizer.param_groups)
    meta, buffers = build_meta(module, lightning_checkpoint=checkpoint, param_groups=groups, scalars=parts.scalars)
    save_sharded_checkpoint(path, parts.pieces, buffers=buffers, meta=meta)


def load_checkpoint_any_format(strategy: Any, checkpoint_path: _PATH, weights_only: bool | None) -> dict[str, Any]:
    """Lightning's checkpoint dict from a consolidated file or a sharded directory (reassembled, every rank)."""
    if is_sharded_checkpoint(checkpoint_path):
        return sharded_to_consolidated(checkpoint_path)
    if weights_only is None:
        weights_only = True  # never run code from a checkpoint unless the caller asks for it explicitly
    try:
        return strategy.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)
    except FileNotFoundError:
        raise
    except Exception as error:
        if not Path(checkpoint_path).is_file():
            raise
        raise DamagedCheckpointError(
            f"Cannot load checkpoint {checkpoint_path}: it is truncated, was modified, or is not a checkpoint"
            f" ({type(error).__name__}: {str(error).splitlines()[0][:200]}). With `weights_only=True` (the default"
            " here) a checkpoint may hold only tensors and plain containers. Nothing was loaded."
        ) from error
