"""What ZeRO-3 and the pipeline refuse before training: Lightning callbacks that treat parameters as whole tensors.

``WeightAveraging`` (and ``EMAWeightAveraging``) and ``StochasticWeightAveraging`` keep a deep copy of the module
and copy between the two; ``ModelPruning`` masks parameters in place (globally over all of them by default). Under
ZeRO-3 each parameter is a DTensor shard, and under the pipeline a rank holds only its stage's layers (the others
are placeholders), so each fails mid-training (for SWA only once averaging starts, possibly after hours): ZeRO-3
with torch's "aten.copy_.default: got mixed torch.Tensor and DTensor", the pipeline with a size or device mismatch
between the copy and the stage. They are refused at set-up on every rank instead: a local check of the Trainer's
callbacks, so no rank is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging, WeightAveraging

__all__ = ["REFUSED_CALLBACKS", "check_parameter_callbacks"]

REFUSED_CALLBACKS: tuple[type, ...] = (WeightAveraging, StochasticWeightAveraging, ModelPruning)
"""Callbacks (and their subclasses) that copy or prune whole parameters."""


def check_parameter_callbacks(callbacks: Iterable[Any], *, strategy_name: str, layout: str) -> None:
    """Raise ``ValueError`` naming the first callback of :data:`REFUSED_CALLBACKS` in ``callbacks``, and the fix.

    Args:
        callbacks: the Trainer's callbacks.
        strategy_name: quoted in the error (``"zero3"``, ``"pipeline"``).
        layout: how this strategy holds parameters, e.g. ``"each parameter as a DTensor shard"``.
    """
    for callback in callbacks:
        if isinstance(callback, REFUSED_CALLBACKS):
            name = type(callback).__name__
            raise ValueError(
                f"`{name}` cannot run under strategy {strategy_name!r}: it copies or prunes the module's parameters"
                f" as whole tensors of the whole model, while this strategy holds {layout}, so it would fail"
                " mid-training. Train with strategy='zero2' (or 'zero1', 'data_parallel'), which keep whole"
                f" parameters on every rank, or remove `{name}`."
            )
