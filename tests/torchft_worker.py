"""One replica group of a torchft run (tests/test_torchft.py starts these as its launcher), or the reference run.

``python tests/torchft_worker.py --out DIR --group G --groups N --steps S [--kill-at-step K]``: trains a tiny MLP on
one fixed global batch per step (group ``G`` reads its slice) with ``DataParallelStrategy(fault_tolerance=...)``
and the lighthouse from ``$TORCHFT_LIGHTHOUSE``; after every step it appends ``{"step", "time", "weights",
"participants", "loss"}`` to ``DIR/group{G}.jsonl``. ``--kill-at-step K`` SIGKILLs the process in the middle of the
step after ``K`` steps (after its backward, before the gradients are averaged over the groups). ``--zero STAGE``
trains with ``ShardedOptimizerStrategy(stage=STAGE, shard_size=--devices, fault_tolerance=...)`` instead (hybrid
sharding: ZeRO inside the group, torchft across groups; every rank records, with its ``"rank"``; the kill comes
before backward, since this strategy averages over the groups inside it). ``--reference`` trains the same global
batch on one device without the mode (``DIR/reference.jsonl``). ``--ckpt-dir D`` saves ``D/last.ckpt`` every 2 steps
and resumes from it (``ckpt_path="last"``), as a group restarted by torchrun would. ``--nan-at-step S``: this group's
loss is NaN in the step after ``S`` steps. ``--precision P``: the Trainer's precision (e.g. ``bf16-true``).
``--width W``: the hidden layer's width (a group configured unlike the others).
``--data DIR``: one epoch of ``tests/streamed_data.py``'s ``StreamedMLP`` instead (LitData chunks in ``DIR`` and a
Hugging Face streaming dataset, read by the group's own loaders); every record gets the step's sample indices
(``"indices": {"litdata": [...], "hf": [...]}``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streamed_data import StreamedMLP, batch_indices
from training_helpers import cpu_trainer

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.fault_tolerance import FaultTolerance

FEATURES, WIDTH, CLASSES, GLOBAL_BATCH = 12, 32, 4, 8


class TinyMLP(pl.LightningModule):
    def __init__(self, nan_at_step: int = -1, width: int = WIDTH) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, CLASSES))
        self.nan_at_step = nan_at_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.trainer.global_step == self.nan_at_step:
            loss = loss * float("nan")  # this group skips the step (`nonfinite_loss="skip"`)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)


def global_batch() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=generator)
    return TensorDataset(x, (x[:, :CLASSES] * 3).argmax(dim=1))


class Recorder(pl.Callback):
    """Records every step; SIGKILLs at ``kill_at_step``; stops at the step written in ``stop_file`` (if any)."""

    def __init__(
        self, path: Path, kill_at_step: int, stop_file: Path | None, pace: float, kill_before_backward: bool = False
    ) -> None:
        self.path, self.kill_at_step, self.stop_file, self.pace = path, kill_at_step, stop_file, pace
        self.kill_before_backward = kill_before_backward

    def on_before_backward(self, trainer, pl_module, loss):
        if self.kill_before_backward:
            self._maybe_kill(trainer)

    def on_after_backward(self, trainer, pl_module):
        if not self.kill_before_backward:
            self._maybe_kill(trainer)

    def _maybe_kill(self, trainer):
        # Mid-step: this group joined the step's quorum, the others' all-reduce will find it gone.
        if trainer.global_step == self.kill_at_step:
            # After the step's quorum set up the cross-group process group (a death during that set-up costs the
            # others the collective timeout instead: docs/reliability.md).
            trainer.strategy._replicas.sync.manager.wait_quorum()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        replicas = getattr(trainer.strategy, "_replicas", None)
        weights = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).tolist()
        record = {
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "time": time.time(),
            "weights": weights,
            "participants": replicas.sync.num_participants() if replicas is not None else 1,
            "loss": pl_module.last_loss,
        }
        if isinstance(batch, dict):  # `--data`: the samples this step trained on, per library
            record["indices"] = batch_indices(batch, pl_module.libraries)
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        if self.stop_file is not None and self.stop_file.exists():
            text = self.stop_file.read_text().strip()
            if text and trainer.global_step >= int(text):
                trainer.should_stop = True
        time.sleep(self.pace)


def main() -> TinyMLP:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--stop-file", type=Path, default=None, help="stop at the step written in this file")
    parser.add_argument("--devices", type=int, default=1, help="processes in this replica group")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--nan-at-step", type=int, default=-1, help="this group's loss is NaN at this step")
    parser.add_argument("--ckpt-dir", type=Path, default=None, help="save every 2 steps; resume from last.ckpt")
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage (1 or 2) inside each group; 0: data parallel")
    parser.add_argument("--precision", default="32-true", help="the Trainer's precision (and the reference's)")
    parser.add_argument("--width", type=int, default=WIDTH, help="the hidden layer's width")
    parser.add_argument("--data", type=Path, default=None, help="one epoch of LitData and HF streamed samples")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = TinyMLP(args.nan_at_step, args.width) if args.data is None else StreamedMLP(args.data)
    if args.reference:
        strategy, name, batch = "auto", "reference", GLOBAL_BATCH
    else:
        config = FaultTolerance(
            replica_group=args.group,
            num_replica_groups=args.groups,
            timeout=args.timeout,
            quorum_timeout=args.timeout,
            join_timeout=60.0,
        )
        if args.zero:
            strategy = ShardedOptimizerStrategy(args.zero, shard_size=args.devices, fault_tolerance=config)
        else:
            strategy = DataParallelStrategy(fault_tolerance=config)
        name, batch = f"group{args.group}", GLOBAL_BATCH // (args.groups * args.devices)
    callbacks: list[pl.Callback] = [
        Recorder(args.out / f"{name}.jsonl", args.kill_at_step, args.stop_file, args.pace, bool(args.zero))
    ]
    if args.ckpt_dir is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(args.ckpt_dir, every_n_train_steps=2, save_last=True))
    trainer = cpu_trainer(
        precision=args.precision,
        devices=1 if args.reference else args.devices,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=1 if args.data is not None else None,
        callbacks=callbacks,
        enable_checkpointing=args.ckpt_dir is not None,
    )
    resume = "last" if args.ckpt_dir is not None else None
    loader = DataLoader(global_batch(), batch_size=batch) if args.data is None else None
    trainer.fit(model, loader, ckpt_path=resume)
    return model


def fit_reference(steps: int, precision: str = "32-true") -> TinyMLP:
    """The same global batch on one device without the mode, in this process; returns the trained module."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = TinyMLP()
    trainer = cpu_trainer(
        precision=precision,
        devices=1,
        max_steps=steps,
    )
    trainer.fit(model, DataLoader(global_batch(), batch_size=GLOBAL_BATCH))
    return model


def global_loss(weights: list[float]) -> float:
    """The loss of ``weights`` (flattened parameters) on the whole global batch."""
    model = TinyMLP()
    torch.nn.utils.vector_to_parameters(torch.tensor(weights), model.parameters())
    x, y = global_batch().tensors
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model.net(x), y))


if __name__ == "__main__":
    main()
