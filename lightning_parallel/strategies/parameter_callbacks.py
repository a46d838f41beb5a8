"""Lightning callbacks that copy or prune the module's parameters, under strategies that shard or split them.

**Weight averaging** (``WeightAveraging``, ``EMAWeightAveraging``, ``StochasticWeightAveraging``) works unchanged
under ZeRO-3 and the pipeline. Each callback deep-copies the whole module in its ``setup`` (before the strategy's),
then zips ``parameters()``/``buffers()`` of the copy and the module to update the average after steps or epochs,
to swap them around validation and to copy the average in at the end of training; it saves ``state_dict()`` of
the copy in ``on_save_checkpoint``/``state_dict`` and loads it back in ``on_load_checkpoint``/``load_state_dict``.
Under ZeRO-3 the module's parameters are DTensor shards and under the pipeline each rank holds only its stage, so
after the strategy sharded or split the module, :func:`hold_averaged_copies` makes each callback's copy hold the
same (``distributed/averaged_copy.py``): every update is then local, a rank keeps ``1/N`` or one stage of the
averages, and the copy's state dicts speak whole states (a gather to rank 0 when saving, a local slice when
loading), so the consolidated checkpoint holds exactly what the callback writes on one device.

The anchors fall short here: Lightning's ``FSDPStrategy`` refuses SWA ("SWA does not currently support sharded
models") and ``WeightAveraging`` warns that it "doesn't support sharding model layers"; under ``DDPStrategy`` both
average the whole model on every rank. Rather than wrapping or replacing the user's callback, we change only what
its copy holds (reached through the callback's private ``_average_model``: ``_compat.averaged_copy_of``) and hook
the copy's state dicts, so Lightning's hooks, their order and its checkpoint format stay exactly as they are.

**``ModelPruning``** masks parameters in place, globally over all of them by default, and is refused where a rank
does not hold whole parameters of the whole model (ZeRO-3, a pipeline of more than one rank): it would fail
mid-training. Refusals are local checks of the Trainer's callbacks, raised on every rank before any collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging, WeightAveraging
from torch import nn

from lightning_parallel._compat import averaged_copy_of
from lightning_parallel.distributed.averaged_copy import CopyHolding, HeldCopy, hold_copy

__all__ = [
    "AVERAGING_CALLBACKS",
    "REFUSED_CALLBACKS",
    "TrainerParameterCallbacks",
    "check_averaging_checkpoint_format",
    "check_parameter_callbacks",
    "hold_averaged_copies",
]

REFUSED_CALLBACKS: tuple[type, ...] = (ModelPruning,)
"""Callbacks (and their subclasses) that prune whole parameters."""

AVERAGING_CALLBACKS: tuple[type, ...] = (WeightAveraging, StochasticWeightAveraging)
"""Callbacks (and their subclasses) that average a copy of the module; see :func:`hold_averaged_copies`."""


def check_parameter_callbacks(callbacks: Iterable[Any], *, strategy_name: str, layout: str) -> None:
    """Raise ``ValueError`` naming the first callback of :data:`REFUSED_CALLBACKS` in ``callbacks``, and the fix.

    Args:
        callbacks: the Trainer's callbacks.
        strategy_name: quoted in the error (``"zero3"``, ``"pipeline"``).
        layout: how this strategy holds parameters, e.g. ``"each parameter as a DTensor shard"``.
    """
    name = _first_of(callbacks, REFUSED_CALLBACKS)
    if name is not None:
        raise ValueError(
            f"`{name}` cannot run under strategy {strategy_name!r}: it prunes the module's parameters as whole"
            f" tensors of the whole model, while this strategy holds {layout}, so it would fail mid-training."
            " Train with strategy='zero2' (or 'zero1', 'data_parallel'), which keep whole parameters on every"
            f" rank, or remove `{name}`."
        )


def check_averaging_checkpoint_format(callbacks: Iterable[Any], *, strategy_name: str, checkpoint_format: str) -> None:
    """Raise ``ValueError`` if a callback of :data:`AVERAGING_CALLBACKS` meets ``checkpoint_format="sharded"``.

    Weight averaging puts the averaged weights in place of the module's ``state_dict`` in the checkpoint (the
    module's own under ``current_model_state``), while the sharded format writes the weights from the module itself:
    the averages would be lost, and resuming would fail in the callback's ``on_load_checkpoint``.
    """
    name = _first_of(callbacks, AVERAGING_CALLBACKS)
    if checkpoint_format != "consolidated" and name is not None:
        raise ValueError(
            f"`{name}` needs `checkpoint_format='consolidated'` under strategy {strategy_name!r} (got"
            f" {checkpoint_format!r}): its checkpoints hold the averaged weights in place of the module's"
            " `state_dict`, which the sharded format writes from the module itself. Use the consolidated format"
            f" (the default), or remove `{name}`."
        )


def _first_of(callbacks: Iterable[Any], kinds: tuple[type, ...]) -> str | None:
    """The class name of the first of ``callbacks`` that is one of ``kinds`` (or a subclass), or ``None``."""
    return next((type(callback).__name__ for callback in callbacks if isinstance(callback, kinds)), None)


def hold_averaged_copies(callbacks: Iterable[Any], module: nn.Module, layout: CopyHolding) -> list[HeldCopy]:
    """Local. Make the averaged copy of every weight-averaging callback in ``callbacks`` hold what ``module`` now
    holds on this rank (call it after sharding or splitting ``module``, before the first step). Callbacks without a
    copy (not set up for ``fit``) are skipped.

    Raises:
        ValueError: If a copy cannot hold what the module holds (the module changed after the callback copied it).
    """
    copies = (averaged_copy_of(callback) for callback in callbacks)
    return [hold_copy(copy, module, layout) for copy in copies if copy is not None]


@dataclass(frozen=True)
class TrainerParameterCallbacks:
    """The Trainer's callbacks as the torch-only ZeRO backends see them (``distributed.zero_backends.context``'s
    ``ParameterCallbacks``): the checks and the averaged copies of this module."""

    callbacks: Sequence[Any]
    """The Trainer's callbacks."""

    def check(self, *, strategy_name: str, layout: str) -> None:
        """:func:`check_parameter_callbacks` over :attr:`callbacks`."""
        check_parameter_callbacks(self.callbacks, strategy_name=strategy_name, layout=layout)

    def hold_averaged_copies(self, module: nn.Module, layout: CopyHolding) -> list[HeldCopy]:
        """:func:`hold_averaged_copies` over :attr:`callbacks`."""
        return hold_averaged_copies(self.callbacks, module, layout)
