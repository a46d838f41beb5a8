"""The Trainer every benchmark measures with: no logging, checkpoints, progress bar or validation in the window."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

__all__ = ["benchmark_trainer"]


def benchmark_trainer(
    *, accelerator: str, devices: int, strategy: Any, max_steps: int, callbacks: list[Callback], **kwargs: Any
) -> pl.Trainer:
    """A ``Trainer`` that only trains: what it times is the training step and nothing else."""
    options: dict[str, Any] = {
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": False,
    }
    options.update(kwargs)
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=callbacks,
        **options,
    )
