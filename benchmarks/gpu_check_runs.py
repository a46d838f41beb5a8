"""The pieces of ``make gpu-check`` that run inside a fit: forced sharding at world size 1, the controls, the probe.

* :class:`ForcedShardingStrategy`: ZeRO 1/2/3 whose ``is_sharding`` is true at world size 1 too, so one GPU runs the
  sharded backends over NCCL (flat buckets, reduce-scatters, all-gathers, FSDP2, fp32 masters) where the plain
  strategy would fall back to the replicated backend; stages 1-2 also overlap the parameter all-gather with the next
  forward (the library turns the overlap off at world size 1: nothing to wait for there).
  ``hybrid=True`` adds the all-reduce of the reduced shards across replicas (hybrid sharding's ``replicate`` axis).
* :class:`ForcedDataParallelStrategy`: DDP wrapped at world size 1 too, so its gradient compression hook runs.
* :class:`RoundedGradients`: the one-device reference of a compressed run (each gradient rounded to the
  compression dtype, which is what the hook does with one rank).
* :class:`StaleForward`: the negative control, a one-device run whose forward reads the weights of the step before
  (a missed wait for an overlapped all-gather); the comparison must reject it.
* :class:`Probe`: peak memory of the fit, of saving a checkpoint mid-run and of loading it (a resumed fit), and
  checkpoints at mid-run and at the end whose weights are compared with the reference's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from typing_extensions import override

from lightning_parallel.accounting import peak_memory_bytes, reset_peak_memory
from lightning_parallel.distributed.zero.gather import OverlappedParameterGather
from lightning_parallel.distributed.zero.replica_reduction import ProcessGroupReplicas
from lightning_parallel.strategies import DataParallelStrategy, ShardedOptimizerStrategy

__all__ = [
    "PEAKS",
    "PROBE_PREFIX",
    "ForcedDataParallelStrategy",
    "ForcedShardingStrategy",
    "Probe",
    "RoundedGradients",
    "StaleForward",
    "read_peaks",
    "read_states",
]

PROBE_PREFIX = "gpu_check/"


class ForcedShardingStrategy(ShardedOptimizerStrategy):
    """ZeRO that shards at world size 1 too (a shard group of one rank), with the overlapped all-gather on.

    ``hybrid=True`` (stages 1-2): the buckets also all-reduce their reduced shards over the mesh's ``replicate`` axis
    (one rank here), the step hybrid sharding (``shard_size``) adds; the library takes that path only when the axis
    has two ranks or more. Stage 3's hybrid form (HSDP over a 2-D mesh) needs a ``replicate`` axis of two ranks.
    """

    def __init__(self, stage: Literal[1, 2, 3], *, hybrid: bool = False) -> None:
        if hybrid and stage == 3:
            raise ValueError("`ForcedShardingStrategy(3, hybrid=True)`: HSDP needs 2+ replicas; use stage 1 or 2.")
        super().__init__(stage, overlap_param_gather=True)
        self.hybrid = hybrid

    @property
    @override
    def is_sharding(self) -> bool:
        return True

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        backend: Any = self.backend
        if getattr(backend, "buckets", None) is None or trainer.state.fn != "fit":
            return  # not the flat buckets' backend (stages 1-2), or not fitting
        if backend.gather is None:
            # What `FlatBucketBackend.setup_optimizers` does at world size > 1 (`ZeroConfig.overlaps_param_gather`).
            backend.gather = OverlappedParameterGather(
                backend.buckets, backend.held, waiting=lambda: backend.events.timed("exposed_communication")
            )
        if self.hybrid:  # what `ShardedParameterBuckets(replicate_group=...)` builds for a replicate axis of 2+
            group = self.device_mesh.get_group("replicate")
            backend.buckets.replicate_group = group
            backend.buckets.replicas = ProcessGroupReplicas(group)


class ForcedDataParallelStrategy(DataParallelStrategy):
    """Data parallel that wraps the module in DDP at world size 1 too, so the gradient compression hook runs."""

    @override
    def configure_ddp(self) -> None:
        self._ddp_trainable = None
        DDPStrategy.configure_ddp(self)  # past DataParallelStrategy's world-size-1 shortcut
        self._remember_ddp_parameters()


class RoundedGradients(Callback):
    """Round every gradient to ``dtype`` and back before the step: a compressed all-reduce over one rank."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        for param in pl_module.parameters():
            if param.grad is not None:
                param.grad.copy_(param.grad.to(self.dtype).to(param.grad.dtype))


