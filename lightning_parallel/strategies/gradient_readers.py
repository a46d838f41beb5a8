"""Which of a fit's code may read the parameters' ``.grad`` between backward and the optimizer step, and which did."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from types import FrameType

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

__all__ = ["GRADIENT_HOOKS", "gradient_readers", "lends_every_step", "reader_of_this_read"]

GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")
"""The hooks Lightning calls while gradients exist and before the step (its docs' place to inspect them)."""


def gradient_readers(module: pl.LightningModule, callbacks: Iterable[pl.Callback]) -> list[str]:
    """The code that may read ``.grad`` before the step, as ``"Class.hook"``: the step itself under manual
    optimization (``"Class.training_step"``: it reads ``.grad`` after ``manual_backward``), and every override of one
    of :data:`GRADIENT_HOOKS` by ``module`` or by a callback that is not this package's own (the monitor reads no
    gradient). A module or callback whose class sets ``reads_gradients = False`` is left out: it declares that its
    overrides read no gradient.

    Raises:
        TypeError: a ``reads_gradients`` that is not a bool (the same on every rank, before any collective).
    """
    for instance in (module, *callbacks):
        value = getattr(instance, "reads_gradients", None)
        if value is not None and not isinstance(value, bool):
            raise TypeError(
                f"`{type(instance).__name__}.reads_gradients = {value!r}`: set it to `False` (its gradient hooks"
                " read no `.grad`), `True` (lend the whole gradients at every step), or leave it out (lend at the first"
                " read)."
            )
    readers = []
    if _may_read(module):
        if not module.automatic_optimization:
            readers.append(f"{type(module).__name__}.training_step")
        readers += [f"{type(module).__name__}.{hook}" for hook in _overridden(module, pl.LightningModule)]
    for callback in callbacks:
        if type(callback).__module__.startswith("lightning_parallel.") or not _may_read(callback):
            continue
        readers += [f"{type(callback).__name__}.{hook}" for hook in _overridden(callback, pl.Callback)]
    return readers


def lends_every_step(module: pl.LightningModule, callbacks: Iterable[pl.Callback]) -> bool:
    """Whether ``module`` or a callback sets ``reads_gradients = True``: lend at every step, before the hooks, instead
    of at the first read (for code that reads on some ranks only and then runs a collective on every rank)."""
    return any(getattr(instance, "reads_gradients", None) is True for instance in (module, *callbacks))


def _may_read(instance: object) -> bool:
    return getattr(instance, "reads_gradients", True) is not False


def _overridden(instance: object, parent: type) -> list[str]:
    return [hook for hook in GRADIENT_HOOKS if is_overridden(hook, instance, parent)]


def reader_of_this_read() -> str:
    """Called during a read of ``.grad``: the innermost hook (or manual-optimization ``training_step``) of a
    LightningModule or callback on the call stack, as ``"Class.hook"``; else the innermost caller outside torch and
    this package."""
    frame: FrameType | None = sys._getframe(1)
    outside = None
    while frame is not None:
        code, owner = frame.f_code, frame.f_locals.get("self")
        if code.co_name in (*GRADIENT_HOOKS, "training_step") and isinstance(owner, pl.LightningModule | pl.Callback):
            return f"{type(owner).__name__}.{code.co_name}"
        module = str(frame.f_globals.get("__name__", ""))
        if outside is None and not module.startswith(("torch", "lightning_parallel.", "contextlib")):
            outside = f"{module}.{code.co_name}"
        frame = frame.f_back
    return outside or "unknown code"
