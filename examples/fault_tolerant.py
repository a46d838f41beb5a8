"""Survive a crashed rank: torchrun restarts the job and training resumes from the last checkpoint by itself.

    torchrun --nproc-per-node=2 --max-restarts=3 examples/fault_tolerant.py --strategy zero2 --dir runs/demo
    torchrun --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 ...  (multi-node)

The recipe (works with every strategy of this package): a ``ModelCheckpoint`` with ``save_last=True`` and
``trainer.fit(..., ckpt_path="last")``. On the first start there is no ``last.ckpt`` and training starts fresh; after a
restart, Lightning loads ``last.ckpt`` (model, optimizer, schedulers, loops) and continues. ``--kill-rank`` /
``--kill-at-step`` make one rank SIGKILL itself on the first attempt only, to try it.

Every step here trains on the same global batch, so the run ends with exactly the weights of an uninterrupted run
(tests/test_recovery.py checks that). With real data the order of batches after a mid-epoch resume is Lightning's.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset

GLOBAL_BATCH = 8


class FailOnce(pl.Callback):
    """SIGKILL rank ``rank`` at ``step`` on the first attempt; record open files, threads and children."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        self.resources: dict[str, tuple[int, int, int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Once after this attempt's first checkpoint save, and at the end: the two must be equal (no leaks).
        if "after_first_save" not in self.resources and trainer.checkpoint_callback.last_model_path:
            self.resources["after_first_save"] = _resources()
        if trainer.global_step == trainer.max_steps:
            self.resources["end"] = _resources()


def _resources() -> tuple[int, int, int]:
    children = sum(1 for p in Path("/proc").glob("[0-9]*/stat") if _parent_of(p) == os.getpid())
    return len(os.listdir("/proc/self/fd")), threading.active_count(), children


def _parent_of(stat: Path) -> int:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero2", help="a registry name: data_parallel, zero1/2/3, pipeline, ...")
    parser.add_argument("--dir", required=True, help="checkpoint directory (shared by all restarts)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="save a checkpoint every N steps")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    saver = pl.callbacks.ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every, save_last=True)
    watcher = FailOnce(args.kill_rank, args.kill_at_step)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=args.strategy,
        max_steps=args.max_steps,
        callbacks=[saver, watcher],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # One global batch per epoch, split over the data-parallel replicas (all stages of a pipeline share theirs).
    replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"] if world_size > 1 else 1
    loader = DataLoader(RandomTokenDataset(GLOBAL_BATCH, 16, seed=1), batch_size=GLOBAL_BATCH // replicas)
    model = GPTLightningModule("tiny", block_size=16, learning_rate=1e-3)
    trainer.fit(model, loader, ckpt_path="last")
    weights = trainer.strategy.lightning_module_state_dict()
    if trainer.is_global_zero:
        torch.save({"weights": weights, "resources": watcher.resources}, Path(args.dir) / "final.pt")
        print(f"finished at step {trainer.global_step}; resources (fds, threads, children): {watcher.resources}")


if __name__ == "__main__":
    main()
