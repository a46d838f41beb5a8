"""What ZeRO-3 refuses before training: Lightning callbacks that treat parameters as whole tensors.

Stage 3 holds each parameter as a DTensor shard. ``WeightAveraging`` (and ``EMAWeightAveraging``) and
``StochasticWeightAveraging`` keep a deep copy of the module made before sharding and copy between the two, and
``ModelPruning`` masks parameters in place: each fails mid-training (for SWA only once averaging starts, possibly
after hours) with torch's "aten.copy_.default: got mixed torch.Tensor and DTensor". They are refused at set-up on
every rank instead (a local check of the Trainer's callbacks, so no rank is left in a collective).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging, WeightAveraging

__all__ = ["REFUSED_CALLBACKS", "check_callbacks"]

REFUSED_CALLBACKS: tuple[type, ...] = (WeightAveraging, StochasticWeightAveraging, ModelPruning)
"""Callbacks (and their subclasses) that copy or prune whole parameters."""


def check_callbacks(callbacks: Iterable[Any]) -> None:
    """Raise ``ValueError`` naming the first callback of :data:`REFUSED_CALLBACKS` in ``callbacks``, and the fix."""
    for callback in callbacks:
        if isinstance(callback, REFUSED_CALLBACKS):
            name = type(callback).__name__
            raise ValueError(
                f"`{name}` cannot run under ZeRO-3 (`strategy='zero3'`): it copies or prunes the module's parameters"
                " as whole tensors, while stage 3 holds each as a DTensor shard (it would fail mid-training with"
                " 'aten.copy_.default: got mixed torch.Tensor and DTensor'). Train with strategy='zero2' (or 'zero1',"
                f" 'data_parallel'), which keep whole parameters on every rank, or remove `{name}`."
            )
