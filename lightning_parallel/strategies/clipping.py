"""Clipping by a norm over parameters this rank does not all hold, as a subclass of the Trainer's precision plugin.

Lightning clips through ``precision_plugin.clip_grad_by_norm``. Under ZeRO each rank holds a shard of the gradients,
under the pipeline the gradients of its stages only, so the norm must be reduced across ranks. Rather than replace
the method on the Trainer's plugin object, :func:`with_clipping` returns a copy whose class subclasses the plugin's
own (``32-true``, ``16-mixed``, ``bf16-mixed``, ...), so all its other behaviour stays: Lightning's
``FSDPPrecision`` pattern, for whichever plugin the user chose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

__all__ = ["with_clipping"]

ClipFunction = Callable[[Optimizer, float], None]


class _ClippingOverRanks:
    """Marks a precision plugin built by :func:`with_clipping`."""

    _clip_over_ranks: ClipFunction

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._clip_over_ranks(optimizer, float(clip_val))


_CLIPPING_TYPES: dict[type[Precision], type[Precision]] = {}


def _clipping_type(base: type[Precision]) -> type[Precision]:
    if base not in _CLIPPING_TYPES:
        name = f"ClippingOverRanks{base.__name__}"
        _CLIPPING_TYPES[base] = type(name, (_ClippingOverRanks, base), {"__module__": __name__})
    return _CLIPPING_TYPES[base]


def with_clipping(plugin: Precision, clip: ClipFunction) -> Precision:
    """A copy of ``plugin`` whose ``clip_grad_by_norm(optimizer, clip_val)`` calls ``clip(optimizer, clip_val)``.

    The Trainer's plugin object is left as it is; the copy shares its attributes (the grad scaler, ...). Applied to
    a plugin it built before (a second fit on the same strategy), it keeps the type and takes the new ``clip``.
    """
    if isinstance(plugin, _ClippingOverRanks):
        plugin._clip_over_ranks = clip
        return plugin
    cls = _clipping_type(type(plugin))
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(plugin.__dict__)
    cast(_ClippingOverRanks, wrapped)._clip_over_ranks = clip
    return wrapped
