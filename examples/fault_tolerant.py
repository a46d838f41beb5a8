"""Survive a crashed rank: torchrun restarts the job and training resumes from the last checkpoint by itself.

    torchrun --nproc-per-node=2 --max-restarts=3 examples/fault_tolerant.py --strategy zero2 --dir runs/demo
    torchrun --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 ...  (multi-node)

Or keep training without restarting anyone (``pip install 'lightning-parallel[torchft]'``, docs/reliability.md):
each replica group is its own job, and the groups meet at torchft's lighthouse. On one machine, two groups of one
process each (a different ``--master-port`` per group; ``--kill-at-step`` kills group 1 once, torchrun restarts it,
it fetches the weights from group 0 and rejoins)::

    torchft_lighthouse --min_replicas 1 --bind [::]:29510 --join_timeout_ms 5000 --heartbeat_timeout_ms 2000 &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    torchrun --nproc-per-node=1 --master-port=29600 --max-restarts=3 examples/fault_tolerant.py --dir runs/ft \
        --replica-group 0 --num-replica-groups 2 &
    torchrun --nproc-per-node=1 --master-port=29700 --max-restarts=3 examples/fault_tolerant.py --dir runs/ft \
        --replica-group 1 --num-replica-groups 2 --kill-rank 0 --kill-at-step 50

On a cluster: the lighthouse on one host (``--bind [::]:29510``), ``TORCHFT_LIGHTHOUSE=http://THAT_HOST:29510`` for
every group, and each group its own job (its own SLURM job or torchrun with its own ``--rdzv-endpoint``; several
processes per group train as ``DataParallelStrategy`` inside the group), with ``--replica-group`` 0..N-1.

Hybrid sharding across groups: ``--strategy zero1`` or ``zero2`` with several processes per group shards the optimizer
state (and gradients) over the group's processes and averages the shards across the groups through torchft
(``ShardedOptimizerStrategy(stage, shard_size=<processes per group>, fault_tolerance=...)``)::

    torchrun --nproc-per-node=2 --master-port=29600 --max-restarts=3 examples/fault_tolerant.py --dir runs/ft \
        --strategy zero2 --replica-group 0 --num-replica-groups 2 &
    torchrun --nproc-per-node=2 --master-port=29700 --max-restarts=3 examples/fault_tolerant.py --dir runs/ft \
        --strategy zero2 --replica-group 1 --num-replica-groups 2 --kill-rank 0 --kill-at-step 50

The recipe (works with every strategy of this package): a ``ModelCheckpoint`` with ``save_last=True`` and
``trainer.fit(..., ckpt_path="last")``. On the first start there is no ``last.ckpt`` and training starts fresh; after a
restart, Lightning loads ``last.ckpt`` (model, optimizer, schedulers, loops) and continues. ``--kill-rank`` /
``--kill-at-step`` make one rank SIGKILL itself on the first attempt only, to try it.

Every step here trains on the same global batch, so the run ends with exactly the weights of an uninterrupted run
(tests/test_recovery.py checks that). With real data the order of batches after a mid-epoch resume is Lightning's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.fault_tolerance import FaultTolerance

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


class StepTimes(pl.Callback):
    """Rank 0 appends ``{"step", "time", "groups"}`` per step to a JSON-lines file (benchmarks/torchft_overhead.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank != 0:
            return
        replicas = getattr(trainer.strategy, "_replicas", None)
        groups = replicas.sync.num_participants() if replicas is not None else 1
        line = json.dumps({"step": trainer.global_step, "time": time.time(), "groups": groups})
        with self.path.open("a") as file:
            file.write(line + "\n")


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
    parser.add_argument(
        "--strategy",
        default=None,
        help="a registry name: data_parallel, zero1/2/3, pipeline, ... (default zero2; torchft mode: data_parallel,"
        " or zero1/zero2 for hybrid sharding across the groups)",
    )
    parser.add_argument("--shard-size", type=int, default=None, help="zero1/zero2 without torchft: hybrid sharding")
    parser.add_argument("--dir", required=True, help="checkpoint directory (shared by all restarts)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="save a checkpoint every N steps")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--replica-group", type=int, default=-1, help="torchft mode: this job's replica group")
    parser.add_argument("--num-replica-groups", type=int, default=0, help="torchft mode: how many groups")
    parser.add_argument("--preset", default="tiny", help="the demo GPT's size: tiny, small, ...")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help="samples per step over all replicas")
    parser.add_argument("--record", type=Path, default=None, help="append per-step times to this JSON-lines file")
    args = parser.parse_args()
    fault_tolerant = args.num_replica_groups > 0

    torch.set_num_threads(1)
    pl.seed_everything(0)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    name = args.strategy or ("data_parallel" if fault_tolerant else "zero2")
    strategy: str | pl.strategies.Strategy = name
    if name in ("zero1", "zero2") and args.shard_size is not None:
        strategy = ShardedOptimizerStrategy(int(name[-1]), shard_size=args.shard_size)
    directory = Path(args.dir)
    if fault_tolerant:
        # Each group checkpoints into its own folder: a restart of every group at once resumes from there; one
        # group restarted alone fetches the newer state from a live group instead.
        config = FaultTolerance(replica_group=args.replica_group, num_replica_groups=args.num_replica_groups)
        if name in ("zero1", "zero2"):  # shard inside the group (all of its processes), torchft across the groups
            strategy = ShardedOptimizerStrategy(int(name[-1]), shard_size=world_size, fault_tolerance=config)
        elif name == "data_parallel":
            strategy = DataParallelStrategy(fault_tolerance=config)
        else:
            parser.error(f"--strategy {name} has no torchft mode: use data_parallel, zero1 or zero2")
        directory = directory / f"group{args.replica_group}"
    saver = pl.callbacks.ModelCheckpoint(dirpath=directory, every_n_train_steps=args.every, save_last=True)
    watcher = FailOnce(args.kill_rank, args.kill_at_step)
    callbacks: list[pl.Callback] = [saver, watcher] + ([StepTimes(args.record)] if args.record else [])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # One global batch per epoch, split over the data-parallel replicas (all stages of a pipeline share theirs) and,
    # in torchft mode, over the replica groups.
    replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"] if world_size > 1 or fault_tolerant else 1
    dataset = RandomTokenDataset(args.global_batch, args.seq_len, seed=1)
    loader = DataLoader(dataset, batch_size=args.global_batch // replicas)
    model = GPTLightningModule(args.preset, block_size=args.seq_len, learning_rate=1e-3)
    trainer.fit(model, loader, ckpt_path="last")
    weights = trainer.strategy.lightning_module_state_dict()
    if trainer.is_global_zero:
        torch.save({"weights": weights, "resources": watcher.resources}, directory / "final.pt")
        print(f"finished at step {trainer.global_step}; resources (fds, threads, children): {watcher.resources}")


if __name__ == "__main__":
    main()
