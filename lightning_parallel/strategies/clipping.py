"""Clipping by a norm over parameters this rank does not all hold, through fixed subclasses of Lightning's precision
plugins.

Lightning clips through ``precision_plugin.clip_grad_by_norm``. Under ZeRO each rank holds a shard of the gradients,
under the pipeline the gradients of its stages only, so the norm must be reduced across ranks. Lightning's own
sharded strategies use a fixed precision class of their own (``FSDPPrecision``); so do we, one per precision
Lightning builds from ``Trainer(precision=...)``: :func:`with_clipping` builds the matching one from the Trainer's
plugin through the public constructors (the Trainer's plugin object is left as it is). A plugin class we do not know
(a user's own subclass) cannot be rebuilt from its constructor: only for it, :func:`with_clipping` falls back to an
adapter subclass created at run time that shares the plugin's attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "ClippingDoublePrecision",
    "ClippingHalfPrecision",
    "ClippingMixedPrecision",
    "ClippingPrecision",
    "LentGradients",
    "with_clipping",
    "with_scaler",
]

ClipFunction = Callable[[Optimizer, float], None]


@dataclass(frozen=True, kw_only=True)
class LentGradients:
    """How a strategy that lends whole gradients to the parameters' ``.grad`` between backward and the step
    (``distributed/zero/gradient_loan.py``) lets the precision plugin act on them as on one device."""

    hand_back: Callable[[], None]
    """Local. End the loan: called after the ``on_before_optimizer_step`` hooks, before Lightning's clipping and the
    optimizer's update, in automatic and manual optimization alike. No Lightning hook runs at that point, so the plugin
    overrides ``_clip_gradients``, which Lightning calls there (``Precision._after_closure``) whatever the clipping
    settings."""
    parameters: Callable[[Optimizer], list[Tensor] | None]
    """Local. While a loan is open, the module's parameters whose ``.grad`` hold the whole gradients ``optimizer``
    steps (a clip by the user, ``self.clip_gradients(opt, ...)`` in manual optimization, clips these: the ``.grad``
    read next is the clipped one, and what the loan's hand-back takes into the step); ``None`` when no loan is open."""
    unwatched: Callable[[], AbstractContextManager[None]]
    """Local. A context in which reading ``.grad`` lends nothing (the strategy lends at the first read): the clip
    over ranks reads the shards in it."""
    taken_back: Callable[[], AbstractContextManager[None]]
    """Collective while a loan is open. A context in which the optimizer's own tensors hold the gradients (the loan
    handed back on entry, open again on exit: lent at the next read): the grad scaler unscales in it (``16-mixed``),
    so that the hooks that follow read unscaled gradients and a change they make is not taken back still scaled."""


class _ClippingOverRanks:
    """What the clipping plugins add to Lightning's: ``clip_grad_by_norm`` calls :attr:`clip_over_ranks`, and the
    plugin acts on the gradients lent to ``.grad`` while a strategy lends them (:attr:`lent`)."""

    clip_over_ranks: ClipFunction
    """``clip(optimizer, clip_val)``: the strategy's clipping over ranks."""
    lent: LentGradients | None = None
    """The strategy's loan of whole gradients to ``.grad``, if it lends them."""

    def _lent_parameters(self, optimizer: Optimizer) -> list[Tensor] | None:
        return None if self.lent is None else self.lent.parameters(optimizer)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:  # Lightning's `Precision` hook
        lent = self._lent_parameters(optimizer)
        if lent is None:
            with nullcontext() if self.lent is None else self.lent.unwatched():
                self.clip_over_ranks(optimizer, float(clip_val))
        else:  # local: every rank holds every lent gradient whole (the same values), as one device does
            torch.nn.utils.clip_grad_norm_(lent, float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:  # Lightning's `Precision` hook
        lent = self._lent_parameters(optimizer)
        if lent is None:
            cast(Any, super()).clip_grad_by_value(optimizer, clip_val)
        else:
            torch.nn.utils.clip_grad_value_(lent, float(clip_val))

    def _clip_gradients(self, model: Any, optimizer: Any, clip_val: Any = None, gradient_clip_algorithm: Any = None):
        if self.lent is not None:
            self.lent.hand_back()
        return cast(Any, super())._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)


class ClippingPrecision(_ClippingOverRanks, Precision):
    """``"32-true"`` clipping over ranks."""

    def __init__(self, *, clip: ClipFunction) -> None:
        super().__init__()
        self.clip_over_ranks = clip


class ClippingDoublePrecision(_ClippingOverRanks, DoublePrecision):
    """``"64-true"`` clipping over ranks."""

    def __init__(self, *, clip: ClipFunction) -> None:
        super().__init__()
        self.clip_over_ranks = clip


class ClippingHalfPrecision(_ClippingOverRanks, HalfPrecision):
    """``"16-true"`` / ``"bf16-true"`` clipping over ranks."""

    def __init__(self, precision: Any, *, clip: ClipFunction) -> None:
        super().__init__(precision)
        self.clip_over_ranks = clip


class ClippingMixedPrecision(_ClippingOverRanks, MixedPrecision):
    """``"16-mixed"`` / ``"bf16-mixed"`` clipping over ranks (with the given grad scaler for ``"16-mixed"``)."""

    def __init__(self, precision: Any, device: str, scaler: torch.amp.GradScaler | None = None, *, clip: ClipFunction):
        super().__init__(precision, device, scaler)
        self.clip_over_ranks = clip


def with_clipping(plugin: Precision, clip: ClipFunction, *, lent: LentGradients | None = None) -> Precision:
    """A plugin like ``plugin`` whose ``clip_grad_by_norm(optimizer, clip_val)`` calls ``clip(optimizer, clip_val)``
    and that, with ``lent``, clips the gradients lent to ``.grad`` while they are lent and ends the loan after the
    ``on_before_optimizer_step`` hooks (before Lightning's clipping).

    The Trainer's plugin object is left as it is; a ``"16-mixed"`` plugin's grad scaler is shared. Applied to a plugin
    it built before (a second fit on the same strategy), it returns it with the new ``clip``.
    """
    if not isinstance(plugin, _ClippingOverRanks):
        plugin = _with_clipping(plugin, clip)
    assert isinstance(plugin, _ClippingOverRanks)
    plugin.clip_over_ranks = clip
    plugin.lent = lent
    return plugin


def _with_clipping(plugin: Precision, clip: ClipFunction) -> Precision:
    kind = type(plugin)
    if kind is Precision:
        return ClippingPrecision(clip=clip)
    if kind is DoublePrecision:
        return ClippingDoublePrecision(clip=clip)
    if kind is HalfPrecision:
        return ClippingHalfPrecision(cast(HalfPrecision, plugin).precision, clip=clip)
    if kind is MixedPrecision:
        mixed = cast(MixedPrecision, plugin)
        return ClippingMixedPrecision(mixed.precision, mixed.device, mixed.scaler, clip=clip)
    return _adapted(plugin, clip)


def with_scaler(plugin: Precision, scaler: torch.amp.GradScaler) -> Precision:
    """A ``"16-mixed"`` plugin like ``plugin`` (Lightning's or one of ours) with ``scaler``; other plugins as they are.

    Raises:
        TypeError: for a ``"16-mixed"`` plugin of a class we cannot rebuild (a user's own subclass).
    """
    if getattr(plugin, "scaler", None) is None:
        return plugin
    if type(plugin) is MixedPrecision:
        return MixedPrecision(cast(Any, plugin.precision), plugin.device, scaler)
    if type(plugin) is ClippingMixedPrecision:
        rebuilt = ClippingMixedPrecision(plugin.precision, plugin.device, scaler, clip=plugin.clip_over_ranks)
        rebuilt.lent = plugin.lent
        return rebuilt
    raise TypeError(
        f"The precision plugin `{type(plugin).__name__}` has a grad scaler, which must be torch's `ShardedGradScaler`"
        " when the gradients are sharded (each rank checks only its shard for inf/nan). Use"
        " `Trainer(precision='16-mixed')` without a custom plugin, or `precision='bf16-mixed'` (no scaler)."
    )


# ------------------------------------------------------------------------------------------ fallback adapter
_ADAPTER_TYPES: dict[type[Precision], type[Precision]] = {}


def _adapted(plugin: Precision, clip: ClipFunction) -> Precision:
    """The fallback for a precision class we do not know: a subclass made at run time (once per class), whose
    instance shares ``plugin``'s attributes. None of Lightning's hooks lets a strategy clip through a plugin whose
    constructor it cannot call."""
    base = type(plugin)
    if base not in _ADAPTER_TYPES:
        name = f"ClippingOverRanks{base.__name__}"
        _ADAPTER_TYPES[base] = type(name, (_ClippingOverRanks, base), {"__module__": __name__})
    cls = _ADAPTER_TYPES[base]
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(plugin.__dict__)
    cast(_ClippingOverRanks, wrapped).clip_over_ranks = clip
    return wrapped
