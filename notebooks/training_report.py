"""What the notebooks show after a forked ``trainer.fit``: the loss curve and a per-rank memory table.

With ``start_method="fork"`` the notebook's process gets back rank 0's ``trainer.callback_metrics`` and the trained
weights, nothing else. So :class:`RankMemory` gathers every rank's bytes into rank 0's ``callback_metrics``, and the
loss curve is read back from the ``metrics.csv`` that rank 0's ``CSVLogger`` wrote.
"""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from IPython.display import Markdown
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_parallel.accounting import module_memory_report
from lightning_parallel.demos import summarize

__all__ = ["RankMemory", "csv_logger", "loss_curve", "memory_table", "plot_loss_curves"]

_FIELDS = ("parameters", "gradients", "optimizer_state")
_PREFIX = "memory/"
_LINE_STYLES = ("-", "--", "-.", ":")


class RankMemory(Callback):
    """At the end of ``fit``, every rank measures the bytes of parameters, gradients and optimizer state it holds
    (each tensor storage counted once); rank 0's ``callback_metrics`` then hold all ranks' numbers.

    ZeRO's own :meth:`~lightning_parallel.ShardedOptimizerStrategy.memory_report` is used where the strategy has one;
    otherwise the module's parameters and the optimizer's state tensors are measured (with pipeline parallelism a rank
    holds only its stages' layers).
    """

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if hasattr(strategy, "memory_report"):
            report = strategy.memory_report()
        else:
            report = module_memory_report(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
        local = torch.tensor([getattr(report, field) for field in _FIELDS], dtype=torch.float64)
        gathered = [local] if trainer.world_size == 1 else [torch.empty_like(local) for _ in range(trainer.world_size)]
        if trainer.world_size > 1:
            dist.all_gather(gathered, local)
        for rank, values in enumerate(gathered):
            for field, value in zip(_FIELDS, values.tolist(), strict=True):
                trainer.callback_metrics[f"{_PREFIX}{field}_rank{rank}"] = torch.tensor(value, dtype=torch.float64)


def csv_logger(name: str) -> CSVLogger:
    """A ``CSVLogger`` in a fresh temporary directory with a fixed version, so the notebook's process finds the file
    that rank 0 wrote (an unset version would be resolved again, to the next free number, in this process)."""
    return CSVLogger(save_dir=tempfile.mkdtemp(prefix=f"{name}-"), name=name, version=0)


def loss_curve(logger: CSVLogger) -> tuple[list[int], list[float]]:
    """The ``train_loss`` per optimizer step that rank 0 logged (``Trainer(log_every_n_steps=1)`` logs every step)."""
    steps, losses = [], []
    with (Path(logger.log_dir) / "metrics.csv").open() as file:
        for row in csv.DictReader(file):
            if row.get("train_loss"):
                steps.append(int(row["step"]))
                losses.append(float(row["train_loss"]))
    return steps, losses


def plot_loss_curves(curves: dict[str, tuple[list[int], list[float]]], title: str = "training loss") -> Any:
    """One line per run, each in its own style so that curves lying on top of each other stay visible; returns the
    matplotlib figure (a notebook shows it)."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    for index, (label, (steps, losses)) in enumerate(curves.items()):
        axes.plot(
            steps, losses, label=label, linestyle=_LINE_STYLES[index % len(_LINE_STYLES)], linewidth=2.5 - index * 0.4
        )
    axes.set(xlabel="optimizer step", ylabel="loss (rank 0's batch)", title=title)
    axes.legend()
    figure.tight_layout()
    plt.close(figure)  # shown once, as the cell's value
    return figure


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.2f}"


def memory_table(runs: dict[str, pl.Trainer]) -> Markdown:
    """A Markdown table, one row per run and rank: MiB of parameters, gradients and optimizer state held, and the
    process's peak RSS (needs :class:`RankMemory` and :class:`~lightning_parallel.demos.RunStats` callbacks).

    Peak RSS includes what each forked rank shares with the notebook's process (torch, Lightning, the data), so it
    differs little between strategies at these sizes; the first three columns are where sharding shows.
    """
    lines = [
        "| run | rank | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | total (MiB) | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, trainer in runs.items():
        metrics = trainer.callback_metrics
        peak = summarize(trainer)["peak_mem"]
        for rank, peak_bytes in enumerate(peak):
            held = [float(metrics[f"{_PREFIX}{field}_rank{rank}"]) for field in _FIELDS]
            cells = [label, str(rank), *map(_mib, held), _mib(sum(held)), _mib(peak_bytes)]
            lines.append("| " + " | ".join(cells) + " |")
    return Markdown("\n".join(lines))
