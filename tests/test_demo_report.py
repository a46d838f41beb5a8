"""demos/report.py: DemoRecorder hands the collective tensors on the strategy's root device (NCCL refuses CPU ones)
and reads no loss on the host per batch."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from distributed_harness import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_parallel.demos.report import DemoRecorder


class _Intercepted(Exception):
    pass


class _StopAtCollective(TorchDispatchMode):
    """Records the devices of the tensors handed to the first c10d collective, then stops before it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[torch.device] = []
        self.scalar_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            self.devices = [t.device for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
            raise _Intercepted
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar_reads += 1
        return func(*args, **(kwargs or {}))


def _gather_on_meta(rank: int, world_size: int) -> tuple[list[str], int]:
    # The root device is `meta`, a device that is not the CPU: a tensor built without it would show up as `cpu`.
    # The collective never runs (the mode stops at it), so meta tensors, which hold no data, are enough.
    strategy = SimpleNamespace(root_device=torch.device("meta"))
    trainer: Any = SimpleNamespace(strategy=strategy, world_size=world_size, is_global_zero=rank == 0)
    trainer.callback_metrics = {}
    recorder = DemoRecorder()
    mode = _StopAtCollective()
    with mode:
        for step in range(3):
            recorder.on_train_batch_end(trainer, None, {"loss": torch.ones((), device="meta")}, None, step)  # type: ignore[arg-type]
        reads_per_batch = mode.scalar_reads
        try:
            recorder.on_train_end(trainer, None)  # type: ignore[arg-type]
        except _Intercepted:
            pass
    return [str(device) for device in mode.devices], reads_per_batch


def test_the_gathered_tensors_are_on_the_root_device_and_no_batch_reads_its_loss() -> None:
    for devices, reads in run_distributed(_gather_on_meta, world_size=2):
        assert devices and set(devices) == {"meta"}, devices  # output list and input: all on the root device
        assert reads == 0
