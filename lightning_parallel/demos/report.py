"""What the main demo records beyond :class:`~lightning_parallel.demos.stats.RunStats`, and its PNG.

:class:`DemoRecorder` keeps the loss of every optimizer step and the bytes of parameters + gradients + optimizer
state each rank holds (the strategy's exact ``memory_report()``), gathers both to every rank at the end of fit (on
the strategy's root device, so NCCL takes them; the losses stay on the device until then, so no step waits for it)
and writes them into ``trainer.callback_metrics`` (Lightning's fork and spawn launchers bring those back to the
parent, where :func:`read_recording` reads them). On global rank 0 it also draws one progress line on a terminal, so the
demo shows a single progress display instead of one progress bar per rank.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

__all__ = ["RECORD_PREFIX", "DemoRecorder", "Recording", "read_recording", "recording_vector", "write_demo_figure"]

RECORD_PREFIX = "demo/"
"""Prefix of the keys :class:`DemoRecorder` writes into ``trainer.callback_metrics``."""

_MIB = 1024**2


@dataclass
class Recording:
    """What :func:`read_recording` returns for one finished run."""

    losses: list[float]
    """Training loss of every optimizer step, averaged over ranks (each rank's mean over its own batch)."""
    state_bytes: list[int] | None
    """Bytes of parameters + gradients + optimizer state held by each rank after the last step, indexed by global
    rank; ``None`` if the strategy has no ``memory_report()``."""


class DemoRecorder(Callback):
    """Record per-step losses and per-rank state bytes; show one progress line on rank 0 (on a terminal only).

    Args:
        label: Text in front of the progress line.
        total_steps: Optimizer steps the run will take (for ``step i/N``).
    """

    def __init__(self, label: str = "", total_steps: int = 0) -> None:
        self.label = label
        self.total_steps = total_steps
        # Each step's loss stays a 0-dim tensor on the device that computed it: reading it (`.item()`) would wait for
        # the device every step and hide any overlap of a step's collectives with the next one. Read once, at the end.
        self._losses: list[Tensor] = []
        self._state: tuple[int, int, int] | None = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().reshape(()).to(torch.float64, copy=True))
        else:
            self._losses.append(torch.tensor(math.nan, dtype=torch.float64))
        if trainer.is_global_zero and sys.stdout.isatty():
            # No loss here: rank 0's own batch loss is not the rank average the table shows.
            print(f"\r{self.label:<34} step {len(self._losses)}/{self.total_steps}", end="", flush=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Read once after the last step, not per batch: with ZeRO's overlapped all-gather, touching the parameters
        # between steps waits for their buckets (the stale-read guard) and would hide the overlap.
        self._state = None
        report = getattr(trainer.strategy, "memory_report", None)
        if callable(report) and self._losses:
            held = report()
            self._state = (held.parameters, held.gradients, held.optimizer_state)
        local = recording_vector(self._state, self._losses, device=trainer.strategy.root_device)
        gathered = _gather(local, trainer.world_size).cpu()  # (world_size, 3 + steps)
        metrics = trainer.callback_metrics
        metrics[RECORD_PREFIX + "losses"] = gathered[:, 3:].mean(dim=0)
        if self._state is not None:
            metrics[RECORD_PREFIX + "state_bytes"] = gathered[:, :3].sum(dim=1)


def recording_vector(state: tuple[int, int, int] | None, losses: Sequence[Tensor], *, device: torch.device) -> Tensor:
    """This rank's ``[parameters, gradients, optimizer_state, loss_1, ..., loss_n]`` as one float64 vector on
    ``device`` (the strategy's root device: NCCL refuses CPU tensors). float64 holds byte counts exactly below 2**53;
    ``-1`` stands for bytes the strategy does not report."""
    head = torch.tensor(state if state is not None else (-1, -1, -1), dtype=torch.float64, device=device)
    tail = [loss.to(device=device, dtype=torch.float64).reshape(1) for loss in losses]
    return torch.cat([head, *tail])  # (3 + steps,)


def _gather(local: Tensor, world_size: int) -> Tensor:
    """Every rank's ``local`` stacked, ``(world_size, n)``, on ``local``'s device. Collective when
    ``world_size > 1``."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return local.unsqueeze(0)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local)  # the list form has no deprecation warning
    return torch.stack(parts)


def read_recording(trainer: pl.Trainer) -> Recording:
    """The numbers :class:`DemoRecorder` left in ``trainer.callback_metrics`` (also in the parent of a fork launch).

    Raises:
        RuntimeError: If no :class:`DemoRecorder` finished in this trainer's fit.
    """
    metrics = trainer.callback_metrics
    losses = metrics.get(RECORD_PREFIX + "losses")
    if losses is None:
        raise RuntimeError("No DemoRecorder results in `trainer.callback_metrics`: add `DemoRecorder()` to callbacks.")
    state = metrics.get(RECORD_PREFIX + "state_bytes")
    return Recording(
        losses=[float(v) for v in torch.as_tensor(losses).reshape(-1)],
        state_bytes=None if state is None else [int(v) for v in torch.as_tensor(state).reshape(-1)],
    )


def write_demo_figure(runs: Sequence[tuple[str, Recording]], path: str | Path) -> bool:
    """Draw every run's loss curve on one plot and its state bytes per rank as bars; ``False`` without matplotlib.

    Args:
        runs: ``(label, recording)`` of each finished row, in table order.
        path: Where to write the PNG (parent folders are created).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (curves, bars) = plt.subplots(1, 2, figsize=(13, 4.5))
    for label, recording in runs:
        curves.plot(range(1, len(recording.losses) + 1), recording.losses, label=label, alpha=0.8)
    curves.set(xlabel="optimizer step", ylabel="training loss", title="Loss (same batches, same steps)")
    curves.legend(fontsize=8)
    with_state = [(label, r.state_bytes) for label, r in runs if r.state_bytes]
    world_size = max((len(s) for _, s in with_state), default=0)
    width = 0.8 / max(world_size, 1)
    for rank in range(world_size):
        heights = [s[rank] / _MIB if rank < len(s) else 0.0 for _, s in with_state]
        bars.bar([i + rank * width for i in range(len(with_state))], heights, width, label=f"rank {rank}")
    bars.set_xticks([i + 0.4 - width / 2 for i in range(len(with_state))])
    bars.set_xticklabels([label.split(" (")[0] for label, _ in with_state], rotation=20, fontsize=8)
    bars.set(ylabel="MiB", title="Parameters + gradients + optimizer state per rank")
    bars.legend(fontsize=8)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
