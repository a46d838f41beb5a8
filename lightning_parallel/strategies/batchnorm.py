"""One answer to ``Trainer(sync_batchnorm=True)`` per strategy and device, given before training starts.

Lightning turns every BatchNorm into torch's ``SyncBatchNorm`` when fitting starts, and torch finds out only later
that it cannot run there: on CPU, DDP's constructor raises "SyncBatchNorm layers only work with GPU modules", and
without DDP the first training forward raises "SyncBatchNorm expected input tensor to be on GPU or XPU or
privateuseone" (torch 2.13, measured on gloo, 2 ranks); a strategy that never applies the conversion (the pipeline)
accepted the flag and silently did nothing. Every strategy calls :func:`check_layer_sync` at the start of its
``setup`` instead, so each rank raises the same ``ValueError`` (the check reads only local facts) before any
collective of training.

Who calls it, and ``supported`` (the answer on a device torch's ``SyncBatchNorm`` runs on):
``DataParallelStrategy``: supported; ``ShardedOptimizerStrategy`` stages 1-3: supported (the conversion is
Lightning's module swap before sharding); ``PipelineParallelStrategy``: not supported, on any device.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

__all__ = ["UNSUPPORTED_DEVICE_TYPES", "check_layer_sync", "check_sync_batchnorm"]

UNSUPPORTED_DEVICE_TYPES: tuple[str, ...] = ("cpu", "mps")
"""Lightning's device types that torch's ``SyncBatchNorm.forward`` refuses in training (torch 2.13 accepts CUDA, XPU,
HPU and an out-of-tree ``privateuseone`` backend only; XLA runs under Lightning's own XLA strategies)."""

_WITHOUT_IT = (
    "each rank normalises with the statistics of its own batch; the running statistics saved in checkpoints are"
    " rank 0's"
)


def check_sync_batchnorm(strategy_name: str, device: torch.device, *, supported: bool) -> None:
    """Refuse ``Trainer(sync_batchnorm=True)`` where it cannot work; call it only when the flag is set.

    Reads local facts only, so every rank reaches the same verdict: call it on every rank before any collective.

    Args:
        strategy_name: the strategy's registry name, quoted in the error.
        device: this rank's device (``strategy.root_device``).
        supported: whether the strategy synchronises BatchNorm statistics on a device that torch's
            ``SyncBatchNorm`` supports.

    Raises:
        ValueError: the strategy does not support it, or ``device`` is one of :data:`UNSUPPORTED_DEVICE_TYPES`
            (CPU, MPS), naming the alternative.
    """
    if not supported:
        raise ValueError(
            f"`Trainer(sync_batchnorm=True)` is not supported by strategy {strategy_name!r}: remove"
            f" `sync_batchnorm=True` ({_WITHOUT_IT})."
        )
    if device.type in UNSUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"`Trainer(sync_batchnorm=True)` needs CUDA devices: torch's SyncBatchNorm cannot run on"
            f" {device.type.upper()} (this run's device is {device}; it refuses in the first training step)."
            f" With strategy {strategy_name!r} on {device.type.upper()} remove `sync_batchnorm=True` ({_WITHOUT_IT}),"
            " or train on GPUs with `accelerator='gpu'`."
        )


def check_layer_sync(layer_sync: object | None, strategy_name: str, device: torch.device, *, supported: bool) -> None:
    """:func:`check_sync_batchnorm` when ``layer_sync`` (the strategy's ``_layer_sync``, set by the Trainer) is the
    one ``Trainer(sync_batchnorm=True)`` installs; ``None`` or a user's own ``LayerSync`` plugin pass unchecked."""
    if isinstance(layer_sync, TorchSyncBatchNorm):
        check_sync_batchnorm(strategy_name, device, supported=supported)