class StaleForward(Callback):
    """Each forward after the first reads the weights of the step before; backward and the step see current ones.

    This is what a missed wait for an overlapped all-gather does. Written through ``.data``, so autograd's version
    counters do not object to the weights changing between forward and backward (as they would not with the race).
    """

    def __init__(self) -> None:
        self._previous: list[Tensor] | None = None
        self._current: list[Tensor] = []

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        params = list(pl_module.parameters())
        self._current = [p.detach().clone() for p in params]
        if self._previous is not None:
            for param, stale in zip(params, self._previous, strict=True):
                param.data.copy_(stale)
        self._previous = self._current

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        for param, current in zip(pl_module.parameters(), self._current, strict=True):
            param.data.copy_(current)


class Probe(Callback):
    """Peak memory of the fit, of saving a checkpoint and of loading one; checkpoints mid-run and at the end.

    The peaks are per rank: ``torch.cuda.max_memory_allocated`` on CUDA (peak RSS on CPU), each over its own window:
    ``load`` from the callback's ``setup`` to ``on_train_start`` (the strategy's set-up and, when the fit resumes
    from a checkpoint, restoring it), ``save`` around saving ``directory/mid.ckpt`` after ``save_at`` steps, ``fit``
    the rest. Checkpoints are written by the strategy's ``save_checkpoint`` (collective): ``mid.ckpt``
    (``save_at=None``: none) and ``end.ckpt``. The peaks go to ``trainer.callback_metrics``, gathered to every rank,
    so the parent of a spawned run reads them with :func:`read_peaks`.
    """

    def __init__(self, directory: Path, *, save_at: int | None) -> None:
        self.directory = directory
        self.save_at = save_at
        self._peaks = {"fit": 0, "save": 0, "load": 0}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        reset_peak_memory(trainer.strategy.root_device)
        self._peaks = {"fit": 0, "save": 0, "load": 0}

    def _window(self, trainer: pl.Trainer, name: str) -> None:
        """Close the current peak window into ``name`` (keeping the largest) and start the next."""
        device = trainer.strategy.root_device
        self._peaks[name] = max(self._peaks[name], peak_memory_bytes(device))
        reset_peak_memory(device)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window(trainer, "load")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.save_at:
            return
        self._window(trainer, "fit")
        trainer.save_checkpoint(self.directory / "mid.ckpt")  # mid-run: in-flight all-gathers must be waited for
        self._window(trainer, "save")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window(trainer, "fit")
        trainer.save_checkpoint(self.directory / "end.ckpt")
        local = [self._peaks[name] for name in PEAKS]
        gathered: list[Any] = [local]
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            gathered = [None] * trainer.world_size
            dist.all_gather_object(gathered, local)  # plain numbers: any backend, any device
        for column, name in enumerate(PEAKS):
            values = [float(entry[column]) for entry in gathered]
            trainer.callback_metrics[PROBE_PREFIX + name] = torch.tensor(values, dtype=torch.float64)


PEAKS = ("fit", "save", "load")
"""The peak-memory windows of :class:`Probe`, in the order :func:`read_probe` returns them."""


def read_peaks(metrics: dict[str, Tensor]) -> dict[str, list[int]]:
    """Per-rank peaks of :class:`Probe` by window name, from ``trainer.callback_metrics``."""
    return {name: [int(v) for v in metrics[PROBE_PREFIX + name].reshape(-1).tolist()] for name in PEAKS}


def read_states(directory: Path, names: tuple[str, ...] = ("mid", "end")) -> dict[str, dict[str, Tensor]]:
    """The ``state_dict`` of the checkpoints ``directory/<name>.ckpt`` that exist (fp32, on CPU)."""
    states = {}
    for name in names:
        path = directory / f"{name}.ckpt"
        if path.exists():
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
            states[name] = {k: v.float() for k, v in checkpoint["state_dict"].items() if isinstance(v, Tensor)}
    return states
