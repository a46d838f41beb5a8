"""The thin Lightning adapter of the ZeRO backends: the precision plugin ``ShardedOptimizerStrategy`` trains with.

The backends (``distributed/zero/backends/``) are torch-only; Lightning clips and scales through its precision
plugin. Gradient clipping over shards goes through ``strategies.clipping.with_clipping``, a subclass of whichever
precision plugin the Trainer chose (Lightning's ``FSDPPrecision`` pattern), calling the backend's
``clip_grad_norm_``; under ``16-mixed`` the grad scaler becomes torch's ``ShardedGradScaler`` wherever each rank sees
only a shard of the gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from lightning_parallel.distributed.zero.backends import ZeroBackend
from lightning_parallel.strategies.base import unwrap_optimizer
from lightning_parallel.strategies.clipping import ClipFunction, with_clipping, with_scaler

__all__ = ["clipping_over_ranks", "with_sharded_grad_scaler", "zero_precision"]


def zero_precision(
    backend: ZeroBackend,
    plugin: Precision,
    device: torch.device,
    *,
    after_gradient_hooks: Callable[[], None] | None = None,
) -> Precision:
    """The precision plugin to train with under ``backend``: ``plugin``, or one that clips over all shards
    (:attr:`ZeroBackend.clips_over_ranks`), calls ``after_gradient_hooks()`` after the ``on_before_optimizer_step``
    hooks (where the strategy takes back the gradients it lent them) and agrees on inf/nan
    (:attr:`ZeroBackend.shards_gradients`)."""
    if backend.clips_over_ranks or after_gradient_hooks is not None:
        plugin = with_clipping(plugin, clipping_over_ranks(backend), after_gradient_hooks=after_gradient_hooks)
    if backend.shards_gradients:
        plugin = with_sharded_grad_scaler(plugin, device)
    return plugin


def clipping_over_ranks(backend: ZeroBackend) -> ClipFunction:
    """``clip(optimizer, max_norm)`` for ``with_clipping``: the backend's ``clip_grad_norm_`` on the torch optimizer
    (manual optimization clips with Lightning's wrapper)."""

    def clip(optimizer: Optimizer, max_norm: float) -> None:
        backend.clip_grad_norm_(unwrap_optimizer(optimizer), max_norm)

    return clip


def with_sharded_grad_scaler(plugin: Precision, device: torch.device) -> Precision:
    """`16-mixed`: each rank sees only its shard's gradients, so the inf/nan check that decides whether to skip the
    step must be all-reduced, or ranks would diverge. Torch's ``ShardedGradScaler`` does exactly that."""
    if getattr(plugin, "scaler", None) is None:  # only MixedPrecision("16-mixed") has one
        return plugin
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return with_scaler(plugin, ShardedGradScaler(device=device.type))
