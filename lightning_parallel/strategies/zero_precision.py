"""The thin Lightning adapter of the ZeRO backends: the precision plugin ``ShardedOptimizerStrategy`` trains with.

The backends (``distributed/zero/backends/``) are torch-only; Lightning clips and scales through its precision
plugin. Gradient clipping over shards goes through ``strategies.clipping.with_clipping``, a subclass of whichever
precision plugin the Trainer chose (Lightning's ``FSDPPrecision`` pattern), calling the backend's
``clip_grad_norm_``; under ``16-mixed`` the grad scaler becomes torch's ``ShardedGradScaler`` wherever each rank sees
only a shard of the gradients. While the strategy lends whole gradients to ``.grad`` (``LentGradients``), a clip by the
user clips what is lent and the scaler unscales with the loan taken back and lent again (the hooks that follow read
unscaled gradients, as on one device).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer

from lightning_parallel.distributed.zero.backends import ZeroBackend
from lightning_parallel.lightning_optimizer import unwrap_optimizer
from lightning_parallel.strategies.clipping import ClipFunction, LentGradients, with_clipping, with_scaler

__all__ = ["LoanAwareGradScaler", "clipping_over_ranks", "with_sharded_grad_scaler", "zero_precision"]


def zero_precision(
    backend: ZeroBackend, plugin: Precision, device: torch.device, *, lent: LentGradients | None = None
) -> Precision:
    """The precision plugin to train with under ``backend``: ``plugin``, or one that clips over all shards
    (:attr:`ZeroBackend.clips_over_ranks`), acts on the gradients the strategy lends to ``.grad`` while lent
    (``lent``: clips them, unscales with the loan taken back, ends the loan after the ``on_before_optimizer_step``
    hooks) and agrees on inf/nan (:attr:`ZeroBackend.shards_gradients`)."""
    if backend.clips_over_ranks or lent is not None:
        plugin = with_clipping(plugin, clipping_over_ranks(backend), lent=lent)
    if backend.shards_gradients:
        plugin = with_sharded_grad_scaler(plugin, device, taken_back=None if lent is None else lent.taken_back)
    return plugin


def clipping_over_ranks(backend: ZeroBackend) -> ClipFunction:
    """``clip(optimizer, max_norm)`` for ``with_clipping``: the backend's ``clip_grad_norm_`` on the torch optimizer
    (manual optimization clips with Lightning's wrapper)."""

    def clip(optimizer: Optimizer, max_norm: float) -> None:
        backend.clip_grad_norm_(unwrap_optimizer(optimizer), max_norm)

    return clip


def with_sharded_grad_scaler(
    plugin: Precision,
    device: torch.device,
    *,
    taken_back: Callable[[], AbstractContextManager[None]] | None = None,
) -> Precision:
    """`16-mixed`: each rank sees only its shard's gradients, so the inf/nan check that decides whether to skip the
    step must be all-reduced, or ranks would diverge. Torch's ``ShardedGradScaler`` does exactly that; it unscales
    inside ``taken_back()`` (:class:`LoanAwareGradScaler`)."""
    if getattr(plugin, "scaler", None) is None:  # only MixedPrecision("16-mixed") has one
        return plugin
    return with_scaler(plugin, LoanAwareGradScaler(device=device.type, taken_back=taken_back))


class LoanAwareGradScaler(ShardedGradScaler):
    """Torch's ``ShardedGradScaler`` that unscales inside ``taken_back()``: Lightning unscales the optimizer's own
    tensors (this rank's shards) between backward and the ``on_before_optimizer_step`` hooks, while the whole
    gradients are lent to ``.grad``; unscaling the shards alone would leave the hooks reading scaled gradients and take
    back a change they make still scaled. Inside ``taken_back()`` the shards hold the gradients, lent again after."""

    def __init__(self, device: str, *, taken_back: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        super().__init__(device=device)
        self.taken_back = taken_back or nullcontext

    def unscale_(self, optimizer: Any) -> None:
        with self.taken_back():
            super().unscale_(optimizer)
